"""The backward server's ledger (paper §3.2.1): which worker produced which rows of each microbatch.

The paper keeps a linked list of (worker, start, end); here it is a sorted list per microbatch, which is the
same record. The ledger routes each gradient row back to the worker that holds its forward activations.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.protocol.rows import Rows


@dataclass(frozen=True, order=True)
class Entry:
    rows: Rows
    worker: str
    task_id: str


@dataclass
class Ledger:
    """Owns the (worker, rows, task) records of the microbatches a backward server holds; nothing else."""

    _entries: dict[tuple[int, int], list[Entry]] = field(default_factory=dict)

    def record(self, *, epoch: int, microbatch: int, worker: str, rows: Rows, task_id: str) -> bool:
        """Record that `worker` produced `rows`; False (and nothing recorded) if any of them is already known."""
        entries = self._entries.setdefault((epoch, microbatch), [])
        if any(entry.rows.intersect(rows) for entry in entries):
            return False
        bisect.insort(entries, Entry(rows=rows, worker=worker, task_id=task_id))
        return True

    def holds(self, *, epoch: int, microbatch: int, task_id: str, worker: str) -> bool:
        """Whether `worker`'s result of task `task_id` is recorded."""
        return any(entry.task_id == task_id and entry.worker == worker
                   for entry in self._entries.get((epoch, microbatch), []))

    def rows(self, *, epoch: int, microbatch: int) -> list[Rows]:
        """The row ranges recorded for a microbatch."""
        return [entry.rows for entry in self._entries.get((epoch, microbatch), [])]

    def covered(self, *, epoch: int, microbatch: int) -> int:
        return sum(len(entry.rows) for entry in self._entries.get((epoch, microbatch), []))

    def split(self, *, epoch: int, microbatch: int, rows: Rows) -> list[Entry]:
        """The entries that `rows` falls on, each cut down to its part of `rows`."""
        parts = []
        for entry in self._entries.get((epoch, microbatch), []):
            part = entry.rows.intersect(rows)
            if part is not None:
                parts.append(Entry(rows=part, worker=entry.worker, task_id=entry.task_id))
        if sum(len(p.rows) for p in parts) != len(rows):
            raise KeyError(f"ledger of microbatch {epoch}:{microbatch} does not cover rows {rows}")
        return parts

    def forget_epoch(self, epoch: int) -> None:
        for key in [key for key in self._entries if key[0] == epoch]:
            del self._entries[key]

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [[epoch, microbatch, [[e.rows.start, e.rows.end, e.worker, e.task_id] for e in entries]]
                            for (epoch, microbatch), entries in self._entries.items()]}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> Ledger:
        return cls({(epoch, microbatch): [Entry(rows=Rows(start, end), worker=worker, task_id=task_id)
                                          for start, end, worker, task_id in entries]
                    for epoch, microbatch, entries in value["entries"]})
