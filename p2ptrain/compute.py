"""How fast this process trains: FLOP/s of forward + backward, measured on the model it will run."""
from __future__ import annotations

import time

import torch

from p2ptrain.config import RunConfig
from p2ptrain.models.llama import LlamaStage


def measure_compute(model: LlamaStage, config: RunConfig) -> float:
    """FLOP/s of this process on its stage: time one forward+backward of a microbatch-sized slice."""
    rows = max(1, min(config.rows_per_microbatch, 4))
    if model.is_first:
        inputs = torch.randint(0, config.llama.vocab_size, (rows, config.seq_len))
    else:
        inputs = torch.randn(rows, config.seq_len, config.llama.hidden_size, requires_grad=True)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    output = model(inputs)
    output.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return 6.0 * params * rows * config.seq_len / max(time.perf_counter() - started, 1e-6)


def measure_block_compute(config: RunConfig, *, repeats: int = 3) -> float:
    """FLOP/s on one decoder block of the recipe's model, before the peer knows its stage (live planning).

    A middle block carries neither the embeddings nor the head, so the figure is per-layer throughput, the
    quantity the planner's cost model divides by. The best of a few runs: the first pays one-time allocations.
    """
    start = min(1, config.llama.num_layers - 1)
    block = LlamaStage(config.llama, start=start, end=start + 1, seed=config.seed)
    return max(measure_compute(block, config) for _ in range(repeats))
