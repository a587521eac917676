"""Servers keep their stage's state on disk (`state.checkpoint`): a checkpoint round-trips bit-equal; a truncated,
corrupt or mismatched one is refused with a message naming the file and what differs, and nothing of it is loaded;
and a swarm whose peers are all SIGKILLed and started again with the same commands resumes at the saved epoch."""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2ptrain.client.worker import Worker
from p2ptrain.config import RunConfig
from p2ptrain.dht import start_dht
from p2ptrain.launch import Swarm
from p2ptrain.state.checkpoint import CheckpointError, load_checkpoint, manifests, save_checkpoint
from p2ptrain.status import History, collect
from tests.lone import give_gradients, lone_worker, stepped_alone

CONFIG = RunConfig(num_stages=2, rows_per_microbatch=4, microbatches=1, seq_len=8)


def make_worker(config: RunConfig = CONFIG, stage: int = 0) -> Worker:
    return lone_worker(config, stage=stage)


def stepped_worker() -> Worker:
    worker = make_worker()
    give_gradients(worker, seed=0)
    return stepped_alone(worker)


def save(worker: Worker, folder: Path, *, config: RunConfig = CONFIG, epoch: int | None = None) -> Path:
    current, model_state, optimizer_state = worker.master.snapshot()
    epoch = current if epoch is None else epoch
    return save_checkpoint(folder, config=config, stage=0, layers=CONFIG.stage_layers(0), role="fs", epoch=epoch,
                           batch=0, model_state=model_state, optimizer_state=optimizer_state)


def load(folder: Path, worker: Worker, *, config: RunConfig = CONFIG, stage: int = 0):
    return load_checkpoint(folder, config=config, stage=stage, layers=config.stage_layers(stage),
                           params=worker.master)


def test_a_checkpoint_round_trips_bit_equal(tmp_path):
    worker = stepped_worker()
    save(worker, tmp_path)
    assert load(tmp_path / "none", worker) is None
    fresh = make_worker()
    checkpoint, model_state, optimizer_state = load(tmp_path, fresh)
    assert (checkpoint.epoch, checkpoint.batch) == (1, 0)
    fresh.load_state(model_state=model_state, optimizer_state=optimizer_state, epoch=checkpoint.epoch)
    for (name, a), b in zip(worker.master.module.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.epoch == fresh.master.epoch == 1
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(("damage", "says"), [
    ("truncate", r"state-1\.safetensors: \d+ bytes, the manifest says \d+ \(truncated\?\)"),
    ("flip", r"state-1\.safetensors: its SHA-256 differs from the manifest's \(corrupt\)"),
    ("manifest", r"manifest-1\.json: not a checkpoint manifest"),
    ("missing", r"state-1\.safetensors: cannot be read"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, says):
    worker = stepped_worker()
    save(worker, tmp_path)
    tensors = tmp_path / "state-1.safetensors"
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif damage == "manifest":
        (tmp_path / "manifest-1.json").write_text("{not json")
    else:
        tensors.unlink()
    fresh = make_worker()
    before = [p.clone() for p in fresh.master.module.parameters()]
    with pytest.raises(CheckpointError, match=says):
        load(tmp_path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.master.module.parameters()))  # nothing loaded


def test_a_checkpoint_of_another_run_recipe_or_stage_is_refused_naming_what_differs(tmp_path):
    save(stepped_worker(), tmp_path)
    other = RunConfig(num_stages=2, rows_per_microbatch=4, microbatches=1, seq_len=16)
    with pytest.raises(CheckpointError, match=r"manifest-1\.json: saved with seq_len = 8, this run has 16"):
        load(tmp_path, make_worker(other), config=other)
    another_run = RunConfig(run_id="another", num_stages=2, rows_per_microbatch=4, microbatches=1, seq_len=8)
    with pytest.raises(CheckpointError, match=r"saved by run 'p2ptrain', this is run 'another'"):
        load(tmp_path, make_worker(another_run), config=another_run)
    with pytest.raises(CheckpointError, match=r"manifest-1\.json: holds stage 0 layers \[0, 2\], this server serves "
                                              r"stage 1 layers \[2, 4\]"):
        load(tmp_path, make_worker(stage=1), stage=1)


def test_only_the_newest_checkpoints_are_kept_and_a_damaged_newest_falls_back_to_the_one_before(tmp_path, caplog):
    worker = stepped_worker()
    for epoch in (2, 4, 6):
        save(worker, tmp_path, epoch=epoch)
    assert [epoch for epoch, _ in manifests(tmp_path)] == [6, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest-4.json", "manifest-6.json",
                                                          "state-4.safetensors", "state-6.safetensors"]
    newest = tmp_path / "state-6.safetensors"
    newest.write_bytes(newest.read_bytes()[:-10])
    checkpoint, _, _ = load(tmp_path, make_worker())
    assert checkpoint.epoch == 4
    assert "state-6.safetensors" in caplog.text and "truncated" in caplog.text
    assert "loading the older checkpoint" in caplog.text and "manifest-4.json" in caplog.text
    older = tmp_path / "state-4.safetensors"
    older.write_bytes(older.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"state-6\.safetensors: \d+ bytes"):  # none valid: the newest's error
        load(tmp_path, make_worker())


# -- a whole swarm killed and started again -------------------------------------------------------------------------

RECIPE = ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "8", "--microbatches", "2", "--seq-len",
          "64", "--seed", "9", "--lr", "0.003", "--epochs", "400"]
SERVERS = [("fs0", "0", "fs"), ("bs0", "0", "bs"), ("fs1", "1", "fs"), ("bs1", "1", "bs")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RestartableSwarm(Swarm):
    """Every peer started from a fixed command line (the bootstrap on a fixed port with an identity, the servers
    with identities and checkpoint folders), so that all can be killed and started again with the same commands."""

    def __init__(self, workdir: Path, run_id: str):
        super().__init__(workdir=workdir)
        self.run_id, self.port = run_id, free_port()
        self.commands: dict[str, list[str]] = {}
        self.commands["bootstrap"] = ["--role", "bootstrap", "--run-id", run_id, "--identity-path",
                                      str(workdir / "bootstrap.key"), "--host-maddrs",
                                      f"/ip4/127.0.0.1/tcp/{self.port}", "--maddrs-file",
                                      str(workdir / "bootstrap.maddrs")]
        self._dht = None
        self._history = History()

    def start_all(self, incarnation: int) -> None:
        maddrs = self.workdir / "bootstrap.maddrs"
        maddrs.unlink(missing_ok=True)
        self.start(f"bootstrap.{incarnation}", self.commands["bootstrap"])
        deadline = time.monotonic() + 120
        while not (maddrs.exists() and maddrs.read_text().strip()):
            assert time.monotonic() < deadline, "the bootstrap peer did not come up"
            time.sleep(0.2)
        initial = maddrs.read_text().split()
        # read by a DHT client in this process, every epoch its reads saw kept: a record carries its peer's newest
        # epochs only (a few seconds' worth on this recipe), fewer than a status process started per read would miss
        self._dht = start_dht(self.run_id, initial_peers=initial, client_mode=True)
        self._history = History()
        common = ["--run-id", self.run_id, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *RECIPE, "--initial-peers",
                  *initial]
        for name, stage, role in SERVERS:
            self.commands.setdefault(name, [*common, "--role", "server", "--stage", stage, "--server-role", role,
                                            *(["--keep-state"] if role == "bs" else []),
                                            "--identity-path", str(self.workdir / f"{name}.key"),
                                            "--checkpoint-dir", str(self.workdir / "ckpt" / name),
                                            "--checkpoint-every", {"fs0": "4", "bs0": "2"}.get(name, "1")])
        for stage in ("0", "1"):
            self.commands.setdefault(f"client{stage}", [*common, "--role", "client", "--stage", stage])
        for name, command in self.commands.items():
            if name != "bootstrap":
                self.start(f"{name}.{incarnation}", command)

    def signal_all(self, signum: int) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signum)  # the peer and its p2p daemon

    def kill_all(self) -> None:
        self.signal_all(signal.SIGKILL)  # without notice
        for process in self.processes.values():
            process.wait()
        self.processes.clear()  # dead, daemons and all: `failed` asks about the next incarnation only
        self._close_reader()

    def stop(self, grace_s: float = 15.0) -> None:
        self._close_reader()
        super().stop(grace_s)

    def _close_reader(self) -> None:
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None

    def status(self) -> dict:
        return collect(self._dht, self.run_id, history=self._history)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()

    def disagreement(self, report: dict) -> str:
        """Why `report`'s stages whose holders' digests disagree do: each holder's digest of the first and the last
        epoch that disagreed, and what the incarnation's logs say of restoring, loading and failed rounds."""
        records = self._history.merge([])
        lines = []
        for stage in (s["stage"] for s in report["stages"] if s["digests_agree"] is False):
            bad = [e["epoch"] for e in report["epochs"] if e["stages"][stage]["digests_agree"] is False]
            for epoch in sorted({bad[0], bad[-1]}):
                lines.append(f"stage {stage} epoch {epoch}:")
                lines += [f"  {r.role} {r.peer_id}: {e.digest}" for r in records if r.stage == stage
                          for e in (r.per_epoch if r.role == "worker" else r.worker_epochs)
                          if e.epoch == epoch and e.digest]
        said = re.compile(r"restored|loaded the state|no stage mate|stands past|failed|not stepping|took a mate|"
                          r"skipping|abandoned|does not serve|catch")
        for log in sorted(self.workdir.glob("*.1.log")):
            lines += [f"{log.stem}: {line}" for line in log.read_text().splitlines() if said.search(line)][-15:]
        return "\n".join(lines)


def remove_newest(folder: Path) -> None:
    epoch, manifest = manifests(folder)[0]
    manifest.unlink()
    (folder / f"state-{epoch}.safetensors").unlink()


def with_flag(command: list[str], flag: str, value: str) -> list[str]:
    at = command.index(flag)
    return [*command[: at + 1], value, *command[at + 2:]]


def arrangement(epochs: dict[str, list[int]]) -> dict[str, int] | None:
    """The epoch each server's newest checkpoint is cut back to, from the epochs of its checkpoints on disk (newest
    first): stage 0 further back than stage 1 (its epochs between are abandoned), its FS further back than its BS
    (the FS takes the BS's newer state, as the holders of one stage must agree), and stage 1's servers one epoch apart
    (the one behind closes that epoch without a group, `catch_up`, so its replica, which cannot step it, must be
    left out of the next epoch's round, or that round would wait for it while it waits for a mate's state after the
    round); the newest such choice, or None where the checkpoints on disk allow none."""
    for fs1, bs1 in itertools.product(epochs["fs1"], epochs["bs1"]):
        if abs(fs1 - bs1) != 1:
            continue
        for bs0, fs0 in itertools.product(epochs["bs0"], epochs["fs0"]):
            if 4 <= fs0 < bs0 < min(fs1, bs1):
                return {"fs0": fs0, "bs0": bs0, "fs1": fs1, "bs1": bs1}
    return None


def wait_for(swarm: RestartableSwarm, condition, what: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        failed = swarm.failed()
        assert not failed, f"peers {failed} died:\n" + "\n".join(swarm.log(n)[-2000:] for n in failed)
        report = swarm.status()
        if condition(report):
            return report
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s")


@pytest.mark.timeout(720)
def test_a_swarm_killed_whole_resumes_from_its_checkpoints(tmp_path):
    swarm = RestartableSwarm(tmp_path, "ckpt")
    try:
        swarm.start_all(0)
        # past epoch 8 at least: stage 0's FS, saving every 4 epochs, then holds two checkpoints, the older one of
        # epoch 4 or later
        before = wait_for(swarm, lambda r: r["epoch"] >= 11, "the swarm did not train 12 epochs")
        # servers save when their own stage steps, and the stages average and step apart, so a kill leaves their
        # newest checkpoints at different epochs, stage 0's at times past stage 1's, and only the newest 2 of each
        # server stay (`checkpoint.KEPT`). The swarm is frozen at once (SIGSTOP), and killed where its checkpoints on
        # disk allow the arrangement below, else let go on for a moment
        ckpt = tmp_path / "ckpt"
        deadline = time.monotonic() + 60
        while True:
            swarm.signal_all(signal.SIGSTOP)
            chosen = arrangement({name: [epoch for epoch, _ in manifests(ckpt / name)] for name, _, _ in SERVERS})
            if chosen is not None:
                break
            swarm.signal_all(signal.SIGCONT)
            assert time.monotonic() < deadline, "the checkpoints on disk never allowed the arrangement"
            time.sleep(0.3)
        swarm.kill_all()  # the losses before the kill are those `before` saw, or earlier
        for name, epoch in chosen.items():
            while manifests(ckpt / name)[0][0] > epoch:
                remove_newest(ckpt / name)
        saved = {name: json.loads(manifests(ckpt / name)[0][1].read_text())["epoch"] for name, _, _ in SERVERS}
        assert all(epoch >= 4 for epoch in saved.values()) and saved["fs0"] % 2 == saved["bs0"] % 2 == 0, saved
        assert saved["fs0"] < saved["bs0"] < min(saved["fs1"], saved["bs1"]), saved
        assert abs(saved["fs1"] - saved["bs1"]) == 1, saved
        losses = {e["epoch"]: e["loss"] for e in before["epochs"] if e["loss"] is not None}

        # a truncated copy of a server's checkpoints is refused at start, naming the file; the swarm never sees it
        damaged = tmp_path / "damaged"
        shutil.copytree(tmp_path / "ckpt" / "fs1", damaged)
        for state in damaged.glob("state-*.safetensors"):
            state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
        tensors = damaged / f"state-{saved['fs1']}.safetensors"

        swarm.start_all(1)
        resume = max(saved.values())
        after = wait_for(swarm, lambda r: r["epoch"] >= resume + 3, f"the swarm did not train past epoch {resume + 2}")
        for name, _, _ in SERVERS:
            assert re.search(rf"restored stage \d at epoch {saved[name]} ", swarm.log(f"{name}.1")), name
        assert f"the stage stands past epoch {saved['bs0'] - 1}, " in swarm.log("fs0.1")
        behind = min(("fs1", "bs1"), key=saved.__getitem__)
        assert f"the stage stands past epoch {max(saved['fs1'], saved['bs1']) - 1}, " in swarm.log(f"{behind}.1")
        resumed = {e["epoch"]: e["loss"] for e in after["epochs"] if e["loss"] is not None and e["epoch"] >= resume}
        first = min(resumed)
        assert first == resume, f"the swarm resumed at epoch {first}, its checkpoints are of epoch {resume}"
        last_before = [losses[e] for e in sorted(losses) if e < resume][-2:]
        # no higher than the last losses seen before the kill (up to noise), and far below an untrained model's (about
        # ln 256 = 5.5). Not within noise both ways: the status read before the kill lags the swarm by several epochs
        # (metrics are published every few seconds, epochs take a third of a second), and the loss still falls by
        # about 0.1 an epoch here, so the resumed one is often lower than the last one seen by more than the noise
        # stage 0 trains on from its older parameters (the epochs between are abandoned), and every worker of it
        # takes them from its servers: none starts from the seed's weights, which cost a loss far above an untrained
        # model's once (the servers refused their state as behind the swarm's epoch)
        for epoch in range(resume, resume + 3):
            assert resumed[epoch] < sum(last_before) / len(last_before) + 0.5, (resumed, losses)
            assert resumed[epoch] < losses[min(losses)] - 0.5, (resumed, losses)
        assert all(stage["digests_agree"] is not False for stage in after["stages"]), (
            "before the kill, epochs that disagreed per stage: "
            f"{[stage['digests_disagreed'] for stage in before['stages']]}\n" + swarm.disagreement(after))

        command = with_flag(with_flag(swarm.commands["fs1"], "--checkpoint-dir", str(damaged)),
                            "--identity-path", str(tmp_path / "other.key"))
        refused = subprocess.run([sys.executable, "-m", "p2ptrain.peer", *command], capture_output=True, text=True,
                                 timeout=180)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert f"{tensors}" in refused.stderr and "truncated" in refused.stderr, refused.stderr[-2000:]
    finally:
        swarm.stop()
