"""Stage servers that fail (issue 7): a server SIGKILLed and restarted with the same identity takes its role back,
a stage whose only BS is gone pauses the swarm until it returns, and a stage with two FS trains on with one. The
open epoch is abandoned (the data source's `EndEpoch`) and its batch fed again, so every batch is trained on exactly
once: every epoch that closed has all its rows averaged at every stage, and no stage stepped on an abandoned one.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import time

import pytest

from p2ptrain.config import RuntimeConfig

ROWS, MICROBATCHES, EPOCHS = 8, 2, 12
RECIPE = ["--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES), "--seq-len", "64",
          "--lr", "3e-3", "--server-lost", "3"]


CLOSED_AT_STAGE_0 = r"stage 0 FS: epoch (\d+) closed"
STEPPED = r"stage \d stepped epoch (\d+)"
LOST_AT_SOURCE = r"data source: server \S+ silent for"
ABANDONED_AT_SOURCE = r"epoch (\d+) is abandoned"
WAITING_FOR_SERVERS = r"data source: waiting for an FS and a BS in every stage"


def last_logged(swarm, name: str, pattern: str) -> int:
    """The highest number `pattern` caught in a peer's log (-1 if none): the log tells at once, the status lags."""
    return max((int(n) for n in re.findall(pattern, (swarm.workdir / f"{name}.log").read_text())), default=-1)


def wait_logged(swarm, name: str, pattern: str, *, at_least: int, timeout: float, poll_s: float = 0.5) -> None:
    """Until a peer's log has `pattern` with a number of `at_least`; a slow poll reads the status meanwhile (a fast
    one times a kill, which a read would delay)."""
    deadline = time.monotonic() + timeout
    while last_logged(swarm, name, pattern) < at_least:
        assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
        if poll_s >= 0.5:
            swarm.observe()
        time.sleep(poll_s)


def last_epoch_s(swarm) -> float:
    """Seconds between the data source's FS's last two closes, by its log's timestamps."""
    closes = re.findall(r"^(\S+ \S+) .*" + CLOSED_AT_STAGE_0, (swarm.workdir / "fs0.log").read_text(), re.MULTILINE)
    first, last = (datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") for stamp, _ in closes[-2:])
    return (last - first).total_seconds()


def kill_mid_epoch(swarm, name: str, *, after: int, timeout: float = 240, into_s: float = 0.3,
                   into_epoch: float = 0.0, stepped: tuple[str, ...] = ()) -> None:
    """SIGKILL a peer and its p2p daemon, without notice, `into_s` plus `into_epoch` of the last epoch's time after
    the data source's FS closed an epoch (from `after` on), so that the next epoch has just been fed, and after the
    workers `stepped` logged their step of it; its log is kept under another name."""
    wait_logged(swarm, "fs0", CLOSED_AT_STAGE_0, at_least=after, timeout=timeout, poll_s=0.02)
    for worker in stepped:
        wait_logged(swarm, worker, STEPPED, at_least=after, timeout=timeout, poll_s=0.02)
    time.sleep(into_s + into_epoch * last_epoch_s(swarm))
    process = swarm.processes.pop(name)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    kept = len(list(swarm.workdir.glob(f"{name}.killed*.log")))
    os.rename(swarm.workdir / f"{name}.log", swarm.workdir / f"{name}.killed{f'.{kept + 1}' if kept else ''}.log")


def killed_logs(swarm, name: str) -> list[str]:
    """The logs of a peer's killed runs, oldest first."""
    # by length first: NAME.killed.log, then .killed.2.log ... .killed.9.log, then .killed.10.log
    paths = sorted(swarm.workdir.glob(f"{name}.killed*.log"), key=lambda p: (len(p.name), p.name))
    return [path.read_text() for path in paths]


def open_at_death(killed: str) -> set[int]:
    """The epochs a killed FS had committed and not closed: open when it died."""
    closed = {int(n) for n in re.findall(r"FS: epoch (\d+) closed", killed)}
    committed = {int(n) for n in re.findall(r"FS: epoch (\d+) committed", killed)}
    return committed - closed


def told_of(swarm, epoch: int) -> str:
    """The servers' log lines (of killed runs too) that name `epoch`: what a failed check shows of why."""
    lines = [f"{path.name}: {line}" for path in sorted(swarm.workdir.glob("[fb]s*.log"))
             for line in path.read_text().splitlines() if re.search(rf"\bepoch {epoch}\b", line)]
    return "\n".join(lines[-80:])


def resumed_at(swarm, timeout: float = 120) -> tuple[int, int]:
    """Where a restarted data source found the swarm: the newest epoch a server holds rows of, and the last one closed
    (the epochs between are abandoned)."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(r"the swarm is at epoch (\d+) \(closed through (-?\d+)",
                                  (swarm.workdir / "fs0.log").read_text())):
        assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
        time.sleep(0.2)
    return int(found.group(1)), int(found.group(2))


def start_clients(swarm) -> None:
    for name, stage in (("c0a", "0"), ("c0b", "0"), ("c1a", "1"), ("c1b", "1")):
        swarm.peer(name, "--role", "client", "--stage", stage)


def wait_epoch(swarm, epoch: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    report = swarm.status()
    while report["epoch"] < epoch:
        assert time.monotonic() < deadline, f"epoch {epoch} did not close; last status {report}\n" + swarm.logs()
        assert not swarm.failed(), swarm.logs(swarm.failed())
        time.sleep(0.5)
        report = swarm.status()
    return report


def check_every_batch_trained_once(swarm, report: dict, *, epochs: int, dead: str | None = None) -> None:
    """Every epoch but the abandoned ones closed with all its rows averaged at every stage; the abandoned ones were
    stepped on nowhere, and their batches came again, so `epochs` epochs closed; the loss fell.

    What a killed server knew and had not published yet dies with it: an epoch it closed in its last seconds (its log
    says so) may lack its segment in the status. And the known gap: an FS lost after the data source committed an
    epoch, before it closed it, never reports its segment of that epoch (its workers average those rows in their
    stage mates' group, but no server vouches for them); the data source logs that it could not commit the epoch
    there (the FS was lost, or restarted, before the commit reached it), or the FS logged the commit and died before
    its close. Either shows as rows missing from `rows_in_batch`, never as rows in the batch and not averaged."""
    abandoned = [e for e in report["epochs"] if e["abandoned"]]
    trained = [e for e in report["epochs"] if not e["abandoned"]]
    source = (swarm.workdir / "fs0.log").read_text()
    unreported = {int(n) for n in re.findall(r"could not commit epoch (\d+) at", source)}
    open_then = set(unreported)
    for killed in killed_logs(swarm, dead) if dead is not None else ():
        unreported |= {int(n) for n in re.findall(r"FS: epoch (\d+) (?:closed|committed)", killed)}
        open_then |= open_at_death(killed)
    assert abandoned or open_then, "no epoch was open when the server died, which tests nothing here"
    assert len(trained) == epochs, report["epochs"]
    assert [e["epoch"] for e in report["epochs"]] == list(range(len(report["epochs"]))), report["epochs"]
    for epoch in trained:
        for counts in epoch["stages"]:
            # or a round failed at some worker and was counted (a stream between two groupmates broke mid-round, a
            # fault of the all-reduce whose cause is not found, independent of the servers' faults tested here): that
            # worker's rows are not counted as averaged, and it reloads its mates' state
            assert counts["rows_in_batch"] == counts["rows_averaged"] or counts["rounds_failed"], epoch
            assert counts["rows_in_batch"] == ROWS * MICROBATCHES or epoch["epoch"] in unreported, \
                f"{epoch}\n{told_of(swarm, epoch['epoch'])}"
    for epoch in abandoned:
        assert epoch["loss"] is None and all(counts["rows_averaged"] == 0 for counts in epoch["stages"]), epoch
    losses = [e["loss"] for e in trained]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


@pytest.mark.timeout(480)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_lone_bs_killed_pauses_the_swarm_and_restarted_with_its_identity_takes_its_role_back(make_swarm,
                                                                                               overlap: str):
    """With `--overlap-epochs on` too: the kill finds two epochs open, both are abandoned, and both batches come
    again."""
    swarm = make_swarm(f"bsfault-{overlap}", [*RECIPE, "--overlap-epochs", overlap])
    bs0 = ["--role", "server", "--stage", "0", "--server-role", "bs",
           "--identity-path", str(swarm.workdir / "bs0.key")]
    swarm.peer("bs0", *bs0)
    swarm.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    start_clients(swarm)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(EPOCHS))
    kill_mid_epoch(swarm, "bs0", after=2)
    time.sleep(8.0)  # lost after --server-lost: the open epoch is abandoned and the swarm waits for a stage-0 BS
    paused = swarm.status()["epoch"]
    time.sleep(4.0)
    assert swarm.status()["epoch"] == paused, "epochs closed while stage 0 had no BS"
    swarm.peer("bs0", *bs0)  # the same command: the same identity, an empty state

    report = swarm.wait_finished(timeout=300)
    check_every_batch_trained_once(swarm, report, epochs=EPOCHS)
    assert "abandoned" in (swarm.workdir / "fs0.log").read_text()
    assert report["stages"][0]["bs"] == [report["stages"][0]["bs"][0]]  # the same peer id, back in its role
    assert all(stage["state"] == "training" for stage in report["stages"]), report["stages"]


@pytest.mark.timeout(480)
def test_a_lone_fs_killed_and_restarted_with_its_identity_tells_its_workers_that_the_open_epoch_was_abandoned(
        make_swarm):
    """Stage 1's only FS is SIGKILLed mid-epoch and restarted with its identity once the data source abandoned the
    open epoch, which it could not tell the dead FS: it tells the restarted one before the next epoch's rows, and
    stage 1's workers, polling it, drop the abandoned epoch at once. Otherwise its fresh start would stand past that
    epoch with no closure of it, which the workers take for their stage having stepped without them: they wait for a
    mate's newer state, which nobody has, for 30 s (`client.state_sync.BEHIND_WAIT_S`), then keep their own."""
    swarm = make_swarm("lonefs", RECIPE)
    fs1 = ["--role", "server", "--stage", "1", "--server-role", "fs", "--identity-path", str(swarm.workdir / "fs1.key")]
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1", *fs1)
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    start_clients(swarm)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(EPOCHS))
    # at once once stage 1's workers stepped the epoch before: an epoch of this recipe takes about 0.4 s, and one
    # whose rows were all back at stage 0 before the kill is committed, not abandoned; and a worker that had not
    # heard of the earlier epoch's closure from the dead FS never hears it (both the known gap of
    # `check_every_batch_trained_once`). With DPU a worker logs its step of an epoch after it computed tasks of the
    # next one, which may then be all back (seen in CI): the data source, with nothing open to abandon, waits for stage
    # 1's FS, which is restarted and killed again
    after = 2
    # the data source logs WAITING_FOR_SERVERS as it starts too, maybe only after a count taken at once (seen in CI):
    # the loop took that line for a kill that found nothing open and restarted fs1 before the epoch was abandoned
    wait_logged(swarm, "fs0", CLOSED_AT_STAGE_0, at_least=0, timeout=240)
    for _ in range(3):
        waited = len(re.findall(WAITING_FOR_SERVERS, (swarm.workdir / "fs0.log").read_text()))
        kill_mid_epoch(swarm, "fs1", after=after, into_s=0.0, stepped=("c1a", "c1b"))
        # what the workers logged before this kill: a kill that found no epoch open may have hit the known gap, in
        # which they wait for a mate's state and keep their own; the next kill comes only once stage 1 trains again
        before = {name: len((swarm.workdir / f"{name}.log").read_text()) for name in ("c1a", "c1b")}
        deadline = time.monotonic() + 60
        while (last_logged(swarm, "fs0", ABANDONED_AT_SOURCE) < 0
               and len(re.findall(WAITING_FOR_SERVERS, (swarm.workdir / "fs0.log").read_text())) == waited):
            assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
            time.sleep(0.1)
        swarm.peer("fs1", *fs1)  # the same command: the same identity, an empty state
        if last_logged(swarm, "fs0", ABANDONED_AT_SOURCE) >= 0:
            break
        wait_logged(swarm, "fs1", r"stage 1 FS: epoch (\d+) closed", at_least=0, timeout=120)
        after = last_logged(swarm, "fs0", CLOSED_AT_STAGE_0) + 1
    else:
        pytest.fail("three kills of fs1 found no epoch open\n" + swarm.logs())

    report = swarm.wait_finished(timeout=300)
    check_every_batch_trained_once(swarm, report, epochs=EPOCHS, dead="fs1")
    abandoned = [e["epoch"] for e in report["epochs"] if e["abandoned"]]
    for name in ("c1a", "c1b"):
        log = (swarm.workdir / f"{name}.log").read_text()
        assert any(f"epoch {epoch} was abandoned" in log for epoch in abandoned), (abandoned, log[-3000:])
        assert "keeping its own parameters" not in log[before[name]:], log[-3000:]


@pytest.mark.timeout(480)
def test_a_stage_with_two_fs_trains_on_when_one_is_lost_for_good_and_a_restarted_fs_resumes(make_swarm):
    swarm = make_swarm("fsfault", RECIPE)
    fs1b = ["--role", "server", "--stage", "1", "--server-role", "fs",
            "--identity-path", str(swarm.workdir / "fs1b.key")]
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    # fs1a waits for a silent replica, such as fs1b's, for 20 s before it closes an epoch without it
    swarm.peer("fs1a", "--role", "server", "--stage", "1", "--server-role", "fs", "--worker-lost", "20")
    swarm.peer("fs1b", *fs1b)
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    start_clients(swarm)
    # enough batches that the run is still going when fs1b is back twice (a restart takes about 12 s under load)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(6 * EPOCHS))
    first = wait_epoch(swarm, 1, timeout=240)
    assert len(first["stages"][1]["fs"]) == 2

    # the data source lays fs1b out once its membership read finds it, which may be some epochs after the status
    # lists it: only an FS that serves rows has an open epoch to lose
    wait_logged(swarm, "fs1b", r"stage 1 FS: epoch (\d+) closed", at_least=0, timeout=120)
    serving = last_logged(swarm, "fs0", CLOSED_AT_STAGE_0)
    kill_mid_epoch(swarm, "fs1b", after=serving + 1)  # for good, for now: stage 1 trains on fs1a alone
    killed_at = last_logged(swarm, "fs0", CLOSED_AT_STAGE_0)
    wait_logged(swarm, "fs0", CLOSED_AT_STAGE_0, at_least=killed_at + 2, timeout=180)
    swarm.peer("fs1b", *fs1b)  # back with its identity: the data source lays it out again
    wait_logged(swarm, "fs1b", r"stage 1 FS: epoch (\d+) closed", at_least=0, timeout=120)

    # killed again, and back as soon as the data source holds it lost: before fs1a counts its replica gone. Where the
    # kill came before fs1b's replica polled fs1a after the rows of the committed epoch were back (a race), fs1a
    # closes that epoch, laid out with fs1b, only once the restarted fs1b polls, and the stage's workers, which step
    # an epoch once every FS of its layout closed it, waited for a restarted fs1b that knew nothing of it (seen in CI;
    # tests/test_servers.py forces that order)
    serving = last_logged(swarm, "fs0", CLOSED_AT_STAGE_0)
    silent = len(re.findall(LOST_AT_SOURCE, (swarm.workdir / "fs0.log").read_text()))
    kill_mid_epoch(swarm, "fs1b", after=serving + 1)
    deadline = time.monotonic() + 60
    while len(re.findall(LOST_AT_SOURCE, (swarm.workdir / "fs0.log").read_text())) == silent:
        assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
        time.sleep(0.05)
    swarm.peer("fs1b", *fs1b)
    wait_logged(swarm, "fs1b", r"stage 1 FS: epoch (\d+) closed", at_least=0, timeout=120)

    report = swarm.wait_finished(timeout=300)
    check_every_batch_trained_once(swarm, report, epochs=6 * EPOCHS, dead="fs1b")
    assert len(report["stages"][1]["fs"]) == 2, report["stages"]


@pytest.mark.timeout(480)
def test_the_data_source_killed_and_restarted_with_its_identity_resumes_where_the_swarm_stands(make_swarm):
    swarm = make_swarm("sourcefault", RECIPE)
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    start_clients(swarm)
    epochs = 3 * EPOCHS  # room for a kill again, after one that found no epoch open
    fs0 = ["--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(epochs),
           "--identity-path", str(swarm.workdir / "fs0.key")]
    swarm.peer("fs0", *fs0)

    # half an epoch in: epochs took 0.27 s here (kept streams), so a kill 0.3 s in found none open, and one 50 ms in
    # came before any row of the next one was out. On a loaded machine half an epoch in may still be before any row
    # of the next one reached another server (nothing to abandon) or after its close: then the source is killed again
    after = 3
    for _ in range(4):
        kill_mid_epoch(swarm, "fs0", after=after, into_s=0.0, into_epoch=0.5)
        time.sleep(3.0)
        swarm.peer("fs0", *fs0)  # the same command: it asks the servers where the swarm stands, and goes on from there
        top, closed = resumed_at(swarm)
        if top > closed or open_at_death(killed_logs(swarm, "fs0")[-1]):
            break
        after = top + 2
    else:
        raise AssertionError("four kills of the data source found no epoch open\n" + swarm.logs())

    report = swarm.wait_finished(timeout=300)
    check_every_batch_trained_once(swarm, report, epochs=epochs, dead="fs0")
    source = (swarm.workdir / "fs0.log").read_text()
    assert "resuming at epoch" in source
    assert "refused EndEpoch" not in source, source  # a restarted data source tells each server only what it lacks
    assert all(stage["state"] == "training" for stage in report["stages"]), report["stages"]


@pytest.mark.timeout(480)
def test_a_stage_trains_on_after_its_first_fs_froze_for_longer_than_a_worker_may_be_silent(make_swarm):
    """The first FS of a two-FS stage (its workers deposit their gradients there) stops answering without closing its
    connections (SIGSTOP; an overloaded machine alike) just after an epoch's commit, for longer than `worker_lost_s`:
    the swarm waits for it and trains on, every row of every epoch averaged once. In CI such a stall once left the
    swarm stuck: a worker held silent at the other FS by a call to the frozen one was counted gone there, its rows
    redone, and that FS then waited for it for good when it polled again. Which calls hang when is timing: that
    cause is tested alone in tests/test_servers.py (a worker judged gone that polls again)."""
    swarm = make_swarm("fsfreeze", RECIPE)
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1a", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("fs1b", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    start_clients(swarm)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(2 * EPOCHS))
    wait_epoch(swarm, 1, timeout=240)
    # the data source lays an FS out once its membership read finds it: only then does it serve rows
    for name in ("fs1a", "fs1b"):
        wait_logged(swarm, name, r"stage 1 FS: epoch (\d+) closed", at_least=0, timeout=120)
    ids = {name: re.search(r"server (\S+) up: stage 1", (swarm.workdir / f"{name}.log").read_text()).group(1)
           for name in ("fs1a", "fs1b")}
    first = min(ids, key=ids.get)  # a layout's FS come in peer id order (no owner)
    committed = r"stage 1 FS: epoch (\d+) committed"
    wait_logged(swarm, first, committed, at_least=last_logged(swarm, first, committed) + 1, timeout=120, poll_s=0.01)
    frozen = swarm.processes[first].pid
    os.killpg(frozen, signal.SIGSTOP)  # the peer and its p2p daemon
    time.sleep(1.5 * RuntimeConfig().worker_lost_s)  # the swarm runs with the defaults
    os.killpg(frozen, signal.SIGCONT)

    report = swarm.wait_finished(timeout=240)
    trained = [e for e in report["epochs"] if not e["abandoned"]]
    assert len(trained) == 2 * EPOCHS, report["epochs"]
    for epoch in trained:
        for counts in epoch["stages"]:
            assert counts["rows_in_batch"] == counts["rows_averaged"] or counts["rounds_failed"], epoch
    losses = [e["loss"] for e in trained]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
