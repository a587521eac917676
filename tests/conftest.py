"""A swarm of real peer processes on 127.0.0.1, started inside the test and always stopped."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.launch import LOOPBACK, Swarm

REPO = Path(__file__).resolve().parent.parent


class TestSwarm(Swarm):
    """Swarm plus the helpers tests need: start peers by role, and wait for the data source to finish."""

    __test__ = False

    def __init__(self, workdir: Path, run_id: str, recipe: list[str]):
        super().__init__(workdir=workdir)
        self.run_id, self.recipe = run_id, recipe

    def peer(self, name: str, *args: str) -> None:
        self.start(name, ["--run-id", self.run_id, "--host-maddrs", LOOPBACK, *self.recipe, *args,
                          "--initial-peers", *self.initial_peers])

    def status(self) -> dict:
        import json

        out = subprocess.run([sys.executable, "-m", "p2ptrain.status", "--run-id", self.run_id, "--json",
                              "--initial-peers", *self.initial_peers], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_finished(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            failed = self.failed()
            assert not failed, f"peers {failed} died: " + self.logs(failed)
            report = self.status()
            if report["finished"] and report["epoch"] + 1 >= (report["epochs_planned"] or 0):
                return report
            time.sleep(2.0)
        raise AssertionError(f"the swarm did not finish in {timeout} s; last status {report}\n" + self.logs())

    def logs(self, names: list[str] | None = None, tail: int = 3000) -> str:
        names = names or list(self.processes)
        return "\n".join(f"--- {n}\n{(self.workdir / f'{n}.log').read_text()[-tail:]}" for n in names)


@pytest.fixture
def make_swarm(tmp_path):
    swarms: list[TestSwarm] = []

    def make(run_id: str, recipe: list[str]) -> TestSwarm:
        swarm = TestSwarm(tmp_path / run_id, run_id, recipe)
        swarm.workdir.mkdir(parents=True)
        swarms.append(swarm)
        swarm.start_bootstrap(run_id)
        return swarm

    yield make
    for swarm in swarms:
        swarm.stop()
