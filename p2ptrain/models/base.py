"""The one interface every model family implements for the runtime: a pipeline stage of the model.

The worker, the compute probe and the benchmarks go through it, and so does a family added later: build stage
layers [start, end) of K from a config and a seed, run it, name the parameters it shares with other stages, and
group parameters for the optimizer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from p2ptrain.models.configs import ModelConfig

FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch's AdamW has a fused kernel for every float dtype


class StageModel(nn.Module, ABC):
    """Layers [start, end) of a model. The first stage takes token ids (rows, seq) and owns the embeddings; the
    others take hidden states (rows, seq, hidden). The last stage owns the head and, given labels, returns the
    summed token loss: summed, not averaged, so that rows split over workers add up to the whole batch's gradient.
    Every peer that builds the same layers from the same seed gets the same weights.

    With `recompute` (activation checkpointing, `--recompute`), a forward that records gradients keeps only each
    block's input, and backward runs the block again: less memory per microbatch in flight, a third more compute."""

    recompute: bool = False

    def __init__(self, config: ModelConfig, *, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layers [{start}, {end}) are not a non-empty range of 0..{config.num_layers}")
        self.config, self.start, self.end = config, start, end
        self.is_first, self.is_last = start == 0, end == config.num_layers

    @abstractmethod
    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states; in the last stage the logits, or the summed token loss given labels."""

    def apply_block(self, block: nn.Module, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        """One block on `x` (the families' forward goes through here), checkpointed with `recompute`."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(block, x, *args, use_reentrant=False)
        return block(x, *args)

    def example_inputs(self, rows: int, seq_len: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Inputs of the shape and kind this stage takes, for probes and benchmarks."""
        if self.is_first:
            return torch.randint(0, self.config.vocab_size, (rows, seq_len), generator=generator)
        return torch.randn(rows, seq_len, self.config.hidden_size, generator=generator, requires_grad=True)

    def shared_parameters(self) -> dict[str, str]:
        """The parameters that other stages hold copies of (tied or shared weights), whose gradients must be
        combined across those stages: name here -> a key that names the one tensor in every stage; none by default."""
        return {}

    @abstractmethod
    def hf_names(self) -> dict[str, str]:
        """Each parameter's name in the family's `transformers` checkpoint (`p2ptrain.models.hf`); copies of one
        tensor (tied or shared weights) map to one name."""

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """As nanoGPT does: matrices and embeddings decay, gains and biases (fewer than 2 dimensions) do not."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def configure_optimizer(self, *, name: str = "adamw", lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW; bitsandbytes' 8-bit AdamW (blockwise-quantized moments: about a quarter of AdamW's state, for cards
        of little memory); or LAMB (bitsandbytes' 32-bit one: layer-wise trust ratios for large batches)."""
        if name == "adamw":
            # the fused kernel steps all tensors in one pass per group, about 4x faster on CPU than the loop over them
            fused = all(p.device.type in FUSED_ADAMW_DEVICES for p in self.parameters())
            return torch.optim.AdamW(self.optimizer_groups(weight_decay), lr=lr, fused=fused)
        # bitsandbytes loads slowly: only for runs that use it
        if name == "adamw8bit":
            from bitsandbytes.optim import AdamW8bit

            return AdamW8bit(self.optimizer_groups(weight_decay), lr=lr)
        if name == "lamb":
            from bitsandbytes.optim import LAMB

            return LAMB(self.optimizer_groups(weight_decay), lr=lr, optim_bits=32)
        raise ValueError(f"unknown optimizer {name!r}; choose adamw, adamw8bit or lamb")
