"""`StageParams`, the one holder of a stage's state: holders built from one recipe step alike, a snapshot is of one
step and stays so, and an encoded state loads into another holder bit for bit."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from p2ptrain.config import RunConfig
from p2ptrain.models import build_stage
from p2ptrain.state.codec import StateMismatch
from p2ptrain.state.params import StageParams

CONFIG = RunConfig(model="llama-tiny", num_stages=2, rows_per_microbatch=2, microbatches=2, seq_len=16, lr=1e-2)


def holder(config: RunConfig = CONFIG) -> StageParams:
    start, end = config.stage_layers(0)
    return StageParams(model=build_stage(config.model_config, start=start, end=end, seed=config.seed), config=config)


def grads(params: StageParams, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in params.trainable]


def test_holders_of_one_recipe_step_alike_and_a_snapshot_keeps_its_step():
    a, b = holder(), holder()
    assert a.holds_seed and a.digest() == b.digest()
    lr = a.step(grads(a, 1), epoch=0)
    assert lr == a.schedule.at(0) and a.epoch == 1 and not a.holds_seed
    assert a.digest() != b.digest()
    b.step(grads(b, 1), epoch=0)
    assert a.digest() == b.digest()

    epoch, model_state, optimizer_state = a.snapshot()
    kept = {name: tensor.clone() for name, tensor in model_state.items()}
    moments = optimizer_state["state"][0]["exp_avg"].clone()
    a.step(grads(a, 2), epoch=1)
    assert epoch == 1 and a.epoch == 2
    assert all(torch.equal(model_state[name], kept[name]) for name in kept)
    assert torch.equal(optimizer_state["state"][0]["exp_avg"], moments)
    assert any(not torch.equal(kept[name], value) for name, value in a.module.state_dict().items())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "lamb"])
def test_an_encoded_state_loads_into_another_holder_bit_for_bit(optimizer: str):
    """For every optimizer, its state too: bitsandbytes' 8-bit AdamW keeps uint8 moments, their absmax and maps,
    which a holder of another optimizer refuses."""
    config = dataclasses.replace(CONFIG, optimizer=optimizer)

    async def main() -> None:
        a, b = holder(config), holder(config)
        for epoch in range(2):
            a.step(grads(a, epoch), epoch=epoch)
        epoch, blob = await a.encoded()
        model_state, optimizer_state = b.decode(blob)
        b.load(model_state=model_state, optimizer_state=optimizer_state, epoch=epoch)
        assert b.epoch == 2 and b.loaded and not b.holds_seed
        for (name, x), y in zip(a.module.state_dict().items(), b.module.state_dict().values()):
            assert torch.equal(x, y), name
        a.step(grads(a, 5), epoch=2)
        b.step(grads(b, 5), epoch=2)  # the optimizer state came too: the next step agrees as well
        assert a.digest() == b.digest()
        other = holder(dataclasses.replace(CONFIG, optimizer="adamw" if optimizer == "adamw8bit" else "adamw8bit"))
        with pytest.raises(StateMismatch):
            other.decode((await a.encoded())[1])

    asyncio.run(main())


def test_adamw_steps_fused_and_a_state_stepped_unfused_loads_and_steps_fused():
    """How a holder's AdamW steps (fused on CPU and CUDA) is its own: a state from a holder that stepped with the
    per-tensor loop (an older checkpoint, a device without the fused kernel) loads as the same state, the loader keeps
    stepping fused, and both ways take the same step up to float rounding."""
    async def main() -> None:
        fused, looped = holder(), holder()
        assert all(group["fused"] for group in fused.optimizer.param_groups)
        for group in looped.optimizer.param_groups:
            group["fused"] = None
        for epoch in range(2):
            fused.step(grads(fused, epoch), epoch=epoch)
            looped.step(grads(looped, epoch), epoch=epoch)
        for x, y in zip(fused.trainable, looped.trainable):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        epoch, blob = await looped.encoded()
        loader = holder()
        model_state, optimizer_state = loader.decode(blob)
        loader.load(model_state=model_state, optimizer_state=optimizer_state, epoch=epoch)
        assert all(group["fused"] for group in loader.optimizer.param_groups)
        loader.step(grads(loader, 7), epoch=epoch)
        looped.step(grads(looped, 7), epoch=epoch)
        for x, y in zip(loader.trainable, looped.trainable):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)

    asyncio.run(main())


def test_reached_waits_for_a_step_in_flight_and_no_longer_than_told():
    async def main() -> None:
        params = holder()
        assert not await params.reached(1, timeout=0.05)
        waiting = asyncio.create_task(params.reached(1, timeout=5.0))
        await asyncio.sleep(0.01)
        params.step(grads(params, 0), epoch=0)
        assert await waiting
        assert await params.reached(0, timeout=0.0)

    asyncio.run(main())


DILOCO = dataclasses.replace(CONFIG, average_every=4, dpu=False, outer_lr=0.7, outer_momentum=0.9)


def test_an_outer_step_moves_every_holders_anchor_alike_as_torchs_nesterov_sgd_and_puts_the_parameters_there():
    """DiLoCo (`--average-every` > 1): holders step apart on their own gradients; the outer step on their averaged
    pseudo-gradients is SGD's with Nesterov momentum, leaves every holder at the same anchor, and the digest (of the
    anchor) agrees between rounds even while the parameters differ."""
    a, b = holder(DILOCO), holder(DILOCO)
    reference = [p.detach().clone().requires_grad_(True) for p in a.trainable]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(2):
        for epoch in range(4 * round_, 4 * round_ + 4):
            a.step(grads(a, epoch), epoch=epoch)
            b.step(grads(b, 100 + epoch), epoch=epoch)
        assert a.digest() == b.digest()  # of the anchor: the parameters moved apart
        assert any(not torch.equal(x, y) for x, y in zip(a.trainable, b.trainable))
        averaged = [(x + 3 * y) / 4 for x, y in zip(a.pseudo_gradient(), b.pseudo_gradient())]  # 1 : 3 rows
        for param, grad in zip(reference, averaged):
            param.grad = grad.clone()
        sgd.step()
        before = a.digest()
        a.outer_step([g.clone() for g in averaged])
        b.outer_step([g.clone() for g in averaged])
        assert a.digest() == b.digest() != before
        for x, y, expected, anchor in zip(a.trainable, b.trainable, reference, a.outer.anchor):
            assert torch.equal(x, y) and torch.equal(x, anchor)
            assert torch.allclose(x, expected.detach(), rtol=0, atol=1e-6)


def test_an_encoded_state_carries_the_anchor_and_momentum_and_a_joiner_starts_its_interval_at_the_anchor():
    async def main() -> None:
        a, b = holder(DILOCO), holder(DILOCO)
        for epoch in range(4):
            a.step(grads(a, epoch), epoch=epoch)
        a.outer_step(a.pseudo_gradient())
        a.step(grads(a, 4), epoch=4)  # between rounds: its parameters stand apart from its anchor
        epoch, blob = await a.encoded()
        model_state, optimizer_state = b.decode(blob)
        b.load(model_state=model_state, optimizer_state=optimizer_state, epoch=epoch)
        assert b.epoch == 5 and b.digest() == a.digest()
        for mine, theirs in zip([*b.outer.anchor, *b.outer.momentum], [*a.outer.anchor, *a.outer.momentum]):
            assert torch.equal(mine, theirs)
        assert all(torch.equal(param, anchor) for param, anchor in zip(b.trainable, b.outer.anchor))
        assert not any(pg.any() for pg in b.pseudo_gradient())
        with pytest.raises(StateMismatch, match="outer.anchor_0"):  # a holder of a run that averages every epoch
            holder().decode(blob)

    asyncio.run(main())


def test_a_holder_with_no_rows_holds_its_epoch_without_a_step():
    a = holder(DILOCO)
    before = [p.detach().clone() for p in a.trainable]
    a.skip(0)
    assert a.epoch == 1 and all(torch.equal(x, y) for x, y in zip(before, a.trainable)) and not a.optimizer.state
    a.skip(0)  # once only
    assert a.epoch == 1


def same(a: object, b: object) -> bool:
    """Whether two optimizer states hold equal values (bitsandbytes nests its tensors in dicts)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "lamb"])
def test_a_look_ahead_gives_the_model_the_step_and_leaves_the_master_and_its_optimizer_as_they_were(optimizer: str):
    config = dataclasses.replace(CONFIG, optimizer=optimizer)
    for first in (True, False):  # before the optimizer has any state, and after
        a, b = holder(config), holder(config)
        if not first:
            a.step(grads(a, 0), epoch=0)
            b.step(grads(b, 0), epoch=0)
        epoch, model_state, optimizer_state = a.snapshot()
        into = build_stage(config.model_config, start=0, end=config.stage_layers(0)[1], seed=99)
        a.look_ahead(grads(a, 1), epoch=epoch, into=into)
        assert a.epoch == epoch and a.digest() == b.digest()
        assert same(a.snapshot()[2], optimizer_state)
        b.step(grads(b, 1), epoch=epoch)  # what the look-ahead gave `into`: the step itself
        assert all(torch.equal(mine, stepped) for mine, stepped in zip(into.parameters(), b.module.parameters()))
        a.step(grads(a, 1), epoch=epoch)  # and the master steps on from where it stood
        assert a.digest() == b.digest()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "lamb"])
def test_a_kept_look_ahead_is_adopted_as_the_very_step_and_only_on_the_same_gradients(optimizer: str):
    """With a worker's rows the stage's only ones, its look-ahead's step is the step in flight: adopted, the master
    holds what stepping again would give, parameters and optimizer state alike, and steps on from there alike."""
    config = dataclasses.replace(CONFIG, optimizer=optimizer)
    for start in (0, 1):  # before the optimizer has any state, and after
        a, b = holder(config), holder(config)
        for params in (a, b)[: 2 * start]:
            params.step(grads(params, 0), epoch=0)
        into = build_stage(config.model_config, start=0, end=config.stage_layers(0)[1], seed=99)
        ahead = a.look_ahead(grads(a, 1), epoch=start, into=into, keep=True)
        assert a.adopt(ahead, grads(a, 2), epoch=start) is None and a.epoch == start  # other gradients: not taken
        assert a.adopt(ahead, grads(a, 1), epoch=start + 1) is None and a.epoch == start  # another epoch: not taken
        assert a.digest() == b.digest()
        assert a.adopt(ahead, grads(a, 1), epoch=start) == b.step(grads(b, 1), epoch=start)
        assert a.epoch == b.epoch == start + 1 and a.digest() == b.digest() and same(a.snapshot()[2], b.snapshot()[2])
        a.step(grads(a, 3), epoch=start + 1)
        b.step(grads(b, 3), epoch=start + 1)
        assert a.digest() == b.digest() and same(a.snapshot()[2], b.snapshot()[2])
