"""The run's recipe as every peer sees it: model, stages, batch, data, optimizer. All peers of a run get the same."""
from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.models.llama import LLAMA_CONFIGS, LlamaConfig


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    model: str
    num_stages: int
    rows_per_microbatch: int
    microbatches: int
    seq_len: int
    seed: int = 0
    lr: float = 3e-3
    compression: str = "none"

    def __post_init__(self) -> None:
        if self.model not in LLAMA_CONFIGS:
            raise ValueError(f"unknown model {self.model!r}: choose one of {', '.join(LLAMA_CONFIGS)}")
        if not 1 <= self.num_stages <= self.llama.num_layers:
            raise ValueError(f"--num-stages must be between 1 and the model's {self.llama.num_layers} layers")
        if self.seq_len > self.llama.max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the model's max_seq_len {self.llama.max_seq_len}")

    @property
    def llama(self) -> LlamaConfig:
        return LLAMA_CONFIGS[self.model]

    @property
    def rows_per_epoch(self) -> int:
        return self.rows_per_microbatch * self.microbatches

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Layers [start, end) of a stage when the layers are split evenly (a plan may set them instead)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is not in 0..{self.num_stages - 1}")
        base, extra = divmod(self.llama.num_layers, self.num_stages)
        start = stage * base + min(stage, extra)
        return start, start + base + (1 if stage < extra else 0)
