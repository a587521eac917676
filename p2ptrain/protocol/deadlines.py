"""Deadlines that follow the link (docs/design.md §5, issue 25): a wait that decides a peer is gone or a transfer
lost is a floor plus the time the bytes in flight need at the rate measured on that link, times a slack. A rate is
measured, never assumed high: until a link has carried a transfer big enough to time, the slowest uplink the run
allows for (`RuntimeConfig.slowest_uplink_mbit`) stands in. Pure: callers hand in bytes and seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_TIMED_BYTES = 256 * 1024  # a smaller transfer times the round trip and the handler, not the link's rate


def transfer_deadline_s(nbytes: float, *, rate: float, floor_s: float, slack: float) -> float:
    """How long `nbytes` may take at `rate` bytes/s: `floor_s` (latency, handlers, a busy peer) plus `slack` times
    their time on the wire."""
    if not rate > 0:
        raise ValueError(f"rate must be positive, not {rate}")
    return floor_s + slack * nbytes / rate


@dataclass
class Throughput:
    """A link's rate in bytes/s, an exponentially weighted mean over transfers of at least `MIN_TIMED_BYTES`;
    `assumed` until one was timed."""

    assumed: float
    weight: float = 0.5  # of the newest transfer: a link that slows (a mate's round shares it) counts soon
    measured: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.assumed > 0:
            raise ValueError(f"assumed must be positive, not {self.assumed}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], not {self.weight}")

    def observe(self, nbytes: float, seconds: float) -> None:
        """A transfer of `nbytes` that took `seconds`, start to end."""
        if nbytes < MIN_TIMED_BYTES or not seconds > 0:
            return
        rate = nbytes / seconds
        self.measured = rate if self.measured is None else self.weight * rate + (1 - self.weight) * self.measured

    @property
    def rate(self) -> float:
        return self.assumed if self.measured is None else self.measured

    def deadline_s(self, nbytes: float, *, floor_s: float, slack: float) -> float:
        return transfer_deadline_s(nbytes, rate=self.rate, floor_s=floor_s, slack=slack)


def all_reduce_bytes(numel: int, *, members: int, itemsize: float, reducers: int | None = None) -> int:
    """The most one member of a butterfly all-reduce among `members` sends (and receives), `reducers` of them (all, by
    default) reducing equal shares: a reducer sends its tensors' parts for the other reducers' shares, then the
    average of its own share back to every other member; a member that reduces none sends its tensors and gets the
    whole average, no more."""
    if members < 2:
        return 0
    reducers = members if reducers is None else reducers
    return int((members + reducers - 2) * numel * itemsize / reducers)
