"""Row ranges of a microbatch and their even segmentation over servers (paper §3.2.1)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Rows:
    """Half-open range of rows [start, end) of one microbatch."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid row range [{self.start}, {self.end})")

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def __len__(self) -> int:
        return self.end - self.start

    def intersect(self, other: Rows) -> Rows | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Rows(start, end) if start < end else None

    def relative_to(self, outer: Rows) -> slice:
        """The slice of a tensor holding `outer`'s rows that holds this range's rows."""
        if outer.intersect(self) != self:
            raise ValueError(f"rows {self} lie outside {outer}")
        return slice(self.start - outer.start, self.end - outer.start)


def segments(total_rows: int, receivers: int) -> list[Rows]:
    """Split rows [0, total_rows) evenly over `receivers` servers; earlier segments take the remainder."""
    if receivers < 1:
        raise ValueError("need at least one receiver")
    base, extra = divmod(total_rows, receivers)
    bounds = [0]
    for index in range(receivers):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return [Rows(bounds[i], bounds[i + 1]) for i in range(receivers)]


def route(rows: Rows, receivers: int, total_rows: int) -> list[tuple[int, Rows]]:
    """Which receiver gets which part of `rows` when [0, total_rows) is segmented over `receivers`.

    With two senders and three receivers, the first sender's half goes 2/3 to receiver 0 and 1/3 to receiver 1,
    as in the paper: every row index keeps one owner, so the backward pass finds its rows again.
    """
    routed = []
    for index, segment in enumerate(segments(total_rows, receivers)):
        part = rows.intersect(segment)
        if part is not None:
            routed.append((index, part))
    return routed


def split_by_compute(rows: Rows, compute: dict[str, float]) -> list[tuple[str, Rows]]:
    """Split `rows` into contiguous shares proportional to each worker's compute (largest remainder)."""
    workers = sorted(compute)
    total = sum(compute[w] for w in workers)
    if not workers or total <= 0:
        raise ValueError("need at least one worker with positive compute")
    exact = [len(rows) * compute[w] / total for w in workers]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(workers)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: len(rows) - sum(counts)]:
        counts[i] += 1
    shares, start = [], rows.start
    for worker, count in zip(workers, counts):
        if count:
            shares.append((worker, Rows(start, start + count)))
            start += count
    return shares
