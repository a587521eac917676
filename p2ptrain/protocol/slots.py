"""Which data each microbatch of an epoch carries, under either fault policy (`RunConfig.fault_policy`)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

Slot = tuple[int, int]  # the data of one microbatch: (global batch, microbatch index) of the text source


@dataclass
class SlotPlan:
    """Which data each microbatch of an epoch carries. Under the task pool, the swarm's `batch`-th global batch of
    the text source, whole. Under fault policy swarm, the data of microbatches whose rows a stage dropped with a
    vanished worker comes again first (SWARM retrains what a departed peer held), and fresh data goes on where it
    stopped. Pure: the data source tells it what was dropped."""

    microbatches: int
    swarm: bool
    fresh: int = 0  # microbatches of fresh data handed out (policy swarm)
    retrain: deque[Slot] = field(default_factory=deque)
    fed: dict[int, list[Slot]] = field(default_factory=dict)  # epoch -> its slots, for recent epochs
    retrained: dict[int, int] = field(default_factory=dict)  # epoch -> how many of its slots came again
    queued: set[tuple[int, int]] = field(default_factory=set)  # (epoch, microbatch) drops queued already

    def slots(self, epoch: int, batch: int) -> list[Slot]:
        """The data of `epoch`'s microbatches, which trains as the swarm's `batch`-th global batch."""
        if not self.swarm:
            slots, again = [(batch, index) for index in range(self.microbatches)], 0
        else:
            again = min(len(self.retrain), self.microbatches)
            slots = [self.retrain.popleft() for _ in range(again)]
            slots += [divmod(self.fresh + i, self.microbatches) for i in range(self.microbatches - again)]
            self.fresh += self.microbatches - again
        self.fed[epoch], self.retrained[epoch] = slots, again
        return slots

    def refeed(self, abandoned: int, epoch: int) -> list[Slot]:
        """An abandoned epoch's data, fed again as `epoch`."""
        self.fed[epoch], self.retrained[epoch] = self.fed[abandoned], self.retrained[abandoned]
        return self.fed[epoch]

    def dropped(self, epoch: int, microbatch: int) -> bool:
        """A stage dropped rows of `epoch`'s microbatch: queue its data again; False if queued already, or if the
        epoch is no longer remembered."""
        if (epoch, microbatch) in self.queued or epoch not in self.fed:
            return False
        self.queued.add((epoch, microbatch))
        self.retrain.append(self.fed[epoch][microbatch])
        return True

    def forget_before(self, epoch: int) -> None:
        """Epochs before `epoch` are no longer asked about."""
        for table in (self.fed, self.retrained):
            for old in [e for e in table if e < epoch]:
                del table[old]
        self.queued = {key for key in self.queued if key[0] >= epoch}
