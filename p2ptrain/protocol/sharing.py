"""Tensors that several stages hold, kept equal: tied embeddings (Llama's output layer in the last stage, its
embeddings in the first) and ALBERT's shared blocks (every stage that applies a group holds a copy).

The gradient of such a tensor is the sum, over the stages that hold it, of each stage's batch-mean gradient of its
copy. After its own round, every member of stage s holds that stage's average G_s; then every member of every
holding stage averages the shared part again, in one round across those stages (`SharedRound`), each weighing its
rows: the stages' rows are equal (each stage computes every row of the batch), so the round's result is the mean of
the G_s, and the holders' count times it is their sum. Every copy then steps on that one gradient and stays equal.

The data source tells each member who is in the round: every stage's member reports its stage's group of the epoch
and the shared tensors it holds (`StageGroup`, by checkpoint key), and once every stage reported, each finds its
rounds (`shared_rounds`). Pure: no network, no torch.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.protocol.messages import GroupMember, StageGroup


@dataclass(frozen=True, kw_only=True)
class SharedRound:
    """One round across the stages that hold the same shared tensors: their keys, in the order every member sends
    them, and the members of all those stages' groups."""

    stages: tuple[int, ...]
    keys: tuple[str, ...]
    members: tuple[GroupMember, ...]


def shared_rounds(groups: Sequence[StageGroup], stage: int) -> list[SharedRound]:
    """The rounds `stage` takes part in, given every stage's report of one epoch: one per set of stages that hold
    the same keys of `stage`'s, in the order of those sets (the same order for every member, so no two members
    wait on each other's round)."""
    holders: dict[str, list[int]] = defaultdict(list)
    for entry in groups:
        for key in entry.shared:
            holders[key].append(entry.stage)
    mine = next((entry for entry in groups if entry.stage == stage), None)
    if mine is None:
        raise ValueError(f"stage {stage} did not report its group")
    by_stages: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for key in mine.shared:
        stages = tuple(sorted(holders[key]))
        if len(stages) > 1:
            by_stages[stages].append(key)
    group_of = {entry.stage: entry.group for entry in groups}
    return [SharedRound(stages=stages, keys=tuple(sorted(keys)),
                        members=tuple(member for s in stages for member in group_of[s]))
            for stages, keys in sorted(by_stages.items())]


class GroupBook:
    """The data source's record of each stage's group and shared keys per epoch: once every stage reported an
    epoch, its members can find their rounds. The first report of a (epoch, stage) counts (all members of a stage
    report the group its first FS fixed). Only the newest `kept` epochs are held."""

    def __init__(self, *, num_stages: int, kept: int):
        self.num_stages, self.kept = num_stages, kept
        self._groups: dict[int, dict[int, StageGroup]] = {}

    def report(self, *, epoch: int, entry: StageGroup) -> tuple[StageGroup, ...] | None:
        """Record a stage's group of an epoch; every stage's once all reported, else None."""
        if not 0 <= entry.stage < self.num_stages:
            raise ValueError(f"stage {entry.stage} is not in 0..{self.num_stages - 1}")
        self._groups.setdefault(epoch, {}).setdefault(entry.stage, entry)
        for old in [e for e in self._groups if e <= max(self._groups) - self.kept]:
            del self._groups[old]
        return self.groups(epoch)

    def groups(self, epoch: int) -> tuple[StageGroup, ...] | None:
        entries = self._groups.get(epoch, {})
        if len(entries) < self.num_stages:
            return None
        return tuple(entries[stage] for stage in range(self.num_stages))
