"""Volunteers behind NAT (docs/design.md §6, issue 24): every client runs `--client-mode`, dialing out only, so no
worker of a stage can reduce a part of its all-reduce; the stage's servers, reachable and in every group with the
stage's state, reduce for them. A joiner or a restarted client loads the state from those servers (a client-mode
mate cannot be dialed), and a round that fails ends no process."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
from test_gradients import MICROBATCHES, MODEL, ROWS, SEED, SEQ, check_dumps

from p2ptrain.client.worker import FAILED_AVERAGING_EPOCH
from p2ptrain.config import RunConfig

RECIPE = ["--model", MODEL, "--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES),
          "--seq-len", str(SEQ), "--seed", str(SEED)]
CLIENTS = {"c0a": "0", "c0b": "0", "c1a": "1", "c1b": "1"}
BEHIND_NAT = ["--client-mode"]


def exact(report: dict, *, except_: set[tuple[int, int]] = frozenset()) -> None:
    """Every closed epoch averaged every row of the batch at every stage, but at the (epoch, stage) in `except_`."""
    for epoch in report["epochs"]:
        for counts in epoch["stages"]:
            if (epoch["epoch"], counts["stage"]) in except_:
                continue
            assert counts["rows_averaged"] == counts["rows_in_batch"] == ROWS * MICROBATCHES, epoch
            assert counts["rounds_failed"] == 0, epoch


@pytest.mark.timeout(420)
def test_a_swarm_whose_clients_all_dial_out_only_trains_as_one_process(make_swarm, tmp_path):
    epochs, dumps = 10, tmp_path / "steps"
    # averaging in fp32: the steps are compared with one process's to 1e-5, past int8's rounding
    swarm = make_swarm("nat", [*RECIPE, "--dump-grads", str(dumps), "--averaging-codec", "fp32"])
    swarm.start_two_stages(CLIENTS, epochs=epochs, client_args={name: BEHIND_NAT for name in CLIENTS})
    report = swarm.wait_finished(timeout=300)

    assert [e["epoch"] for e in report["epochs"] if not e["abandoned"]] == list(range(epochs))
    exact(report)
    assert [stage["client_mode_workers"] for stage in report["stages"]] == [2, 2], report["stages"]
    # the first batch's gradients are one process's (1e-5), and so are the parameters stepped on them, but for the
    # few entries whose gradient cancels to rounding (`check_dumps`)
    check_dumps(dumps, {0: 2, 1: 2}, lr=RunConfig().lr, same_params=True, rounding_floor=1e-4)
    losses = [e["loss"] for e in report["epochs"]]
    assert losses[-1] < losses[0], losses
    assert swarm.failed() == []


@pytest.mark.timeout(420)
def test_a_restarted_client_mode_worker_loads_from_the_servers_and_a_failed_round_ends_no_process(make_swarm):
    epochs = 10
    swarm = make_swarm("natfaults", [*RECIPE, "--averaging-timeout", "5", "--dpu", "on"])
    client_args = {name: BEHIND_NAT for name in CLIENTS} | {"c1a": [*BEHIND_NAT, "--fault", "failed-averaging"]}
    swarm.start_two_stages(CLIENTS, epochs=epochs, client_args=client_args)
    closed = r"stage 0 FS: epoch (\d+) closed"
    deadline = time.monotonic() + 240
    while max((int(n) for n in re.findall(closed, (swarm.workdir / "fs0.log").read_text())), default=-1) < 5:
        assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
        time.sleep(0.05)
    process = swarm.processes.pop("c0a")
    os.killpg(process.pid, signal.SIGKILL)  # the client and its p2p daemon, without notice
    process.wait()
    os.rename(swarm.workdir / "c0a.log", swarm.workdir / "c0a.killed.log")
    swarm.peer("c0a", "--role", "client", "--stage", "0", *BEHIND_NAT)  # the same command again
    report = swarm.wait_finished(timeout=300)

    servers = {re.search(r"server (\S+) up", (swarm.workdir / f"{name}.log").read_text()).group(1)
               for name in ("fs0", "bs0")}
    loaded = re.search(r"loaded the state of epoch \d+ from (\S+)", (swarm.workdir / "c0a.log").read_text())
    assert loaded and loaded.group(1) in servers, (swarm.workdir / "c0a.log").read_text()[-3000:]
    log = (swarm.workdir / "c1a.log").read_text()
    assert f"averaging of epoch {FAILED_AVERAGING_EPOCH} failed (RuntimeError('fault failed-averaging" in log, log[-3000:]
    assert swarm.failed() == [] and swarm.processes["c1a"].poll() is None  # it went on taking tasks
    # once a round succeeds again it takes a mate's state (with DPU, one that may hold later steps too, up to the
    # run's last), or, where every mate's round failed alike and none serves, steps on with them
    assert "took a mate's state after epoch" in log or max(
        int(n) for n in re.findall(r"stage 1 stepped epoch (\d+) ", log)) > FAILED_AVERAGING_EPOCH, log[-3000:]
    assert report["epochs"][FAILED_AVERAGING_EPOCH]["stages"][1]["rounds_failed"] >= 1, report["epochs"]
    assert [e["epoch"] for e in report["epochs"] if not e["abandoned"]] == list(range(epochs))
    exact(report, except_={(FAILED_AVERAGING_EPOCH, 1)})
    # whoever reloaded whose state, the stage's holders step alike after the failed round
    for epoch in report["epochs"][FAILED_AVERAGING_EPOCH + 1:]:
        assert all(stage["digests_agree"] is not False for stage in epoch["stages"]), epoch
