"""Model configs and presets, torch-free: what the planner, the command lines and the runtime read about a model.

A config names its family; `p2ptrain.models.build_stage` turns it into a stage module of that family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""

    family: ClassVar[str] = "llama"
    causal: ClassVar[bool] = True

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_parameters(self) -> int:
        """Weights of one decoder block: q, k, v, o projections, the SwiGLU MLP and two RMSNorm gains."""
        kv = self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv
        return attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class AlbertConfig:
    """ALBERT's encoder (Lan et al. 2019); all layers share one set of parameters."""

    family: ClassVar[str] = "albert"
    causal: ClassVar[bool] = False

    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_layers: int = 12
    num_heads: int = 64
    max_seq_len: int = 512

    def layer_parameters(self) -> int:
        """Weights of one encoder block: q, k, v, o with biases, the GELU MLP with biases, two LayerNorms."""
        h, i = self.hidden_size, self.intermediate_size
        return 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h


ModelConfig = LlamaConfig | AlbertConfig

MODEL_CONFIGS: dict[str, ModelConfig] = {
    # trains in seconds on one CPU core; the tests and the main job use it
    "llama-tiny": LlamaConfig(),
    # big enough that one stage's microbatch costs tens of milliseconds on a CPU core (benchmarks)
    "llama-small": LlamaConfig(hidden_size=256, intermediate_size=688, num_layers=8, num_heads=8, num_kv_heads=4),
    "llama-33b": LlamaConfig(vocab_size=32000, hidden_size=6656, intermediate_size=17920, num_layers=60,
                             num_heads=52, num_kv_heads=52, max_seq_len=2048),
    "albert-xxlarge": AlbertConfig(),
}


def model_config(name: str) -> ModelConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_CONFIGS)}") from None
