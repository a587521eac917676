"""`StageParams`: a stage's trainable state, one piece of code wherever it is held.

A stage's state is its master copy of the stage's layers (the parameters its optimizer steps), the optimizer's state
and the learning-rate schedule, and the epoch they are current for: the one after their last step. Every worker
holds one beside the model it computes with, and so does every server that keeps the stage's state (every FS, and a
BS given `--keep-state`): its replica is a worker that takes no tasks (`client.worker`), so it averages and steps
exactly as the workers do. What goes in and out of a `StageParams` goes through it alone: a step on the stage's
averaged gradients, a snapshot taken in one piece, the state encoded for a stage mate or a checkpoint
(`state.codec`), a downloaded or saved state checked and loaded, and the digest that shows the stage's copies agree.

With fp16 (`--precision fp16`) the holder keeps the run's dynamic loss scale too (`LossScale`): the last stage
multiplies the loss by it before backward, every stage divides its tasks' gradients by it as it counts them, and it
moves by `protocol.optimization.LossScaleRule` on the swarm's decision of each epoch, which every holder of every
stage reads alike, so the holders' scales stay equal.

With `--average-every H` > 1 (DiLoCo) the holder also keeps the outer optimizer's state (`OuterState`): the anchor,
the stage's parameters as its last averaging round left them, alike on every holder, and the outer momentum. Between
rounds each worker steps its own parameters on its own gradients (inner steps); at a round the stage averages how
far each moved from the anchor (`pseudo_gradient`), and the outer step moves the anchor by that average with
Nesterov momentum and puts every holder's parameters there (`outer_step`). The digest is then of the anchor, which
the holders share between rounds too.

The optimizer steps synchronously in the event loop, and a snapshot is taken there too, with no await in between:
so a snapshot never holds half a step, and no lock is needed beside the loop itself.
"""
from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from p2ptrain.config import RunConfig
from p2ptrain.models.base import StageModel
from p2ptrain.protocol.optimization import Digest, LossScaleRule, LRSchedule
from p2ptrain.state.codec import OptimizerState, decode_state, encode_state


class OuterState(torch.nn.Module):
    """The anchor and the outer momentum of one stage (module doc), one pair of buffers per trainable parameter, in
    their order. A child of the master module (`StageParams`), so that its state dict, and thus the state codec,
    checkpoints and state downloads, carry them beside the parameters (`outer.anchor_<k>`, `outer.momentum_<k>`)."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        for k, param in enumerate(params):
            self.register_buffer(f"anchor_{k}", param.detach().clone())
            self.register_buffer(f"momentum_{k}", torch.zeros_like(param))
        self.count = len(params)

    @property
    def anchor(self) -> list[torch.Tensor]:
        return [getattr(self, f"anchor_{k}") for k in range(self.count)]

    @property
    def momentum(self) -> list[torch.Tensor]:
        return [getattr(self, f"momentum_{k}") for k in range(self.count)]


class LossScale(torch.nn.Module):
    """fp16's loss scale and the count of epochs in a row without overflow (module doc), as buffers of the master
    module (`loss_scale.scale`, `loss_scale.clean`), so that checkpoints and state downloads carry them."""

    def __init__(self, *, scale: float, rule: LossScaleRule):
        super().__init__()
        self.rule = rule
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float64))
        self.register_buffer("clean", torch.tensor(0, dtype=torch.int64))

    @property
    def value(self) -> float:
        return self.scale.item()

    def update(self, *, overflow: bool) -> None:
        """Move by the rule after an epoch that did (the step was skipped) or did not overflow."""
        scale, clean = self.rule.after(self.value, int(self.clean), overflow=overflow)
        self.scale.fill_(scale)
        self.clean.fill_(clean)


@dataclass(frozen=True)
class LookAhead:
    """A step `StageParams.look_ahead` took and kept: on `grads` of `epoch`, to `params` and optimizer `state` (per
    parameter)."""

    epoch: int
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    state: dict[torch.Tensor, dict[str, Any]]


class StageParams:
    """The master copy of one stage, its optimizer and schedule, and the epoch they are current for.

    Built from the model the holder computes with, before it is cast to the run's precision (an fp32 copy, on
    `device`: the model takes the master's parameters only at an epoch boundary, `copy_to`), configured by the run's
    recipe, so that every holder of the stage starts alike.
    """

    def __init__(self, *, model: StageModel, config: RunConfig, device: torch.device = torch.device("cpu")):
        self.module = copy.deepcopy(model).to(device=device, dtype=torch.float32)
        self.device = device
        self.optimizer = self.module.configure_optimizer(name=config.optimizer, lr=config.lr,
                                                         weight_decay=config.weight_decay)
        self.schedule = LRSchedule(lr=config.lr, warmup_epochs=config.warmup_epochs,
                                   decay_epochs=config.decay_epochs, min_lr=config.min_lr)
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.outer_lr, self.outer_momentum = config.outer_lr, config.outer_momentum
        self.outer: OuterState | None = None
        if config.average_every > 1:
            self.outer = self.module.outer = OuterState(self.trainable)
        self.loss_scale: LossScale | None = None
        if config.precision == "fp16":
            # on the host wherever the stage computes: every task reads it, and a CUDA scalar's read waits for the GPU
            self.loss_scale = self.module.loss_scale = LossScale(
                scale=config.loss_scale, rule=LossScaleRule(growth_epochs=config.loss_scale_growth))
        self.epoch = 0
        self.loaded = False  # it holds a mate's or a checkpoint's state, not the seed's, even before its first step
        self._moved = asyncio.Event()  # set, and replaced, whenever `epoch` changes (`reached`)

    @property
    def holds_seed(self) -> bool:
        """It holds only the seed's weights: it has neither stepped nor loaded a state since it was built."""
        return not (self.epoch or self.loaded)

    def step(self, grads: list[torch.Tensor], *, epoch: int) -> float:
        """Step on the stage's gradients of `epoch` (averaged, and scaled by any clipping), at the schedule's
        learning rate of that epoch, which it returns; the state is then current for `epoch + 1`."""
        lr = self._optimizer_step(grads, epoch=epoch)
        self._set_epoch(epoch + 1)
        return lr

    def look_ahead(self, grads: list[torch.Tensor], *, epoch: int, into: torch.nn.Module,
                   keep: bool = False) -> LookAhead | None:
        """Give `into` the parameters a step on `grads` of `epoch` would reach, and leave the master copy and its
        optimizer state as they were: whatever the optimizer, it steps, and its parameters and state are put back.
        Costs a copy of the parameters and of the optimizer state while it runs. With `keep`, also returns the step
        it took (one more copy of the parameters, held until then), which `adopt` takes in place of stepping again."""
        with torch.no_grad():
            params = [param.clone() for param in self.trainable]
            state = {param: {key: value.clone() if torch.is_tensor(value) else copy.copy(value)
                             for key, value in entries.items()}
                     for param, entries in self.optimizer.state.items()}
            self._optimizer_step(grads, epoch=epoch)
            self.copy_to(into)
            # the step changed the optimizer's entries in place: once the copies are back, those are the step's
            kept = LookAhead(epoch=epoch, grads=grads, params=[param.clone() for param in self.trainable],
                             state=dict(self.optimizer.state)) if keep else None
            for param, before in zip(self.trainable, params):
                param.copy_(before)
            for param in list(self.optimizer.state):
                if param in state:
                    self.optimizer.state[param] = state[param]
                else:  # the step made the state of a parameter that had none
                    del self.optimizer.state[param]
        return kept

    def adopt(self, ahead: LookAhead, grads: list[torch.Tensor], *, epoch: int) -> float | None:
        """Step on `grads` of `epoch` by taking the kept look-ahead's step, if it was taken on the very same gradients
        of the same epoch (then `step` would reach it bit for bit), and return the learning rate; None, and nothing
        changed, otherwise. It checks the gradients and the epoch; the caller guarantees that nothing loaded or
        stepped this state between the look-ahead and now."""
        if ahead.epoch != epoch or self.epoch != epoch or len(ahead.grads) != len(grads) or not all(
                torch.equal(a, b.to(a.device)) for a, b in zip(ahead.grads, grads)):
            return None
        with torch.no_grad():
            for param, stepped in zip(self.trainable, ahead.params):
                param.copy_(stepped)
        self.optimizer.state.clear()
        self.optimizer.state.update(ahead.state)
        lr = self._set_lr(epoch)
        self._set_epoch(epoch + 1)
        return lr

    def _optimizer_step(self, grads: list[torch.Tensor], *, epoch: int) -> float:
        for param, grad in zip(self.trainable, grads):
            param.grad = grad.to(param.device)
        lr = self._set_lr(epoch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def _set_lr(self, epoch: int) -> float:
        lr = self.schedule.at(epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """How far the parameters moved from the anchor since the last round, anchor − parameters: what the stage
        averages at a round (DiLoCo's outer gradient)."""
        with torch.no_grad():
            return [anchor - param for anchor, param in zip(self.outer.anchor, self.trainable)]

    def outer_step(self, averaged: list[torch.Tensor]) -> None:
        """Move the anchor by the stage's averaged pseudo-gradient, with SGD's Nesterov momentum (as
        `torch.optim.SGD(nesterov=True)`: momentum ← μ·momentum + g, anchor ← anchor − lr·(g + μ·momentum)), and
        put the parameters there; the inner optimizer's state stays the holder's."""
        mu = self.outer_momentum
        with torch.no_grad():
            for anchor, momentum, grad, param in zip(self.outer.anchor, self.outer.momentum, averaged,
                                                     self.trainable):
                grad = grad.to(param.device)
                momentum.mul_(mu).add_(grad)
                anchor.sub_(grad.add(momentum, alpha=mu), alpha=self.outer_lr)
                param.copy_(anchor)

    def skip(self, epoch: int) -> None:
        """No step on `epoch` here, so a state current for it is current for the next one too: `epoch` was abandoned
        (a stage restored from an older checkpoint than the swarm's, whose epochs in between are abandoned, serves its
        state to joiners at the swarm's epoch), or, between rounds of an outer optimizer, this holder had no rows of
        its own to step on (a server's replica)."""
        if self.epoch == epoch:
            self._set_epoch(epoch + 1)

    def load(self, *, model_state: dict[str, torch.Tensor], optimizer_state: OptimizerState, epoch: int) -> None:
        """Take a state current for `epoch`, already checked against this stage (`decode`)."""
        self.module.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)
        if self.outer is not None:  # a holder that joins between rounds starts from the anchor: its own rows alone
            with torch.no_grad():  # then make its pseudo-gradient, not a mate's too
                for param, anchor in zip(self.trainable, self.outer.anchor):
                    param.copy_(anchor)
        self.loaded = True
        self._set_epoch(epoch)

    def decode(self, blob: object) -> tuple[dict[str, torch.Tensor], OptimizerState]:
        """The model and optimizer state of an encoded blob, checked against this stage before anything is loaded;
        `state.codec.StateMismatch` names the first entry that does not fit."""
        return decode_state(blob, self.module, self.optimizer)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor], OptimizerState]:
        """The epoch, and host copies of the parameters and of the optimizer state, taken together with no await in
        between (module doc)."""
        model_state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.module.state_dict().items()}
        optimizer_state = self.optimizer.state_dict()
        optimizer_state["state"] = {index: _host_copy(entries) for index, entries in optimizer_state["state"].items()}
        return self.epoch, model_state, optimizer_state

    async def encoded(self) -> tuple[int, torch.Tensor]:
        """A snapshot's epoch and its blob (`state.codec`), encoded in a thread while the holder trains on."""
        epoch, model_state, optimizer_state = self.snapshot()
        return epoch, await asyncio.to_thread(encode_state, model_state, optimizer_state)

    def digest(self) -> Digest:
        """Of the parameters; with an outer optimizer, of the anchor, which the holders share between rounds."""
        return parameter_digest(self.outer.anchor if self.outer is not None else self.trainable)

    def copy_to(self, model: torch.nn.Module) -> None:
        """Give `model` (the one its holder computes with) the master's parameters."""
        with torch.no_grad():
            for param, master in zip(model.parameters(), self.module.parameters()):
                param.copy_(master)

    async def reached(self, epoch: int, *, timeout: float) -> bool:
        """Whether the state is current for `epoch` or later, waiting up to `timeout` for a step in flight to land."""
        deadline = time.monotonic() + timeout
        while self.epoch < epoch:
            try:
                await asyncio.wait_for(self._moved.wait(), deadline - time.monotonic())
            except TimeoutError:
                return False
        return True

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._moved.set()
        self._moved = asyncio.Event()


def _host_copy(entries: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state with every tensor copied to the host, one copy each (bitsandbytes' 8-bit state
    shares its quantization maps between parameters, in a nested map)."""
    return {name: _host_copy(value) if isinstance(value, dict)
            else value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
            for name, value in entries.items()}


def parameter_digest(params: list[torch.Tensor]) -> Digest:
    """A short digest of a stage's parameters, to compare across its holders (`protocol.optimization`)."""
    total, squares, weighted = 0.0, 0.0, 0.0
    with torch.no_grad():
        for position, param in enumerate(params, start=1):
            values = param.detach().double()
            part = values.sum().item()
            total, squares, weighted = total + part, squares + values.square().sum().item(), weighted + position * part
    return (float(sum(p.numel() for p in params)), float(len(params)), total, squares, weighted)

