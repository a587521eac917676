"""Bad input from a worker (docs/design.md: "a peer sending a tensor of the wrong shape or NaNs"): the servers refuse it
with a clear logged error, hand its rows to another worker, and no row is lost or counted twice."""
from __future__ import annotations

import time

import pytest

ROWS, MICROBATCHES, EPOCHS = 4, 2, 2
RECIPE = ["--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES), "--seq-len", "32",
          "--epochs", str(EPOCHS), "--lease-timeout", "20"]


def stage_workers(report: dict, stage: int) -> list[str]:
    return report["stages"][stage]["workers"] if len(report["stages"]) > stage else []


@pytest.mark.timeout(400)
def test_corrupted_results_are_refused_and_redone_by_another_worker(make_swarm):
    swarm = make_swarm("faults", RECIPE)
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    for fault in ("wrong-shape", "wrong-dtype", "nan"):
        swarm.peer(f"bad-{fault}", "--role", "client", "--stage", "1", "--fault", fault)
    swarm.peer("good", "--role", "client", "--stage", "1")
    # the data source (stage 0's FS) starts once all four workers are up, so each gets rows of its own
    deadline = time.monotonic() + 180
    while len(stage_workers(swarm.status(), 1)) < 4:
        assert time.monotonic() < deadline, "the stage-1 workers did not come up\n" + swarm.logs()
        time.sleep(1.0)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--compute")
    report = swarm.wait_finished(timeout=300)

    fs1_log = (swarm.workdir / "fs1.log").read_text()
    refusals = [line for line in fs1_log.splitlines() if "refused PushInputGrads" in line and "result of task" in line]
    assert any("input gradients" in line and "shape" in line for line in refusals), fs1_log[-3000:]
    assert any("input gradients" in line and "dtype" in line for line in refusals), fs1_log[-3000:]
    assert any("input gradients" in line and ("NaN" in line or "Inf" in line) for line in refusals), fs1_log[-3000:]

    assert [e["epoch"] for e in report["epochs"]] == list(range(EPOCHS))
    for epoch in report["epochs"]:
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == ROWS * MICROBATCHES, epoch
            assert stage["rows_averaged"] == ROWS * MICROBATCHES, epoch
    assert sum(e["stages"][1]["tasks_redone"] for e in report["epochs"]) >= 3
    assert report["loss"] is not None and report["loss"] == report["loss"]  # a finite loss, no NaN got through
