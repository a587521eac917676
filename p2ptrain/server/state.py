"""Everything a stage server knows about its open epochs, in one dataclass per role, saveable and restorable.

`FrontalState` and `BackwardState` hold the task pool, the workers seen, per-epoch stats and each held microbatch
(stored inputs, accepted input gradients; the ledger, assembled outputs, backward work), and nothing of it lives
elsewhere in the server. `snapshot()` turns a state into plain data plus named tensors, `restore()` back;
`save(path)` writes both into one safetensors file (atomically: a reader never sees half a file), `load(path)`
reads it. Times are in the server's clock (`time.monotonic` by default), so a restored state is meant for a server
on the same machine: lease deadlines and epoch timings in another clock would be off.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.ledger import Ledger
from p2ptrain.protocol.messages import Closure
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.taskpool import Task, TaskPool

Key = tuple[int, int]  # (epoch, microbatch)


@dataclass
class WorkerRecord:
    """A worker as a server saw it: its compute (for task sizes), when it last polled, its epoch."""

    compute: float
    last_seen: float
    epoch: int
    client_mode: bool = False
    refusals: int = 0  # results refused since its last ban
    bans: int = 0
    banned_until: float = 0.0
    left: bool = False  # it said it stops (`Leave`)
    seconds_per_row: float | None = None  # how long its tasks took here, taking to confirmed (moving average)
    probed: float = 0.0  # when this server last probed it, silent while it held work
    unreachable: float = 0.0  # when a probe last failed to reach its process: gone, unless heard from since
    holds_state: bool = False  # a server that holds the stage's state: in the averaging group, never given tasks
    deposited: int = 0  # rows of its epoch its deposited gradients cover, by its last poll (`TakeTask.deposited`)
    last_result: float = 0.0  # when a result of it was last accepted here


@dataclass
class EpochStats:
    rows: int = 0
    rows_recomputed: int = 0  # rows redone because the worker holding their parameter gradients vanished
    rows_dropped: int = 0  # rows whose parameter gradients a vanished worker took, not redone (policy swarm)
    rows_grouped: int = 0  # rows whose parameter gradients the epoch's averaging group holds (an FS, at closure)
    workers_lost: int = 0
    workers_joined: int = 0  # workers first seen here while the epoch was open (an FS)
    abandoned: bool = False  # ended without a step: a server of its layout restarted or was lost (`EndEpoch`)
    loss_sum: float = 0.0
    tokens: int = 0
    started: float | None = None
    completed: float | None = None  # every row of the epoch came back (an FS); closing may wait on its workers
    finished: float | None = None


@dataclass(kw_only=True)
class MicrobatchInputs:
    """An FS's segment of one microbatch: the stage inputs it hands out and keeps for recomputation, and the input
    gradients that came back."""

    segment: Rows
    total_rows: int
    layout: Layout
    inputs: torch.Tensor
    labels: torch.Tensor
    received: list[Rows] = field(default_factory=list)
    grads: torch.Tensor | None = None
    grads_received: list[Rows] = field(default_factory=list)
    done: bool = False


@dataclass(frozen=True, kw_only=True)
class Result:
    """A result an FS accepted: `worker` now holds the parameter gradients of these rows until its stage averages."""

    task: str
    worker: str
    microbatch: int
    rows: Rows


@dataclass(kw_only=True)
class RedoWork:
    """A task that redoes a vanished worker's rows, with the output gradients of those rows (none in the last
    stage, which computes its own)."""

    task: Task
    grad: torch.Tensor | None = None


@dataclass(kw_only=True)
class MicrobatchOutputs:
    """A BS's segment of one microbatch: the output rows assembled until the segment is complete."""

    segment: Rows
    total_rows: int
    layout: Layout
    outputs: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    grads_received: list[Rows] = field(default_factory=list)  # rows whose output gradients came back


@dataclass(kw_only=True)
class BackwardWork:
    """A backward task's output gradients, kept until the task's result is confirmed."""

    task: Task
    grad: torch.Tensor
    forward_task: str


@dataclass(kw_only=True)
class KeptGrads:
    """The output gradients a BS received for its segment of one microbatch, kept a few epochs past closure so
    that rows of a vanished worker can be redone (`FetchOutputGrads`)."""

    segment: Rows
    grad: torch.Tensor
    fs: tuple[str, ...]  # the stage's FS in the microbatch's layout: the only peers it is for


@dataclass
class EpochProgress:
    rows_recorded: int = 0
    rows_backward: int = 0
    # the last stage's BS: rows whose loss came but whose issuer was gone to confirm it, counted once the data source
    # `committed` the epoch, which proves they passed their FS
    rows_unconfirmed: int = 0
    committed: bool = False


@dataclass(kw_only=True)
class ServerState:
    """What both roles keep: the task pool, the workers seen, per-epoch stats and the last epoch closed here."""

    role: ClassVar[str]

    pool: TaskPool
    closed_epoch: int = -1
    task_counter: int = 0
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    epochs: dict[int, EpochStats] = field(default_factory=dict)
    # epoch -> (task, worker) of every task of this server's pool whose result the other role confirmed, kept past
    # closure: a confirmation asked again after a lost reply is confirmed again
    settled: dict[int, set[tuple[str, str]]] = field(default_factory=dict)
    # epochs the data source abandoned, not yet closed here (an earlier one still closing), with the stage's FS in
    # their layout
    abandoned: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Plain data (JSON-ready) and the tensors it refers to by name."""
        tensors: dict[str, torch.Tensor] = {}
        meta = {
            "role": self.role, "pool": self.pool.to_dict(), "closed_epoch": self.closed_epoch,
            "task_counter": self.task_counter,
            "workers": {w: vars(record) for w, record in self.workers.items()},
            "epochs": [[epoch, vars(stats)] for epoch, stats in self.epochs.items()],
            "settled": [[epoch, sorted(pairs)] for epoch, pairs in self.settled.items()],
            "abandoned": [[epoch, list(fs)] for epoch, fs in self.abandoned.items()],
            **self._snapshot_role(tensors),
        }
        return meta, tensors

    @classmethod
    def restore(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Self:
        if meta.get("role") != cls.role:
            raise ValueError(f"a saved {meta.get('role')} state cannot restore a {cls.role} server")
        return cls(pool=TaskPool.from_dict(meta["pool"]), closed_epoch=meta["closed_epoch"],
                   task_counter=meta["task_counter"],
                   workers={w: WorkerRecord(**record) for w, record in meta["workers"].items()},
                   epochs={epoch: EpochStats(**stats) for epoch, stats in meta["epochs"]},
                   settled={epoch: {(task, worker) for task, worker in pairs} for epoch, pairs in meta["settled"]},
                   abandoned={epoch: tuple(fs) for epoch, fs in meta["abandoned"]},
                   **cls._restore_role(meta, tensors))

    def save(self, path: str | Path) -> None:
        meta, tensors = self.snapshot()
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        # safetensors refuses tensors that share memory (views of one microbatch); copies are independent
        save_file({name: t.detach().clone().contiguous() for name, t in tensors.items()}, str(tmp),
                  metadata={"state": json.dumps(meta)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Self:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["state"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return cls.restore(meta, tensors)

    def _snapshot_role(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _restore_role(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(kw_only=True)
class FrontalState(ServerState):
    """An FS's state: its microbatches' inputs and gradients, which are complete per epoch, the closures of recent
    epochs (each with its averaging group), and the (task, worker) of every result accepted lately, kept past
    closure so that a worker whose reply was lost hears "accepted" again."""

    role: ClassVar[str] = "fs"

    microbatches: dict[Key, MicrobatchInputs] = field(default_factory=dict)
    completed: dict[int, set[int]] = field(default_factory=dict)
    closures: dict[int, Closure] = field(default_factory=dict)
    accepted: dict[int, set[tuple[str, str]]] = field(default_factory=dict)
    results: dict[int, list[Result]] = field(default_factory=dict)  # of epochs not yet closed
    redo: dict[str, RedoWork] = field(default_factory=dict)
    committed: set[int] = field(default_factory=set)  # epochs the data source committed, not yet closed here
    batch: int = -1  # the global batch of data of the last epoch committed here (a restarted data source asks)
    # epoch -> microbatches with rows dropped (policy swarm), which the data source feeds again; kept closures_kept
    dropped: dict[int, set[int]] = field(default_factory=dict)
    # epoch -> workers judged gone while holding its parameter gradients: their rows went to others, so one that was
    # alive after all is kept out of the epoch's group and its later results of the epoch are refused
    lost: dict[int, set[str]] = field(default_factory=dict)
    # with average_every > 1: the rows each worker handed in since the stage's last round, which weigh its part there
    interval_rows: dict[str, int] = field(default_factory=dict)

    def _snapshot_role(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        microbatches = []
        for (epoch, index), mb in self.microbatches.items():
            prefix = f"mb/{epoch}/{index}/"
            tensors[prefix + "inputs"], tensors[prefix + "labels"] = mb.inputs, mb.labels
            if mb.grads is not None:
                tensors[prefix + "grads"] = mb.grads
            microbatches.append({"key": [epoch, index], **_common(mb), "received": _rows_list(mb.received),
                                 "grads_received": _rows_list(mb.grads_received), "done": mb.done,
                                 "has_grads": mb.grads is not None})
        return {
            "microbatches": microbatches,
            "completed": [[epoch, sorted(indices)] for epoch, indices in self.completed.items()],
            "closures": [closure.to_header() for closure in self.closures.values()],
            "accepted": [[epoch, sorted(pairs)] for epoch, pairs in self.accepted.items()],
            "results": [[epoch, [[r.task, r.worker, r.microbatch, r.rows.start, r.rows.end] for r in results]]
                        for epoch, results in self.results.items()],
            "redo": [{"task": work.task.to_dict(), "has_grad": _keep(tensors, f"redo/{task_id}/grad", work.grad)}
                     for task_id, work in self.redo.items()],
            "committed": sorted(self.committed), "batch": self.batch,
            "dropped": [[epoch, sorted(indices)] for epoch, indices in self.dropped.items()],
            "lost": [[epoch, sorted(workers)] for epoch, workers in self.lost.items()],
            "interval_rows": sorted(self.interval_rows.items()),
        }

    @classmethod
    def _restore_role(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        microbatches = {}
        for mb in meta["microbatches"]:
            epoch, index = mb["key"]
            prefix = f"mb/{epoch}/{index}/"
            microbatches[(epoch, index)] = MicrobatchInputs(
                **_common_back(mb), inputs=tensors[prefix + "inputs"], labels=tensors[prefix + "labels"],
                received=_rows_back(mb["received"]), grads=tensors[prefix + "grads"] if mb["has_grads"] else None,
                grads_received=_rows_back(mb["grads_received"]), done=mb["done"])
        closures = [Closure.from_header(closure) for closure in meta["closures"]]
        return {
            "microbatches": microbatches,
            "completed": {epoch: set(indices) for epoch, indices in meta["completed"]},
            "closures": {closure.epoch: closure for closure in closures},
            "accepted": {epoch: {(task, worker) for task, worker in pairs} for epoch, pairs in meta["accepted"]},
            # states saved by earlier versions carry a sixth field (the task's issuer), which nothing reads now
            "results": {epoch: [Result(task=task, worker=worker, microbatch=index, rows=Rows(start, end))
                                for task, worker, index, start, end, *_ in results]
                        for epoch, results in meta["results"]},
            "redo": {work["task"]["task_id"]: RedoWork(
                task=Task.from_dict(work["task"]),
                grad=tensors[f"redo/{work['task']['task_id']}/grad"] if work["has_grad"] else None)
                for work in meta["redo"]},
            "committed": set(meta["committed"]), "batch": meta["batch"],
            "dropped": {epoch: set(indices) for epoch, indices in meta["dropped"]},
            "lost": {epoch: set(workers) for epoch, workers in meta["lost"]},
            "interval_rows": dict(meta.get("interval_rows", [])),
        }


@dataclass(kw_only=True)
class BackwardState(ServerState):
    """A BS's state: the ledger, its microbatches' assembled outputs, the output gradients of backward tasks not yet
    confirmed, and per epoch how many rows were recorded and came back through the backward pass."""

    role: ClassVar[str] = "bs"

    microbatches: dict[Key, MicrobatchOutputs] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    work: dict[str, BackwardWork] = field(default_factory=dict)
    progress: dict[int, EpochProgress] = field(default_factory=dict)
    kept_grads: dict[Key, KeptGrads] = field(default_factory=dict)

    def _snapshot_role(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        microbatches = []
        for (epoch, index), mb in self.microbatches.items():
            if mb.outputs is not None:
                tensors[f"mb/{epoch}/{index}/outputs"], tensors[f"mb/{epoch}/{index}/labels"] = mb.outputs, mb.labels
            microbatches.append({"key": [epoch, index], **_common(mb), "has_outputs": mb.outputs is not None,
                                 "grads_received": _rows_list(mb.grads_received)})
        for task_id, work in self.work.items():
            tensors[f"work/{task_id}/grad"] = work.grad
        for (epoch, index), kept in self.kept_grads.items():
            tensors[f"kept/{epoch}/{index}/grad"] = kept.grad
        return {
            "kept_grads": [[epoch, index, kept.segment.start, kept.segment.end, list(kept.fs)]
                           for (epoch, index), kept in self.kept_grads.items()],
            "microbatches": microbatches, "ledger": self.ledger.to_dict(),
            "work": [{"task": work.task.to_dict(), "forward_task": work.forward_task} for work in self.work.values()],
            "progress": [[epoch, vars(progress)] for epoch, progress in self.progress.items()],
        }

    @classmethod
    def _restore_role(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        microbatches = {}
        for mb in meta["microbatches"]:
            epoch, index = mb["key"]
            held = mb["has_outputs"]
            microbatches[(epoch, index)] = MicrobatchOutputs(
                **_common_back(mb), outputs=tensors[f"mb/{epoch}/{index}/outputs"] if held else None,
                labels=tensors[f"mb/{epoch}/{index}/labels"] if held else None,
                grads_received=_rows_back(mb["grads_received"]))
        work = {}
        for entry in meta["work"]:
            task = Task.from_dict(entry["task"])
            work[task.task_id] = BackwardWork(task=task, grad=tensors[f"work/{task.task_id}/grad"],
                                              forward_task=entry["forward_task"])
        kept = {(epoch, index): KeptGrads(segment=Rows(start, end), grad=tensors[f"kept/{epoch}/{index}/grad"],
                                          fs=tuple(fs))
                for epoch, index, start, end, fs in meta["kept_grads"]}
        return {"microbatches": microbatches, "ledger": Ledger.from_dict(meta["ledger"]), "work": work,
                "progress": {epoch: EpochProgress(**progress) for epoch, progress in meta["progress"]},
                "kept_grads": kept}


def _keep(tensors: dict[str, torch.Tensor], name: str, tensor: torch.Tensor | None) -> bool:
    if tensor is not None:
        tensors[name] = tensor
    return tensor is not None


def _rows_list(parts: list[Rows]) -> list[list[int]]:
    return [[rows.start, rows.end] for rows in parts]


def _rows_back(parts: list[list[int]]) -> list[Rows]:
    return [Rows(start, end) for start, end in parts]


def _common(mb: MicrobatchInputs | MicrobatchOutputs) -> dict[str, Any]:
    return {"segment": [mb.segment.start, mb.segment.end], "total_rows": mb.total_rows,
            "layout": [[list(s.fs), list(s.bs)] for s in mb.layout.stages]}


def _common_back(mb: dict[str, Any]) -> dict[str, Any]:
    return {"segment": Rows(*mb["segment"]), "total_rows": mb["total_rows"],
            "layout": Layout(tuple(StageServers(fs=tuple(fs), bs=tuple(bs)) for fs, bs in mb["layout"]))}

