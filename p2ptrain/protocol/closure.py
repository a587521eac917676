"""When a worker steps: the rule that turns its frontal servers' replies into "wait", "step" or "catch up".

Each FS of a stage closes an epoch once every row of its own segment is back, and then records the epoch's
closure: the stage's FS in that epoch's layout, and the group of workers that average it. A worker may step only
when every FS of that layout has closed the epoch (one that the DHT briefly misses still counts), and it averages
with the group of the layout's first FS, so that all workers of the stage use the same group.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a worker without a task does next; at most one of ``group`` and ``catch_up_to`` is set."""

    epoch_fs: tuple[str, ...]  # the FS of the epoch's layout, as far as known: the worker keeps polling them
    group: list[tuple[str, bool]] | None = None  # step now, averaging with these (peer id, client mode)
    catch_up_to: int | None = None  # skip to this epoch without stepping: this one closed before the worker came


def judge(epoch: int, replies: dict[str, dict | None], *, epoch_fs: tuple[str, ...] = ()) -> Verdict:
    """``replies``: each polled FS's reply header (``closed_epoch``, ``closures``), None where unreachable."""
    key = str(epoch)
    closure = next((r["closures"][key] for r in replies.values() if r and key in r["closures"]), None)
    if closure is None:
        closed = [r["closed_epoch"] for r in replies.values() if r]
        if closed and max(closed) >= epoch:
            # closed so long ago that no FS remembers the epoch's group: the worker joined late
            return Verdict(epoch_fs=(), catch_up_to=max(closed) + 1)
        return Verdict(epoch_fs=epoch_fs)
    fs = tuple(closure["fs"])
    if any(replies.get(f) is None or replies[f]["closed_epoch"] < epoch for f in fs):
        return Verdict(epoch_fs=fs)
    group = replies[fs[0]]["closures"][key]["group"]
    return Verdict(epoch_fs=fs, group=[(peer, bool(client_mode)) for peer, client_mode in group])
