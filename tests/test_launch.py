"""The main job (README command 1): a local swarm of real processes trains, shows progress, and stops cleanly,
at the end and on Ctrl-C, leaving no process behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest


def leftovers(run_id: str) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if run_id in line and "p2ptrain.peer" in line]


def kill_leftovers(run_id: str) -> None:
    """After a failure: each peer leads its own process group (its DHT process and p2pd daemon are in it)."""
    for line in leftovers(run_id):
        try:
            os.killpg(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(400)
@pytest.mark.parametrize("volunteers", [[], ["--client-mode-volunteers"]], ids=["reachable", "behind NAT"])
def test_main_job_trains_with_falling_loss_and_stops_every_process(tmp_path, volunteers):
    run_id = "launch-test"
    result = subprocess.run(
        [sys.executable, "-m", "p2ptrain.launch", "--epochs", "6", "--run-id", run_id, "--workdir", str(tmp_path),
         *volunteers],
        capture_output=True, text=True, timeout=360,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("(client mode)" in result.stderr) == bool(volunteers), result.stderr[-3000:]
    assert "training" in result.stderr and "loss=" in result.stderr  # the progress bar
    match = re.search(r"trained (\d+) epochs: loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert match, result.stdout
    assert int(match.group(1)) == 6
    assert float(match.group(3)) < float(match.group(2)) - 0.3
    assert leftovers(run_id) == []


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_whole_swarm(tmp_path):
    run_id = "launch-interrupt"
    process = subprocess.Popen(
        [sys.executable, "-m", "p2ptrain.launch", "--epochs", "1000", "--run-id", run_id, "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    err = ""
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "client-1.log").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert leftovers(run_id), "the swarm did not start"
        time.sleep(5)
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # say where the launcher stands, for a failure seen only under load
            where = subprocess.run(["py-spy", "dump", "--pid", str(process.pid)], capture_output=True, text=True,
                                   timeout=30)
            raise AssertionError("the launcher did not stop within 90 s of Ctrl-C; where it stands:\n"
                                 + (where.stdout or where.stderr)) from None
    finally:
        if process.poll() is None:  # the test failed midway: still stop the swarm the way a user would
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                kill_leftovers(run_id)
    assert process.returncode == 130, err[-2000:]
    assert "interrupted: all peers stopped" in err
    assert leftovers(run_id) == []
