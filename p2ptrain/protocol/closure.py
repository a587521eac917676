"""When a worker steps: the rule that turns its frontal servers' replies into "wait", "step" or "catch up".

Each FS of a stage closes an epoch once every row of its own segment is back, and then records the epoch's
closure: the stage's FS in that epoch's layout, and the group of workers that average it (or that the data source
abandoned the epoch because a server lost its rows: every worker of the stage then drops it alike). A worker may
step only when every FS of that layout has closed the epoch (one that the DHT briefly misses still counts), and it
averages with the group of the layout's first FS, so that all workers of the stage use the same group. An FS lost
for good after the data source committed the epoch is left out of both rules.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from p2ptrain.protocol.messages import GroupMember, TaskReply


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a worker without a task does next; at most one of ``group`` and ``catch_up_to`` is set."""

    epoch_fs: tuple[str, ...]  # the FS of the epoch's layout, as far as known: the worker keeps polling them
    group: tuple[GroupMember, ...] | None = None  # step now, averaging with these
    catch_up_to: int | None = None  # skip to this epoch without stepping: this one closed before the worker came
    abandoned: bool = False  # the epoch ended without a step: drop its gradients and go on to the next


def judge(epoch: int, replies: Mapping[str, TaskReply | None], *, epoch_fs: tuple[str, ...] = (),
          gone: Collection[str] = ()) -> Verdict:
    """``replies``: each polled FS's reply without a task, None where the FS could not be reached. ``gone``: FS that
    have not answered this worker for long (lost for good): the epoch's other FS decide without them, the first of
    those giving the group (every row of a committed epoch came back, so no row waits on a lost FS)."""
    closures = {fs: {c.epoch: c for c in reply.closures} for fs, reply in replies.items() if reply is not None}
    closure = next((held[epoch] for held in closures.values() if epoch in held), None)
    if closure is None:
        closed = [reply.closed_epoch for reply in replies.values() if reply is not None]
        if closed and min(closed) >= epoch:
            # closed so long ago that no FS remembers the epoch's group: the worker joined late. Not while an FS still
            # has it open: that one gives the group when it closes it (an FS that restarted stands past the epochs
            # it resumed after, and remembers none of their groups)
            return Verdict(epoch_fs=(), catch_up_to=max(closed) + 1)
        return Verdict(epoch_fs=epoch_fs)
    if closure.abandoned:  # the data source abandoned it at every server: one FS's word is enough, even if
        return Verdict(epoch_fs=(), abandoned=True)  # another FS of its layout is gone for good
    fs = tuple(f for f in closure.fs if f not in gone) or closure.fs
    if any(replies.get(f) is None or replies[f].closed_epoch < epoch for f in fs):
        return Verdict(epoch_fs=fs)
    first = closures[fs[0]].get(epoch)
    if first is None:  # the first FS closed the epoch so long ago that it forgot the group: too late to average
        return Verdict(epoch_fs=(), catch_up_to=max(replies[f].closed_epoch for f in fs) + 1)
    return Verdict(epoch_fs=fs, group=first.group)
