"""`StageParams`, the one holder of a stage's state: holders built from one recipe step alike, a snapshot is of one
step and stays so, and an encoded state loads into another holder bit for bit."""
from __future__ import annotations

import asyncio

import torch

from p2ptrain.config import RunConfig
from p2ptrain.models import build_stage
from p2ptrain.state.params import StageParams

CONFIG = RunConfig(model="llama-tiny", num_stages=2, rows_per_microbatch=2, microbatches=2, seq_len=16, lr=1e-2)


def holder() -> StageParams:
    start, end = CONFIG.stage_layers(0)
    return StageParams(model=build_stage(CONFIG.model_config, start=start, end=end, seed=CONFIG.seed), config=CONFIG)


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


def test_an_encoded_state_loads_into_another_holder_bit_for_bit():
    async def main() -> None:
        a, b = holder(), holder()
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
