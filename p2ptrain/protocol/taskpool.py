"""The task pool of a server (paper §3.2.1 "Task Pool"): tasks not yet done, leased to workers with a deadline
(the caller sizes each lease, e.g. by the worker's measured speed and its link; `lease_timeout` is the
default).

A task whose worker does not finish it before its deadline, or whose result was refused, goes back to the pool
for any worker to take. Time is passed in by the caller, so the pool runs the same in the live runtime, in
simulations and in tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from p2ptrain.protocol.rows import Rows


class Kind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    # forward and backward again, on rows whose parameter gradients were lost with a vanished worker: only the
    # parameter gradients count, the stage's outputs and input gradients went on already
    REDO = "redo"


@dataclass(frozen=True, kw_only=True)
class Task:
    task_id: str
    kind: Kind
    epoch: int
    microbatch: int
    rows: Rows
    preferred: str | None = None  # the worker this task was sized for, or that did the forward rows

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "kind": self.kind.value, "epoch": self.epoch, "microbatch": self.microbatch,
                "rows": [self.rows.start, self.rows.end], "preferred": self.preferred}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> Task:
        return cls(task_id=value["task_id"], kind=Kind(value["kind"]), epoch=value["epoch"],
                   microbatch=value["microbatch"], rows=Rows(*value["rows"]), preferred=value["preferred"])


@dataclass(frozen=True, kw_only=True)
class Lease:
    task: Task
    worker: str
    deadline: float
    taken: float  # when the worker took it: the issuer times its workers by it


@dataclass
class TaskPool:
    """Owns the tasks of one server: pending, leased and done, per epoch; knows nothing of tensors or peers.

    Every task belongs to one epoch, and the pool keeps the ids of each epoch's tasks, so that closing an epoch
    forgets exactly them.
    """

    lease_timeout: float
    _pending: dict[str, Task] = field(default_factory=dict)
    _leased: dict[str, Lease] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)
    _excluded: dict[str, set[str]] = field(default_factory=dict)  # task -> workers whose result was refused
    _epochs: dict[int, set[str]] = field(default_factory=dict)  # epoch -> ids of its tasks, in any state
    redone: dict[int, int] = field(default_factory=dict)  # epoch -> tasks handed out again

    def add(self, task: Task, *, again: bool = False) -> None:
        """Queue a new task; `again`: it redoes work that was lost, and counts as a task redone."""
        if self.knows(task.task_id):
            raise ValueError(f"task {task.task_id} is already known")
        self._pending[task.task_id] = task
        self._epochs.setdefault(task.epoch, set()).add(task.task_id)
        if again:
            self.redone[task.epoch] = self.redone.get(task.epoch, 0) + 1

    def knows(self, task_id: str) -> bool:
        return task_id in self._pending or task_id in self._leased or task_id in self._done

    def get(self, task_id: str) -> Task | None:
        """The task while it is pending or leased; None once done, forgotten or never added."""
        lease = self._leased.get(task_id)
        return lease.task if lease is not None else self._pending.get(task_id)

    def take(self, worker: str, *, now: float, epoch: int | None = None,
             lease_s: Callable[[Task], float] | None = None) -> Task | None:
        """Lease the oldest task meant for `worker`, else the oldest task at all; None if nothing fits.

        With `epoch`, only tasks of that epoch: a worker's gradients must all belong to the epoch it averages.
        `lease_s(task)`: how long this worker may take on the task (default `lease_timeout`), bounded by the caller.
        """
        candidates = [
            t for t in self._pending.values()
            if (epoch is None or t.epoch == epoch) and worker not in self._excluded.get(t.task_id, ())
        ]
        if not candidates:
            return None
        task = min(candidates, key=lambda t: (t.preferred != worker, t.epoch, t.microbatch, t.rows.start))
        del self._pending[task.task_id]
        duration = self.lease_timeout if lease_s is None else lease_s(task)
        self._leased[task.task_id] = Lease(task=task, worker=worker, deadline=now + duration, taken=now)
        return task

    def lease(self, task_id: str) -> Lease | None:
        return self._leased.get(task_id)

    def complete(self, task_id: str) -> bool:
        """Mark a task done, whoever delivered it: a late result of an expired lease still counts once.

        False if the task is unknown or already done, so a second delivery of the same rows is not counted.
        """
        if self._leased.pop(task_id, None) is None and self._pending.pop(task_id, None) is None:
            return False
        self._done.add(task_id)
        self._excluded.pop(task_id, None)
        return True

    def fail(self, task_id: str, worker: str) -> Task | None:
        """The result of `worker` was refused: requeue the task for anyone but that worker."""
        lease = self._leased.get(task_id)
        if lease is None or lease.worker != worker:
            return None
        self._excluded.setdefault(task_id, set()).add(worker)
        return self.requeue(task_id)

    def requeue(self, task_id: str) -> Task | None:
        """Put a leased task back into the pool (its worker vanished or its result was refused)."""
        lease = self._leased.pop(task_id, None)
        if lease is None:
            return None
        self._pending[task_id] = lease.task
        self.redone[lease.task.epoch] = self.redone.get(lease.task.epoch, 0) + 1
        return lease.task

    def requeue_worker(self, worker: str) -> list[Task]:
        """Requeue every task leased to `worker` (it is gone); returns them."""
        mine = [task_id for task_id, lease in self._leased.items() if lease.worker == worker]
        return [task for task_id in mine if (task := self.requeue(task_id)) is not None]

    def leased_to(self, worker: str) -> bool:
        return any(lease.worker == worker for lease in self._leased.values())

    def expire(self, *, now: float) -> list[Task]:
        """Requeue every lease past its deadline; returns the requeued tasks."""
        late = [task_id for task_id, lease in self._leased.items() if lease.deadline <= now]
        return [task for task_id in late if (task := self.requeue(task_id)) is not None]

    def forget_epoch(self, epoch: int) -> None:
        """Drop a closed epoch: its bookkeeping, and any copy of its tasks still queued or leased (a late
        duplicate), which no worker may take once the epoch is averaged."""
        for task_id in self._epochs.pop(epoch, set()):
            self._pending.pop(task_id, None)
            self._leased.pop(task_id, None)
            self._done.discard(task_id)
            self._excluded.pop(task_id, None)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def leased(self) -> int:
        return len(self._leased)

    def to_dict(self) -> dict[str, Any]:
        """Everything the pool holds, as plain data (lease deadlines in the caller's clock)."""
        return {
            "lease_timeout": self.lease_timeout,
            "pending": [task.to_dict() for task in self._pending.values()],
            "leased": [{"task": lease.task.to_dict(), "worker": lease.worker, "deadline": lease.deadline,
                        "taken": lease.taken} for lease in self._leased.values()],
            "done": sorted(self._done),
            "excluded": {task_id: sorted(workers) for task_id, workers in self._excluded.items()},
            "epochs": [[epoch, sorted(ids)] for epoch, ids in self._epochs.items()],
            "redone": [[epoch, count] for epoch, count in self.redone.items()],
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> TaskPool:
        pool = cls(lease_timeout=value["lease_timeout"])
        pool._pending = {t["task_id"]: Task.from_dict(t) for t in value["pending"]}
        pool._leased = {lease["task"]["task_id"]: Lease(task=Task.from_dict(lease["task"]), worker=lease["worker"],
                                                        deadline=lease["deadline"], taken=lease["taken"])
                        for lease in value["leased"]}
        pool._done = set(value["done"])
        pool._excluded = {task_id: set(workers) for task_id, workers in value["excluded"].items()}
        pool._epochs = {epoch: set(ids) for epoch, ids in value["epochs"]}
        pool.redone = {epoch: count for epoch, count in value["redone"]}
        return pool
