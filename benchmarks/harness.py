"""What every swarm benchmark needs: a local swarm of real peer processes, its status read through the DHT, clients
that vanish and come back (`Chaos`), the CPU time of every process on the machine from /proc, and the small helpers
of a report.

    from harness import LocalSwarm, Sampler, consumer_cores, cpu_window, log

A benchmark script imports this module before `p2ptrain`: importing it puts this checkout first on sys.path, so
the runtime measured is the working tree's.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import hivemind
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2ptrain.cli import LOOPBACK, RECIPE_FLAGS, flag_value  # noqa: E402
from p2ptrain.config import RunConfig  # noqa: E402
from p2ptrain.dht import start_dht  # noqa: E402
from p2ptrain.launch import Swarm  # noqa: E402
from p2ptrain.peer import SERVED_LINE  # noqa: E402
from p2ptrain.status import History, collect  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")
OWN = "benchmark"  # the owner of this process and its children (its status reader's DHT and p2pd) in CPU tables
CHILD_KINDS = ("dht", "p2pd", "averager", "other")  # what classify calls the processes a peer starts

_T0 = time.monotonic()
RETURN_WAIT_S = 300.0  # how long `Chaos` times a killed client's return at most


# ---------------------------------------------------------------------------------------------------------------
# helpers of a report


def log(text: str) -> None:
    """A progress line on stderr, stamped with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _T0:5.0f} s] {text}", file=sys.stderr, flush=True)


def load() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes."""
    return [round(x, 2) for x in os.getloadavg()]


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def exit_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does, through its `with LocalSwarm(...)` blocks, which stop the
    peers: they run in sessions of their own and would outlive a benchmark killed outright."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def fmt(value: float | None, spec: str = ".2f", none: str = "-") -> str:
    """`value` formatted with `spec`, or `none` for a missing value."""
    return none if value is None else format(value, spec)


def command_line(script: str | Path, argv: list[str] | None = None) -> str:
    """How the benchmark was started, to put on top of its report: `python <script relative to the checkout> ARGS`."""
    path = Path(script).resolve().relative_to(ROOT)
    return "python " + " ".join(shlex.quote(a) for a in [str(path), *(sys.argv[1:] if argv is None else argv)])


def write_device_report(out: Path, stem: str, device_name: str, result: dict[str, Any], markdown: str) -> None:
    """Save a device's benchmark as `<stem>-<device name>.json` and `.md` in `out`, and print the markdown."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")[:40]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}-{slug}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}-{slug}.md").write_text(markdown)
    print(markdown)


def machine_info() -> dict[str, Any]:
    """The machine and code a benchmark runs on: date, nproc, CPU model, Python, torch and hivemind versions, the load
    average now (`load_start`), and the commit with the tracked files that differ from it (when git can tell)."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "nproc": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__, "hivemind": hivemind.__version__, "load_start": load()}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip()
        info["uncommitted"] = [line[3:] for line in subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
            timeout=10).stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                           if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


# ---------------------------------------------------------------------------------------------------------------
# CPU accounting from /proc


ProcTable = dict[int, tuple[str, int, float]]  # pid -> (comm, ppid, utime+stime seconds)


def proc_table() -> ProcTable:
    """Every process on the machine: pid -> (comm, ppid, utime+stime seconds)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited while we listed /proc
            continue
        right = text.rfind(")")  # comm may itself contain spaces and parentheses
        stat = text[right + 2:].split()
        table[int(entry)] = (text[text.find("(") + 1:right], int(stat[1]), (int(stat[11]) + int(stat[12])) / TCK)
    return table


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / TCK  # all but idle and iowait


@dataclass(frozen=True)
class Snapshot:
    """The CPU time of every process and of the whole machine at wall-clock time `t` (the clock of the peers'
    logs, so that windows can be cut at the times they logged)."""

    t: float
    procs: ProcTable
    machine: float


def snapshot() -> Snapshot:
    """The CPU time of every process and of the machine, now."""
    return Snapshot(t=time.time(), procs=proc_table(), machine=machine_cpu())


class Sampler:
    """Snapshots of every process's CPU time, every `period_s`, from a background thread while in its `with` block
    (at most `max_snapshots` of them, so a run that hangs cannot fill the memory)."""

    def __init__(self, period_s: float = 0.5, max_snapshots: int = 4000):
        self.period_s, self.max_snapshots = period_s, max_snapshots
        self.snapshots: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.snapshots) < self.max_snapshots:
            self.snapshots.append(snapshot())
            self._stop.wait(self.period_s)

    def around(self, start: float, end: float) -> tuple[Snapshot, Snapshot] | None:
        """The last snapshot at or before wall-clock time `start` and the first at or after `end` (or the nearest
        ones); None if there is no window between two snapshots."""
        if len(self.snapshots) < 2:
            return None
        before = [x for x in self.snapshots if x.t <= start] or self.snapshots[:1]
        after = [x for x in self.snapshots if x.t >= end] or self.snapshots[-1:]
        return (before[-1], after[0]) if after[0].t > before[-1].t else None

    def within(self, start: float, end: float) -> tuple[Snapshot, Snapshot] | None:
        """The first snapshot at or after wall-clock time `start` and the last at or before `end`: a window that holds
        nothing from outside [start, end]; None if no two snapshots lie within."""
        inside = [x for x in self.snapshots if start <= x.t <= end]
        return (inside[0], inside[-1]) if len(inside) >= 2 else None


def classify(table: ProcTable, roots: dict[str, int]) -> dict[int, tuple[str, str]]:
    """pid -> (owner, kind) for the process trees of `roots` (owner -> pid of its main process).

    kind: main (the root itself), dht (hivemind's DHT process: the python child that runs a p2pd), p2pd (the libp2p
    daemon), averager (hivemind's other python children: the averagers), other (torch_shm_manager). A root found
    in another root's tree counts as its own owner."""
    children = defaultdict(list)
    for pid, (_, ppid, _) in table.items():
        children[ppid].append(pid)
    owners: dict[int, tuple[str, str]] = {}
    root_pids = set(roots.values())

    def walk(pid: int, owner: str) -> None:
        for child in children.get(pid, []):
            if child in root_pids:
                continue
            comm = table[child][0]
            if comm == "p2pd":
                kind = "p2pd"
            elif comm.startswith("torch_shm"):
                kind = "other"
            elif any(table[c][0] == "p2pd" for c in children.get(child, [])):
                kind = "dht"
            else:
                kind = "averager"
            owners[child] = (owner, kind)
            walk(child, owner)

    for owner, pid in roots.items():
        if pid in table:
            owners[pid] = (owner, "main")
            walk(pid, owner)
    return owners


def cpu_window(first: Snapshot, last: Snapshot, roots: dict[str, int]) -> dict[str, Any]:
    """CPU cores used between two snapshots: `cores` per "owner/kind" (see `classify`), `ours_cores` by all of
    `roots`' trees, `machine_cores` by the whole machine, `others_cores` by everything else; and `wall_s`."""
    wall = last.t - first.t
    owners = classify(last.procs, roots)
    for pid, owner in classify(first.procs, roots).items():
        owners.setdefault(pid, owner)
    used: dict[str, float] = defaultdict(float)
    for pid, (owner, kind) in owners.items():
        end = last.procs.get(pid)
        if end is None:
            continue  # exited during the window: its last CPU time is lost
        begin = first.procs.get(pid)
        used[f"{owner}/{kind}"] += end[2] - (begin[2] if begin and begin[0] == end[0] else 0.0)  # else a reused pid
    ours = sum(used.values())
    machine = last.machine - first.machine
    return {"wall_s": wall, "cores": {k: v / wall for k, v in sorted(used.items())},
            "ours_cores": ours / wall, "machine_cores": machine / wall,
            "others_cores": max(0.0, machine - ours) / wall}


def cpu_windows(pairs: Iterable[tuple[Snapshot, Snapshot]], roots: dict[str, int]) -> dict[str, Any] | None:
    """`cpu_window` over several windows as one: the CPU each used, over their wall time together (a run cut by
    pauses); None if there is none."""
    windows = [cpu_window(first, last, roots) for first, last in pairs]
    wall = sum(w["wall_s"] for w in windows)
    if not wall:
        return None
    cores: dict[str, float] = defaultdict(float)
    for w in windows:
        for key, value in w["cores"].items():
            cores[key] += value * w["wall_s"] / wall
    merged = {key: sum(w[key] * w["wall_s"] for w in windows) / wall
              for key in ("ours_cores", "machine_cores", "others_cores")}
    return {"wall_s": wall, "cores": dict(sorted(cores.items())), **merged}


def consumer_cores(window: dict[str, Any], roles: dict[str, str]) -> dict[str, float]:
    """Cores per consumer over a `cpu_window` of a swarm whose peers have `roles` (name -> role): each peer's main
    process counts as its role, the processes it started as their kind (CHILD_KINDS), all of this benchmark's own
    as OWN, the rest of the machine as "outside", and the cores nobody used as "idle"; the values sum to nproc."""
    groups = dict.fromkeys([*roles.values(), *CHILD_KINDS, OWN, "outside", "idle"], 0.0)
    for key, cores in window["cores"].items():
        owner, kind = key.split("/")
        if owner == OWN:
            group = OWN
        elif kind == "main":
            group = roles[owner]
        else:
            group = kind
        groups[group] += cores
    groups["outside"] = window["others_cores"]
    groups["idle"] = max(0.0, (os.cpu_count() or 1) - window["machine_cores"])
    return groups


# ---------------------------------------------------------------------------------------------------------------
# a local swarm


def peer_name(stage: int, role: str) -> str:
    """How `LocalSwarm` names the peer of `role` (fs, bs or client) at `stage`."""
    return f"s{stage}-{role}"


@dataclass
class Progress:
    """How `LocalSwarm.follow` ended: the last status report read (None if no read succeeded), whether the deadline
    passed first, and how long each successful status read took."""

    report: dict[str, Any] | None
    timed_out: bool
    read_s: list[float]


class LocalSwarm:
    """A swarm of real `python -m p2ptrain.peer` processes on 127.0.0.1 (started and stopped by
    `p2ptrain.launch.Swarm`, their logs in `workdir`), all given the same recipe, and an in-process hivemind DHT
    client that reads the swarm's status. Leaving its `with` block stops the client and every peer process.

    `flags` are the flags every peer gets: `--run-id` first, then the rest of `config`'s recipe, `--epochs`,
    `--threads`, `--host-maddrs` (loopback) and `node_flags`. The data source feeds `epochs` epochs."""

    def __init__(self, workdir: Path, config: RunConfig, *, epochs: int, threads: int = 1,
                 node_flags: Iterable[str] = ()):
        self.workdir, self.config, self.epochs = workdir, config, epochs
        self.flags = ["--run-id", config.run_id]
        config_fields = {f.name for f in fields(config)} - {"run_id"}
        for name, flag in RECIPE_FLAGS.items():  # the peers' own flag of each field, so no field is left out
            value = getattr(config, name) if name in config_fields else None
            if value is not None:
                self.flags += [flag, flag_value(value)]
        self.flags += ["--epochs", str(epochs), "--threads", str(threads), "--host-maddrs", LOOPBACK, *node_flags]
        self.roles: dict[str, str] = {}  # peer name -> its --role
        self.started = time.monotonic()  # what `follow`'s progress lines count from
        self.pauses: list[tuple[float, float]] = []  # wall-clock (time.time()) intervals the swarm stood still (`paused`)
        self._swarm = Swarm(workdir=workdir)
        self._dht: hivemind.DHT | None = None
        self._history = History()  # the epochs the peers' records no longer carry

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_path(self, name: str) -> Path:
        """The log of peer `name` (its stdout and stderr), where `p2ptrain.launch.Swarm` writes it."""
        return self.workdir / f"{name}.log"

    def start_bootstrap(self, timeout: float = 120.0) -> list[str]:
        """Start the bootstrap peer and wait (at most `timeout` seconds: imports are slow on a loaded machine) for
        its addresses, which the other peers get as --initial-peers."""
        self.roles["bootstrap"] = "bootstrap"
        return self._swarm.start_bootstrap(self.config.run_id, timeout=timeout)

    def start_server(self, stage: int, server_role: str, extra: Iterable[str] = ()) -> str:
        """Start the FS or BS (`server_role`) of `stage`, with node flags `extra`; returns its name."""
        return self._start(peer_name(stage, server_role), "server",
                           ["--stage", str(stage), "--server-role", server_role, *extra])

    def start_client(self, stage: int, name: str | None = None, extra: Iterable[str] = ()) -> str:
        """Start a client (a worker) of `stage` under `name` (default: the stage's one client); returns its name.
        Starting a name again (after `kill`) runs the same command again (its log starts anew)."""
        return self._start(name or peer_name(stage, "client"), "client", ["--stage", str(stage), *extra])

    def served_calls(self, timeout: float = 10.0) -> dict[str, dict[str, int]]:
        """The requests each live peer's process has served so far, by method: each is sent SIGUSR1 and logs them
        (`p2ptrain.peer.SERVED_LINE`); peer name -> {method: count}."""
        live = {name: p for name, p in self._swarm.processes.items() if p.poll() is None}
        offsets = {name: self.log_path(name).stat().st_size for name in live}
        for process in live.values():
            process.send_signal(signal.SIGUSR1)  # the peer's Python process only: its p2p daemon would die of it
        found: dict[str, dict[str, int]] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(live) and time.monotonic() < deadline:
            time.sleep(0.05)
            for name in set(live) - set(found):
                with self.log_path(name).open() as f:
                    f.seek(offsets[name])
                    lines = [line for line in f.read().splitlines() if SERVED_LINE in line]
                if lines:
                    found[name] = json.loads(lines[-1].split(SERVED_LINE, 1)[1])
        return found

    def kill(self, name: str) -> None:
        """SIGKILL peer `name` and its p2p daemon (its process group), as a volunteer that vanishes."""
        process = self._swarm.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every peer stands still in the block: SIGSTOP to each one's process group (its p2p daemon and hivemind's
        DHT process with it), SIGCONT on leaving. Its wall-clock interval goes to `pauses`; `follow`'s deadline
        moves by it."""
        groups = [p.pid for p in self._swarm.processes.values() if p.poll() is None]
        began = time.time()
        for pid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGCONT)
            self.pauses.append((began, time.time()))

    def _paused_s(self) -> float:
        return sum(end - began for began, end in self.pauses)

    def _start(self, name: str, role: str, args: list[str]) -> str:
        self.roles[name] = role
        self._swarm.start(name, [*self.flags, "--role", role, *args, "--initial-peers",
                                 *self._swarm.initial_peers])
        return name

    @property
    def initial_peers(self) -> list[str]:
        """The bootstrap peer's addresses, as the peers get them."""
        return self._swarm.initial_peers

    def roots(self) -> dict[str, int]:
        """Owner -> pid of the processes to account CPU to: every peer, and this process as OWN."""
        return {**{name: p.pid for name, p in self._swarm.processes.items()}, OWN: os.getpid()}

    def failed(self) -> list[str]:
        """The peers that exited with an error."""
        return self._swarm.failed()

    def wire_bytes(self) -> dict[str, int]:
        """Behind emulated links (`p2ptrain.links`): the bytes each peer has put on its uplink; else {}."""
        return self._swarm.wire_bytes()

    def wait_for_workers(self, count: int, timeout: float) -> None:
        """Until the status lists `count` workers over all stages (`connect` first); RuntimeError if a peer exits
        with an error or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while sum(len(s["workers"]) for s in self.status()["stages"]) < count:
            if time.monotonic() > deadline or self.failed():
                raise RuntimeError(f"the clients did not come up; see {self.workdir}")
            time.sleep(1.0)

    def connect(self) -> None:
        """Start the DHT client that `status` reads through (a DHT process and a p2pd, children of this process)."""
        self._dht = start_dht(self.config.run_id, initial_peers=self._swarm.initial_peers, client_mode=True)

    def status(self) -> dict[str, Any]:
        """The swarm's status report (`p2ptrain.status.collect`); `connect` first."""
        if self._dht is None:
            raise RuntimeError("connect() before reading the status")
        return collect(self._dht, self.config.run_id, history=self._history)

    def follow(self, *, deadline: float, poll_s: float,
               on_closed: Callable[[int], None] | None = None) -> Progress:
        """Read the status every `poll_s` seconds, logging each epoch that closes (and calling `on_closed` with it),
        until the data source has fed and closed all its epochs or time.monotonic() passes `deadline` (moved by the
        time the swarm stood `paused`). RuntimeError if a peer exits with an error."""
        seen, report, reads = -2, None, []
        while True:
            failed = self.failed()
            if failed:
                raise RuntimeError(f"peers {failed} exited with an error; see their logs in {self.workdir}")
            try:
                began = time.perf_counter()
                report = self.status()
                reads.append(time.perf_counter() - began)
            except Exception as e:  # a slow DHT read under load: try again until the deadline
                log(f"  status read failed: {e!r}")
                time.sleep(1.0)
                if time.monotonic() > deadline + self._paused_s():
                    return Progress(report, timed_out=True, read_s=reads)
                continue
            closed = report["epoch"]
            if closed != seen:
                seen = closed
                log(f"  swarm: epoch {closed} closed at {time.monotonic() - self.started:.0f} s, "
                    f"{report['tokens_per_s'] or 0:.0f} tokens/s, load {load()}")
                if on_closed is not None:
                    on_closed(closed)
            if report["finished"] and closed + 1 >= self.epochs:
                return Progress(report, timed_out=False, read_s=reads)
            if time.monotonic() > deadline + self._paused_s():
                log(f"  swarm: deadline of {deadline - self.started:.0f} s reached at epoch {closed}; "
                    "reporting what closed")
                return Progress(report, timed_out=True, read_s=reads)
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop the status client and every peer (their daemons included)."""
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
        self._swarm.stop()


class Chaos:
    """Kills and restarts the unreliable clients of `swarm` at `rate` per global batch, until stopped.

    The rate is the paper's disconnection rate (§4.2): the share of the unreliable clients that vanish during a global
    batch and return in the next. Each time an epoch closes (`epoch_closed`), every client is picked with that
    probability and SIGKILLed (with its p2p daemon) at a uniformly random moment within the last epoch's duration,
    unless it is still coming back from its last disconnection, then started again with the same command at once."""

    def __init__(self, *, swarm: LocalSwarm, clients: dict[str, int], rate: float, extra: list[str],
                 rng: random.Random):
        self.swarm, self.clients, self.rate, self.extra, self.rng = swarm, clients, rate, extra, rng
        self.kills = 0
        self.returns: list[float] = []  # seconds from each kill until the client is up again (what it costs)
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def epoch_closed(self, epoch_s: float) -> None:
        """An epoch closed after `epoch_s` seconds: schedule this batch's disconnections."""
        for name, stage in self.clients.items():
            if self.rng.random() < self.rate:
                threading.Timer(self.rng.uniform(0.0, epoch_s), self._bounce, (name, stage)).start()

    def _bounce(self, name: str, stage: int) -> None:
        with self._lock:
            # a client still coming back from its last disconnection is not there to vanish
            if self._stop.is_set() or " up: " not in self.swarm.log_path(name).read_text(errors="replace"):
                return
            self.swarm.kill(name)
            killed = time.monotonic()
            self.swarm.start_client(stage, name=name, extra=self.extra)
            self.kills += 1
        threading.Thread(target=self._time_return, args=(name, killed), daemon=True).start()

    def _time_return(self, name: str, killed: float) -> None:
        while not self._stop.is_set() and time.monotonic() - killed < RETURN_WAIT_S:
            if " up: " in self.swarm.log_path(name).read_text(errors="replace"):
                self.returns.append(time.monotonic() - killed)
                return
            time.sleep(0.2)

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
