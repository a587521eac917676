"""The rules of a step that every worker of every stage must apply alike, so that the swarm steps as one process:
the learning rate of a global epoch, the coefficient of clipping by the global gradient norm, the data source's
book of each stage's gradient norm, and the parameter digest that shows a stage's workers hold the same weights.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# torch.nn.utils.clip_grad_norm_ adds this to the norm, so that a zero gradient divides safely; one process and the
# swarm must clip with the same coefficient
CLIP_EPS = 1e-6
# how far two workers' digests of the same stage may differ, relative to the digest's scale: every member of a round
# ends with the very same average (`client.averaging`), so stage mates that stepped alike agree well within it; a
# worker that missed a round differs by orders of magnitude more
DIGEST_TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """The learning rate of each global epoch: a linear warm-up to `lr` over `warmup_epochs` (epoch e < warmup runs
    at lr·(e+1)/(warmup+1), as nanoGPT warms up), then a cosine from `lr` down to `min_lr` at `decay_epochs`, and
    `min_lr` after; with `decay_epochs` 0 it stays at `lr` after the warm-up."""

    lr: float
    warmup_epochs: int = 0
    decay_epochs: int = 0
    min_lr: float = 0.0

    def at(self, epoch: int) -> float:
        if epoch < self.warmup_epochs:
            return self.lr * (epoch + 1) / (self.warmup_epochs + 1)
        if not self.decay_epochs:
            return self.lr
        if epoch >= self.decay_epochs:
            return self.min_lr
        progress = (epoch - self.warmup_epochs) / (self.decay_epochs - self.warmup_epochs)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What to multiply the gradient by to clip its norm `norm` to `max_norm`, as torch's clip_grad_norm_ does."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


class NormBook:
    """The data source's record of each stage's squared gradient norm per epoch: once every stage reported an
    epoch, its global norm is known. The first report of a (epoch, stage) counts: all workers of a stage hand in
    the norm of the same averaged gradient, up to rounding, and all must clip by one global norm. Only the newest
    `kept` epochs are held; a stage reports an epoch once it averaged it, never long after the others."""

    def __init__(self, *, num_stages: int, kept: int):
        self.num_stages, self.kept = num_stages, kept
        self._squares: dict[int, dict[int, float]] = {}

    def report(self, *, epoch: int, stage: int, squared_norm: float) -> float | None:
        """Record a stage's squared norm of an epoch; the epoch's global norm once every stage reported, else
        None."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is not in 0..{self.num_stages - 1}")
        if not (math.isfinite(squared_norm) and squared_norm >= 0):
            raise ValueError(f"squared norm {squared_norm} is not a finite number of 0 or more")
        squares = self._squares.setdefault(epoch, {})
        squares.setdefault(stage, squared_norm)
        for old in [e for e in self._squares if e <= max(self._squares) - self.kept]:
            del self._squares[old]
        return self.global_norm(epoch)

    def global_norm(self, epoch: int) -> float | None:
        """The epoch's global norm if every stage reported it, else None."""
        squares = self._squares.get(epoch, {})
        if len(squares) < self.num_stages:
            return None
        return math.sqrt(sum(squares.values()))


# (elements, tensors, sum, sum of squares, sum over tensors of the tensor's sum times its position from 1)
Digest = tuple[float, ...]


def digests_agree(digests: Sequence[Digest], *, tolerance: float = DIGEST_TOLERANCE) -> bool:
    """Whether `digests` (from `state.params.parameter_digest`) are of the same parameters, up to the rounding
    one all-reduce leaves (`DIGEST_TOLERANCE`). Each part is compared at its own scale: the sum at the parameters'
    norm √s (rounding differences have random signs and add up like a random walk, as do the differences a missed
    step leaves, which are larger by orders of magnitude), the sum of squares at s, the position-weighted sum at √s
    times the count of tensors."""
    if len(digests) < 2:
        return True
    if len({len(d) for d in digests}) != 1 or len({d[:2] for d in digests}) != 1:
        return False
    tensors = digests[0][1]
    squares = max(d[3] for d in digests)
    norm = math.sqrt(squares)
    for part, scale in ((2, norm), (3, squares), (4, norm * tensors)):
        values = [d[part] for d in digests]
        if max(values) - min(values) > tolerance * max(scale, 1e-12):
            return False
    return True
