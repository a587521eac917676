"""The task pool of a server (paper §3.2.1 "Task Pool"): tasks not yet done, leased to workers with a deadline.

A task whose worker does not finish it before its deadline, or whose result was refused, goes back to the pool
for any worker to take. Time is passed in by the caller, so the pool runs the same in the live runtime, in
simulations and in tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from p2ptrain.protocol.rows import Rows


class Kind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Task:
    task_id: str
    kind: Kind
    epoch: int
    microbatch: int
    rows: Rows
    preferred: str | None = None  # the worker this task was sized for, or that did the forward rows


@dataclass
class Lease:
    task: Task
    worker: str
    deadline: float


@dataclass
class TaskPool:
    lease_timeout: float
    _pending: dict[str, Task] = field(default_factory=dict)
    _leased: dict[str, Lease] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)
    _excluded: dict[str, set[str]] = field(default_factory=dict)  # task -> workers whose result was refused
    redone: dict[int, int] = field(default_factory=dict)  # epoch -> tasks handed out again

    def add(self, task: Task) -> None:
        if task.task_id in self._pending or task.task_id in self._leased or task.task_id in self._done:
            raise ValueError(f"task {task.task_id} is already known")
        self._pending[task.task_id] = task

    def take(self, worker: str, *, now: float, epoch: int | None = None) -> Task | None:
        """Lease the oldest task meant for `worker`, else the oldest task at all; None if nothing fits.

        With `epoch`, only tasks of that epoch: a worker's gradients must all belong to the epoch it averages.
        """
        candidates = [
            t for t in self._pending.values()
            if (epoch is None or t.epoch == epoch) and worker not in self._excluded.get(t.task_id, ())
        ]
        if not candidates:
            return None
        order = sorted(candidates, key=lambda t: (t.preferred != worker, t.epoch, t.microbatch, t.rows.start))
        task = order[0]
        del self._pending[task.task_id]
        self._leased[task.task_id] = Lease(task=task, worker=worker, deadline=now + self.lease_timeout)
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

    def expire(self, *, now: float) -> list[Task]:
        """Requeue every lease past its deadline; returns the requeued tasks."""
        late = [task_id for task_id, lease in self._leased.items() if lease.deadline <= now]
        return [task for task_id in late if (task := self.requeue(task_id)) is not None]

    def forget_epoch(self, epoch: int) -> None:
        """Drop a closed epoch: its bookkeeping, and any copy of its tasks still queued or leased (a late
        duplicate), which no worker may take once the epoch is averaged."""
        self._pending = {k: t for k, t in self._pending.items() if t.epoch != epoch}
        self._leased = {k: lease for k, lease in self._leased.items() if lease.task.epoch != epoch}
        self._done = {task_id for task_id in self._done if not task_id.startswith(f"{epoch}:")}
        self._excluded = {k: v for k, v in self._excluded.items() if not k.startswith(f"{epoch}:")}

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def leased(self) -> int:
        return len(self._leased)
