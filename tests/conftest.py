"""A swarm of real peer processes on 127.0.0.1, started inside the test and always stopped."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.cli import LOOPBACK
from p2ptrain.dht import start_dht
from p2ptrain.launch import Swarm
from p2ptrain.live.authority import Owner
from p2ptrain.status import History, collect

SESSION_MARK = "P2PTRAIN_TEST_SESSION"  # in the environment of every process a test starts (module ``strays``)
STRAY_GRACE_S = 10.0  # how long a module's processes may take to exit after its last test, before they are killed
_LEFT = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_MARK] = str(os.getpid())


def strays() -> dict[int, str]:
    """Live processes started under this test session (a peer, its DHT node, a p2p daemon: anything exec'd with its
    mark in the environment), but this one, torch's shared-memory manager and multiprocessing's resource tracker
    (the planner's spawned searches start it), which serve this process for its whole life (and end by themselves
    once it is gone): {pid: command line}."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in Path(entry.path, "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace").strip()
        except OSError:  # it ended meanwhile, or is a zombie
            continue
    return {pid: command for pid, command in found.items()
            if "torch_shm_manager" not in command and "multiprocessing.resource_tracker" not in command}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test (its fixtures torn down), nothing it started may live on: a process left behind
    loads the machine under every later test, and on CI's a run of them once failed one after another until the job
    timed out. Such processes are killed and named in the output."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    deadline = time.monotonic() + STRAY_GRACE_S
    while (left := strays()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        lines = [f"{item.nodeid.split('::')[0]} left {len(left)} processes running; killed them:"]
        lines += [f"  {pid}: {command[:200]}" for pid, command in left.items()]
        item.config.stash.setdefault(_LEFT, []).extend(lines)
        item.config.pluginmanager.get_plugin("terminalreporter").write_line("\n" + "\n".join(lines))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if lines := config.stash.get(_LEFT, []):
        terminalreporter.section("processes left running by tests")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch sees none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TestSwarm(Swarm):
    """Swarm plus the helpers tests need: start peers by role, and wait for the data source to finish."""

    __test__ = False

    def __init__(self, workdir: Path, run_id: str, recipe: list[str]):
        super().__init__(workdir=workdir)
        self.run_id, self.recipe = run_id, recipe
        self._dht = None
        self._history = History()
        self._read_at = -float("inf")  # monotonic time of the last status read
        self.owner_key: Path | None = None  # a run with an owner: its status trusts the servers the owner authorized

    def peer(self, name: str, *args: str) -> None:
        self.start(name, ["--run-id", self.run_id, "--host-maddrs", LOOPBACK, *self.recipe, *args,
                          "--initial-peers", *self.initial_peers])

    def start_two_stages(self, clients: dict[str, str], *, epochs: int,
                         client_args: dict[str, list[str]] | None = None, bs_args: tuple[str, ...] = ()) -> None:
        """FS and BS of 2 stages (the BS with `bs_args`) and `clients` (name: stage, each with its `client_args`); the
        data source (stage 0's FS) starts once every client is up. Stage 0's clients find it only then: one may still
        be looking when the first epoch closes, and miss its averaging group."""
        self.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs", *bs_args)
        self.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
        self.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs", *bs_args)
        for name, stage in clients.items():
            self.peer(name, "--role", "client", "--stage", stage, *(client_args or {}).get(name, []))
        deadline = time.monotonic() + 180
        while sum(len(s["workers"]) for s in self.status()["stages"]) < len(clients):
            assert time.monotonic() < deadline, "the clients did not come up\n" + self.logs()
            time.sleep(1.0)
        self.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(epochs))

    def status_cli(self) -> dict:
        """What `python -m p2ptrain.status --json` prints, as a user would run it."""
        owner = ["--owner-key", str(self.owner_key)] if self.owner_key else []
        out = subprocess.run([sys.executable, "-m", "p2ptrain.status", "--run-id", self.run_id, "--json", *owner,
                              "--initial-peers", *self.initial_peers], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def status(self) -> dict:
        """The same report, read by a DHT client in this process (cheaper to poll than a new process), with every
        epoch this swarm's reads have seen (records carry their newest epochs only)."""
        if self._dht is None:
            self._dht = start_dht(self.run_id, initial_peers=self.initial_peers, client_mode=True)
        owner = Owner.from_file(self.owner_key) if self.owner_key else None
        self._read_at = time.monotonic()
        return collect(self._dht, self.run_id, history=self._history, owner=owner)

    def observe(self, every_s: float = 2.0) -> None:
        """Read the status if the last read is `every_s` old, for a test that waits on logs: the reads keep each
        epoch while the peers' records still carry it (a record holds its newest epochs only, about 45 of a
        two-stage run's), so that a long run's report, read at its end, still has its early epochs."""
        if time.monotonic() - self._read_at >= every_s:
            self.status()

    def wait_finished(self, timeout: float) -> dict:
        """Poll until the data source has fed and closed all its epochs; then check that the status command says so
        too, and return the report with every epoch the polls saw."""
        deadline = time.monotonic() + timeout
        report = None
        while time.monotonic() < deadline:
            failed = self.failed()
            assert not failed, f"peers {failed} died: " + self.logs(failed)
            report = self.status()
            if report["finished"] and report["epoch"] + 1 >= (report["epochs_planned"] or 0):
                cli = self.status_cli()  # the command a user runs reads the same swarm (its records may be newer)
                assert cli["finished"] and cli["epoch"] >= report["epoch"], cli
                return self.status()
            time.sleep(1.0)
        raise AssertionError(f"the swarm did not finish in {timeout} s; last status {report}\n" + self.logs()
                             + "\nwhere the peers stand:\n" + self.stacks())

    def stop(self, grace_s: float = 15.0) -> None:
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
        super().stop(grace_s)

    def stacks(self, lines: int = 25) -> str:
        """Where each live peer stands, for a swarm that stands still: its main thread and any busy one (py-spy), and
        what its asyncio tasks await (logged on SIGUSR1). The end of a failure message, where the CI shows it."""
        live = {name: process for name, process in self.processes.items() if process.poll() is None}
        for process in live.values():
            process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        dumps = []
        for name, process in live.items():
            try:
                out = subprocess.run(["py-spy", "dump", "--pid", str(process.pid)], capture_output=True, text=True,
                                     timeout=30)
                threads = [block.splitlines()[:lines] for block in re.split(r"\n(?=Thread )", out.stdout or out.stderr)]
                text = "\n".join("\n".join(block) for block in threads
                                 if block and ("MainThread" in block[0] or "(active" in block[0]))
            except (OSError, subprocess.TimeoutExpired) as e:
                text = f"py-spy failed: {e!r}"
            log = (self.workdir / f"{name}.log").read_text()
            tasks = log[log.rfind("asyncio tasks (SIGUSR1)"):].splitlines()[1:lines + 1] if "(SIGUSR1)" in log else []
            dumps.append(f"--- {name} (pid {process.pid})\n{text}\n" + "\n".join(tasks))
        return "\n".join(dumps)

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


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer of 512 tokens trained here on the embedded corpus (nothing is downloaded), saved as
    a Hugging Face tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from p2ptrain.data import embedded_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(embedded_corpus()[:200_000].splitlines(keepends=True), trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path
