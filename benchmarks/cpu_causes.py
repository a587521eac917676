"""Where a peer process's CPU goes, by cause: py-spy samples its running threads (idle ones are not sampled), and
each sampled stack counts for the first cause, in `CAUSES` order, that one of its frames belongs to. The causes
say why the work is done (a handler of the data path, the task pool, the stage's replica, records and reads of
the DHT); what does the work (framing, codecs, hivemind's P2P client, the event loop) counts only where no cause
claims the stack. A stack whose innermost frame is the event loop's selector wait is the thread caught at its wait,
not at work (`WAITING`): py-spy counts a thread running until the kernel marks it asleep, so a wait that has just
begun, or is about to end, is sampled too; it counts for no cause.

Each cause belongs to a plane (`PLANES`): the data path (moving and handling the activations and the gradients the
paper sends through the servers) or the control plane (everything that decides, announces and watches)."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# (cause, functions of p2ptrain whose frames make a stack count for it, path fragments that do the same)
CAUSES: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    # `deliver` is how a server relays rows and their gradients to the next server (`StageServer.deliver`)
    ("activations: push, fetch and forward", frozenset({
        "push_outputs", "_accept", "_forward", "drop_result", "push_output_grads", "fetch_output_grads",
        "push_rows", "fetch_inputs", "push_input_grads", "_fetch_output_grads", "deliver"}), ()),
    ("task pool: take, result, end epoch", frozenset({
        "take_task", "long_poll_task", "task_result", "confirm", "confirm_result", "refuse_result", "end_epoch",
        "ask_epoch", "leave", "retrying"}), ()),
    ("checkpoints", frozenset(), ("p2ptrain/state/checkpoint.py",)),
    ("the stage's replica: deposits, averaging, steps", frozenset(), ("p2ptrain/client/", "p2ptrain/state/")),
    ("the data source: rows and epochs", frozenset(), ("p2ptrain/server/feeder.py", "p2ptrain/data.py")),
    ("probes of workers", frozenset({"_probe", "echo"}), ("p2ptrain/live/probe.py",)),
    ("metrics records", frozenset(), ("p2ptrain/node/metrics.py",)),
    ("DHT: membership, records, reads", frozenset(), ("p2ptrain/dht/", "hivemind/dht/", "hivemind/utils/mpfuture")),
    ("framing and codecs (no cause above)", frozenset(), ("p2ptrain/transport.py", "p2ptrain/compression.py",
                                                          "p2ptrain/protocol/")),
    ("hivemind's P2P client (no cause above)", frozenset(), ("hivemind/p2p/",)),
)
OTHER = "event loop and the rest"
WAITING = "waiting in the event loop's selector (not work; no cause)"
DATA, CONTROL, UNKNOWN = "data path", "control plane", "either"
PLANES: dict[str, str] = {
    "activations: push, fetch and forward": DATA,
    "task pool: take, result, end epoch": CONTROL,
    "checkpoints": DATA,
    "the stage's replica: deposits, averaging, steps": DATA,
    "the data source: rows and epochs": CONTROL,
    "probes of workers": CONTROL,
    "metrics records": CONTROL,
    "DHT: membership, records, reads": CONTROL,
    "framing and codecs (no cause above)": UNKNOWN,
    "hivemind's P2P client (no cause above)": UNKNOWN,
    OTHER: UNKNOWN,
}  # framing, hivemind's client and the event loop serve both: a message of either plane passes through them
SELECTOR_WAIT = {("select", "selectors.py")}  # (function, file) of the innermost frame of a thread at its wait
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*):\d+\)$")


def cause_of(stack: list[tuple[str, str]]) -> str:
    """The cause a stack of (function, path) frames, outermost first, counts for (see the module docstring)."""
    if stack:
        function, path = stack[-1]
        if (function.rsplit(".", 1)[-1], path.rsplit("/", 1)[-1]) in SELECTOR_WAIT:
            return WAITING
    for cause, functions, paths in CAUSES:
        for function, path in stack:
            name = function.rsplit(".", 1)[-1]  # py-spy names a method by its class too: "StageServer.deliver"
            if any(fragment in path for fragment in paths) or (name in functions and "p2ptrain/" in path):
                return cause
    return OTHER


def parse_raw(text: str) -> Counter[str]:
    """Samples per cause in py-spy's raw output (a line per distinct stack: its frames, outermost first, joined by
    ';', a space, and how many samples had it)."""
    samples: Counter[str] = Counter()
    for line in text.splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or not count.isdigit():
            continue
        frames = [m.group("function", "path") for part in stack_text.split(";") if (m := FRAME.match(part))]
        samples[cause_of(frames)] += int(count)
    return samples


@dataclass
class Recording:
    """One py-spy process recording one peer process."""

    name: str
    process: subprocess.Popen
    out: Path


class Profiler:
    """py-spy recording each of some processes for `duration_s`, at `rate` samples a second, without pausing them
    (`--nonblocking`: a sample may catch a stack half-changed, which matters little to shares)."""

    def __init__(self, workdir: Path, *, duration_s: float, rate: int = 50):
        self.workdir, self.duration_s, self.rate = workdir, duration_s, rate
        self.recordings: list[Recording] = []

    @staticmethod
    def available() -> bool:
        return shutil.which("py-spy") is not None

    def start(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            out = self.workdir / f"py-spy-{name}.txt"
            process = subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(self.duration_s))),
                 "--rate", str(self.rate), "--format", "raw", "--nonblocking", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.recordings.append(Recording(name, process, out))

    def collect(self, timeout_s: float = 60.0) -> dict[str, dict[str, int]]:
        """Samples per cause of each recorded process (an empty dict for one whose recording failed)."""
        result = {}
        for recording in self.recordings:
            try:
                recording.process.wait(timeout=self.duration_s + timeout_s)
            except subprocess.TimeoutExpired:
                recording.process.kill()
                recording.process.wait()
            text = recording.out.read_text() if recording.out.exists() else ""
            result[recording.name] = dict(parse_raw(text))
        return result
