"""Model configs and presets, torch-free: what the planner, the command lines and the runtime read about a model.

A config names its family; `p2ptrain.models.build_stage` turns it into a stage module of that family.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layers [start, end) of each of `num_stages` stages when the layers are split evenly, the first stages taking
    one more where they do not divide."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages (1..{num_layers})")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How rotary frequencies are stretched for contexts longer than pre-training's, as `transformers` names it:
    `linear` divides every frequency by `factor`; `llama3` (Llama 3.1) divides the low frequencies only, blending
    between `low_freq_factor` and `high_freq_factor` wavelengths of `original_max_seq_len`."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"rope scaling {self.kind!r} is not supported; use linear or llama3")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor {self.factor} must be positive")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor {self.high_freq_factor} above "
                             f"low_freq_factor {self.low_freq_factor}")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama decoder: RMSNorm, rotary embeddings (optionally scaled), SwiGLU, grouped- or multi-query attention,
    tied or untied embeddings. `head_dim` defaults to hidden_size / num_heads."""

    family: ClassVar[str] = "llama"
    causal: ClassVar[bool] = True

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")

    def layer_tensors(self) -> tuple[int, ...]:
        """The sizes of one decoder block's parameter tensors: q, k, v, o projections, the SwiGLU MLP and two RMSNorm
        gains (and the biases where the config has them)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        attention = (h * q, h * kv, h * kv, q * h, *((q, kv, kv, h) if self.attention_bias else ()))
        return (*attention, h * i, h * i, i * h, *((i, i, h) if self.mlp_bias else ()), h, h)

    def layer_parameters(self) -> int:
        return sum(self.layer_tensors())

    def tied_parameters(self) -> int:
        """Weights the output layer shares with the embeddings: the word matrix when tied, else none."""
        return self.vocab_size * self.hidden_size if self.tie_embeddings else 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """The config of a `transformers` LlamaConfig's dict (config.json), in the format of transformers 4.45 and
        later (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`); a ValueError names what is not supported."""
        _require(hf, "hidden_act", "silu", default="silu")
        _require(hf, "pretraining_tp", 1, default=1)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        _require(rope, "partial_rotary_factor", 1.0, default=1.0, where="rope scaling")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind in ("linear", "llama3"):
            scaling = RopeScaling(kind=kind, factor=float(rope["factor"]),
                                  low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                                  high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                                  original_max_seq_len=int(rope.get("original_max_position_embeddings",
                                                                    hf.get("max_position_embeddings", 8192))))
        else:
            raise ValueError(f"rope scaling of type {kind!r} is not supported; p2ptrain runs default, linear and "
                             "llama3 rotary embeddings")
        heads = int(hf["num_attention_heads"])
        return cls(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                   intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
                   num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                   head_dim=hf.get("head_dim"), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                   rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_scaling=scaling,
                   norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                   tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                   attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
                   init_std=float(hf.get("initializer_range", 0.02)))

    def to_hf(self) -> dict[str, Any]:
        """A config.json that `transformers` (4.45 and later) loads as this model's LlamaConfig."""
        scaling = None
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            scaling = {"rope_type": rs.kind, "factor": rs.factor}
            if rs.kind == "llama3":
                scaling |= {"low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
                            "original_max_position_embeddings": rs.original_max_seq_len}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "max_position_embeddings": self.max_seq_len, "rope_theta": self.rope_theta, "rope_scaling": scaling,
                "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_embeddings,
                "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias, "hidden_act": "silu",
                "initializer_range": self.init_std, "torch_dtype": "float32"}


@dataclass(frozen=True, kw_only=True)
class AlbertConfig:
    """ALBERT's encoder (Lan et al. 2019) with its masked-LM head: factorized embeddings (vocab_size x
    embedding_size, then a mapping up to hidden_size), and `num_groups` post-norm blocks whose parameters the
    layers share (layer i applies group i * num_groups // num_layers; one group in the paper). The defaults are
    ALBERT-xxlarge's. Trained without dropout."""

    family: ClassVar[str] = "albert"
    causal: ClassVar[bool] = False

    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_layers: int = 12
    num_heads: int = 64
    num_groups: int = 1
    max_seq_len: int = 512
    type_vocab_size: int = 2
    hidden_act: Literal["gelu", "gelu_new", "relu"] = "gelu_new"
    norm_eps: float = 1e-12
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if not 1 <= self.num_groups <= self.num_layers:
            raise ValueError(f"num_groups {self.num_groups} must be between 1 and num_layers {self.num_layers}")
        if self.hidden_act not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use gelu, gelu_new or relu")

    def group_of(self, layer: int) -> int:
        """The parameter group that layer `layer` applies (transformers' rule)."""
        return int(layer / (self.num_layers / self.num_groups))

    def layer_tensors(self) -> tuple[int, ...]:
        """The sizes of one encoder block's parameter tensors: q, k, v, o with biases, the GELU MLP with biases, two
        LayerNorms."""
        h, i = self.hidden_size, self.intermediate_size
        return (h * h, h) * 4 + (h * i, i, i * h, h) + (h,) * 4

    def layer_parameters(self) -> int:
        return sum(self.layer_tensors())

    def tied_parameters(self) -> int:
        """Weights the MLM decoder shares with the embeddings: the factorized word matrix when tied, else none."""
        return self.vocab_size * self.embedding_size if self.tie_embeddings else 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> AlbertConfig:
        """The config of a `transformers` AlbertConfig's dict (config.json); a ValueError names what is not
        supported."""
        _require(hf, "inner_group_num", 1, default=1)
        _require(hf, "position_embedding_type", "absolute", default="absolute")
        return cls(vocab_size=int(hf["vocab_size"]), embedding_size=int(hf["embedding_size"]),
                   hidden_size=int(hf["hidden_size"]), intermediate_size=int(hf["intermediate_size"]),
                   num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
                   num_groups=int(hf.get("num_hidden_groups", 1)),
                   max_seq_len=int(hf.get("max_position_embeddings", 512)),
                   type_vocab_size=int(hf.get("type_vocab_size", 2)), hidden_act=hf.get("hidden_act", "gelu_new"),
                   norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                   tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                   init_std=float(hf.get("initializer_range", 0.02)))

    def to_hf(self) -> dict[str, Any]:
        """A config.json that `transformers` loads as this model's AlbertConfig (for AlbertForMaskedLM)."""
        return {"architectures": ["AlbertForMaskedLM"], "model_type": "albert", "vocab_size": self.vocab_size,
                "embedding_size": self.embedding_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_hidden_groups": self.num_groups, "inner_group_num": 1,
                "max_position_embeddings": self.max_seq_len, "type_vocab_size": self.type_vocab_size,
                "hidden_act": self.hidden_act, "layer_norm_eps": self.norm_eps,
                "tie_word_embeddings": self.tie_embeddings, "initializer_range": self.init_std,
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "torch_dtype": "float32"}


ModelConfig = LlamaConfig | AlbertConfig

FAMILIES: dict[str, type[LlamaConfig] | type[AlbertConfig]] = {"llama": LlamaConfig, "albert": AlbertConfig}


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """A plain dict of the config (its family included) that `config_from_dict` turns back into it."""
    return {"family": config.family, **dataclasses.asdict(config)}


def config_from_dict(value: Mapping[str, Any]) -> ModelConfig:
    """The config of a `config_to_dict` dict; a ValueError says what does not fit."""
    fields = dict(value)
    family = fields.pop("family", None)
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is unknown; p2ptrain has {', '.join(FAMILIES)}")
    if isinstance(fields.get("rope_scaling"), Mapping):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    try:
        return FAMILIES[family](**fields)
    except TypeError as e:  # an unknown or missing field
        raise ValueError(f"not a {family} config: {e}") from None


def _require(hf: Mapping[str, Any], key: str, supported: Any, *, default: Any, where: str = "config") -> None:
    if (value := hf.get(key, default)) != supported:
        raise ValueError(f"{where}: {key} = {value!r} is not supported (only {supported!r})")

MODEL_CONFIGS: dict[str, ModelConfig] = {
    # trains in seconds on one CPU core; the tests and the main job use it
    "llama-tiny": LlamaConfig(),
    # big enough that one stage's microbatch costs tens of milliseconds on a CPU core (benchmarks)
    "llama-small": LlamaConfig(hidden_size=256, intermediate_size=688, num_layers=8, num_heads=8, num_kv_heads=4),
    "llama-33b": LlamaConfig(vocab_size=32000, hidden_size=6656, intermediate_size=17920, num_layers=60,
                             num_heads=52, num_kv_heads=52, max_seq_len=2048),
    # byte-level tokens and the mask token, id 256, that its masked-LM batches need
    "albert-tiny": AlbertConfig(vocab_size=257, embedding_size=32, hidden_size=64, intermediate_size=176,
                                num_layers=4, num_heads=4, max_seq_len=128),
    "albert-small": AlbertConfig(vocab_size=257, embedding_size=64, hidden_size=256, intermediate_size=1024,
                                 num_layers=8, num_heads=8, max_seq_len=256),
    "albert-xxlarge": AlbertConfig(),
}


def model_config(name: str) -> ModelConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_CONFIGS)}") from None
