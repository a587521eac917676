"""The rules of a step that every worker of every stage must apply alike, so that the swarm steps as one process:
the learning rate of a global epoch, the coefficient of clipping by the global gradient norm, fp16's dynamic loss
scale, the data source's book of each stage's gradient norm and overflow, and the parameter digest that shows a
stage's workers hold the same weights.
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


@dataclass(frozen=True, kw_only=True)
class LossScaleRule:
    """fp16's dynamic loss scale, as torch's GradScaler moves it: after an epoch whose gradients overflowed (inf or
    nan somewhere in the swarm) the scale is multiplied by `backoff`, and after `growth_epochs` epochs in a row
    without, by `growth`. Every holder of every stage applies it to the same decisions (the data source's,
    `NormBook`), so that the last stage scales the loss by the scale every stage divides by."""

    growth_epochs: int
    growth: float = 2.0
    backoff: float = 0.5

    def after(self, scale: float, clean: int, *, overflow: bool) -> tuple[float, int]:
        """The scale and the count of clean epochs in a row after an epoch, from those before it."""
        if overflow:
            return scale * self.backoff, 0
        if clean + 1 >= self.growth_epochs:
            return scale * self.growth, 0
        return scale, clean + 1


@dataclass(frozen=True)
class GlobalStep:
    """What every stage steps by for an epoch: the global gradient norm, and whether any stage overflowed (fp16:
    then every stage skips the step)."""

    norm: float
    overflow: bool = False


class NormBook:
    """The data source's record of each stage's squared gradient norm, and whether its gradients overflowed, per
    epoch: once every stage reported an epoch, its global norm and overflow are known. The first report of a (epoch,
    stage) counts: all workers of a stage hand in the norm of the same averaged gradient, up to rounding, and the same
    overflow, read from the same average (`client.averaging`), and all must clip by one global norm and skip alike.
    Only the newest `kept` epochs are held; a stage reports an epoch once it averaged it, never long after the
    others."""

    def __init__(self, *, num_stages: int, kept: int):
        self.num_stages, self.kept = num_stages, kept
        self._reports: dict[int, dict[int, tuple[float, bool]]] = {}

    def report(self, *, epoch: int, stage: int, squared_norm: float, overflow: bool = False) -> GlobalStep | None:
        """Record a stage's squared norm and overflow of an epoch; the epoch's global step once every stage
        reported, else None."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is not in 0..{self.num_stages - 1}")
        if not (math.isfinite(squared_norm) and squared_norm >= 0):
            raise ValueError(f"squared norm {squared_norm} is not a finite number of 0 or more")
        reports = self._reports.setdefault(epoch, {})
        reports.setdefault(stage, (squared_norm, overflow))
        for old in [e for e in self._reports if e <= max(self._reports) - self.kept]:
            del self._reports[old]
        return self.global_step(epoch)

    def global_step(self, epoch: int) -> GlobalStep | None:
        """The epoch's global norm and overflow if every stage reported it, else None."""
        reports = self._reports.get(epoch, {})
        if len(reports) < self.num_stages:
            return None
        return GlobalStep(norm=math.sqrt(sum(square for square, _ in reports.values())),
                          overflow=any(overflow for _, overflow in reports.values()))


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
