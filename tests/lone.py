"""A Worker alone: no p2p daemon, no servers, a group of one, so it steps on its own gradients. Unit tests of the
step, the look-ahead, the clipping and the checkpoints build one here."""
from __future__ import annotations

import asyncio

import torch

from p2ptrain.client.averaging import StageAllReduce
from p2ptrain.client.worker import Worker
from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.models import build_stage
from p2ptrain.protocol.messages import GroupMember
from p2ptrain.transport import Caller


def lone_worker(config: RunConfig, *, stage: int = 0, settings: RuntimeConfig | None = None,
                **options: object) -> Worker:
    """A worker of `stage` with the seed's parameters; `options`: more of Worker's keywords."""
    start, end = config.stage_layers(stage)
    caller = Caller(p2p=None, peer_id="w", codec="none", timeout=1.0)
    return Worker(worker_id="w", stage=stage, config=config, settings=settings or RuntimeConfig(), caller=caller,
                  model=build_stage(config.model_config, start=start, end=end, seed=config.seed),
                  averager=StageAllReduce(p2p=None, run_id=config.run_id, stage=stage, timeout=1.0, caller=caller),
                  servers=lambda: ([], []), compute=1.0, **options)


def give_gradients(worker: Worker, *, seed: int, scale: float = 1.0) -> None:
    """Accumulated gradients of one microbatch's rows, normal with `scale`, as if it had computed them."""
    generator = torch.Generator().manual_seed(seed)
    for accumulated in worker.accumulated:
        accumulated.copy_(scale * torch.randn(accumulated.shape, generator=generator))
    worker.rows_accumulated = worker.config.rows_per_microbatch


async def step_alone(worker: Worker) -> None:
    """The epoch boundary with the worker as its whole group: it averages alone and starts its step (in the
    background, with DPU: `worker.settle()` waits for it)."""
    await worker._step((GroupMember(peer_id=worker.worker_id, client_mode=False),))


def stepped_alone(worker: Worker) -> Worker:
    """The worker after one whole step on its gradients."""
    async def step() -> None:
        await step_alone(worker)
        await worker.settle()

    asyncio.run(step())
    return worker
