"""Model presets for the planner: per-layer training FLOPs, activation, parameter and memory bytes.

Every number is computed from a model config, never typed in. Assumptions (docs/design.md §3 symbols):

- ``f`` (FLOP per token per layer, forward + backward) = 3 x the forward FLOPs: 2 per weight of every matmul,
  plus attention scores and the weighted sum (2 x 2 x hidden x attended keys). Backward costs twice the forward.
  A causal model (Llama) attends on average to (seq + 1) / 2 keys, a bidirectional one (ALBERT) to all seq keys.
  Norms, rotary tables and softmax are a few per mille of the total and left out.
- ``t`` (activation bytes per token at a stage boundary) = hidden_size x bytes per element of the compute precision.
- ``P`` (bytes of one layer's parameters in an averaging round) = parameters x the bytes an averaged value takes on
  the wire in the run's averaging codec (`--averaging-codec`, `config.WIRE_BYTES`: fp32 4, fp16 2, int8 about 1.016,
  what `p2ptrain.client.averaging` sends); without one, the compute precision's own width (mixed fp16/bf16 runs
  average in half precision, fp32 runs in fp32, fp64 runs in fp64).
- ``M`` (device bytes one layer needs on a worker while training) = the parameter state that stays on the device
  plus the layer's checkpointed input for one row (one sequence, the smallest task a worker takes). Workers
  recompute the forward from the stored input (docs/design.md §2), so a layer keeps only its input between passes; the
  transient working set of the one layer being recomputed is a constant the linear model leaves out.
  What stays on the device depends on ``offload``:
    * ``"none"``: weights + gradients + Adam's two moments (+ an fp32 master copy in mixed precision):
      16 bytes per parameter for fp32 and mixed fp16/bf16, 32 for fp64.
    * ``"optimizer"`` (ZeRO-Offload): gradients, master weights and Adam live in host memory; the device keeps
      only the weights in compute precision.
    * ``"all"`` (ZeRO-Offload of optimizer and parameters, DeepSpeed's ``offload_param``): weights are streamed
      from host memory layer by layer, so only the checkpointed activations stay per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.config import AVERAGING_CODECS, WIRE_BYTES
from p2ptrain.models.configs import MODEL_CONFIGS, ModelConfig

PRECISIONS: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "all")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the cost model needs to know about a model (docs/design.md §3: L, f, t, P, M)."""

    layers: int
    flops_per_token_per_layer: float
    activation_bytes_per_token: float
    param_bytes_per_layer: float
    memory_bytes_per_layer: float
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        for field in ("flops_per_token_per_layer", "activation_bytes_per_token", "param_bytes_per_layer",
                      "memory_bytes_per_layer"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")

    def to_json(self) -> dict[str, float | int | str]:
        return {"name": self.name, "layers": self.layers, "flops_per_token_per_layer": self.flops_per_token_per_layer,
                "activation_bytes_per_token": self.activation_bytes_per_token,
                "param_bytes_per_layer": self.param_bytes_per_layer,
                "memory_bytes_per_layer": self.memory_bytes_per_layer}


def _state_bytes_per_param(precision: str, offload: str) -> int:
    width = PRECISIONS[precision]
    if offload == "all":
        return 0
    if offload == "optimizer":
        return width
    # weights + grads + Adam m, v; mixed precision adds an fp32 master copy and keeps the moments in fp32
    return 16 if width == 2 else 4 * width


def _check(precision: str, offload: str, averaging_codec: str | None) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; use one of {', '.join(OFFLOADS)}")
    if averaging_codec is not None and averaging_codec not in AVERAGING_CODECS:
        raise ValueError(f"unknown averaging codec {averaging_codec!r}; use one of {', '.join(AVERAGING_CODECS)}")


def averaged_bytes(precision: str, averaging_codec: str | None) -> float:
    """Bytes one parameter takes in an averaging round (``P`` per parameter, module doc)."""
    if averaging_codec is None:
        return float(PRECISIONS[precision])
    return WIRE_BYTES[AVERAGING_CODECS[averaging_codec]]


def _spec(*, name: str, layers: int, params: int, hidden: int, seq: int, attended: float, precision: str,
          offload: str, averaging_codec: str | None) -> ModelSpec:
    width = PRECISIONS[precision]
    forward = 2.0 * params + 4.0 * hidden * attended
    return ModelSpec(
        name=name, layers=layers, flops_per_token_per_layer=3.0 * forward,
        activation_bytes_per_token=float(hidden * width),
        param_bytes_per_layer=params * averaged_bytes(precision, averaging_codec),
        memory_bytes_per_layer=float(params * _state_bytes_per_param(precision, offload) + hidden * seq * width),
    )


def config_spec(config: ModelConfig, *, precision: str = "fp32", offload: str = "none",
                averaging_codec: str | None = None, name: str | None = None) -> ModelSpec:
    """The cost model's view of a model config. A causal model (Llama) attends on average to (seq + 1) / 2 keys,
    a bidirectional one (ALBERT) to all seq keys.

    ALBERT shares one block across all layers; the plan treats every layer as holding its own copy. A pipeline
    cannot share one tensor between devices of different stages: each stage keeps a copy of the block and the
    copies must be averaged, so P is the whole block's bytes per layer (what an untied ALBERT, i.e. a BERT-xxlarge,
    would exchange) and M counts the block's state once per layer. Both overstate a stage that applies the block
    several times (it needs one copy, not L_k), so ALBERT plans are conservative on memory and averaging; FLOPs and
    activations are exact.
    """
    _check(precision, offload, averaging_codec)
    seq = config.max_seq_len
    return _spec(name=name or config.family, layers=config.num_layers, params=config.layer_parameters(),
                 hidden=config.hidden_size, seq=seq, attended=(seq + 1) / 2 if config.causal else float(seq),
                 precision=precision, offload=offload, averaging_codec=averaging_codec)


PRESETS: tuple[str, ...] = tuple(MODEL_CONFIGS)


def model_spec(name: str, *, precision: str = "fp32", offload: str = "none",
               averaging_codec: str | None = None) -> ModelSpec:
    """The preset ``name`` (one of ``PRESETS``) at the given precision, offload mode and averaging codec."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    return config_spec(MODEL_CONFIGS[name], precision=precision, offload=offload, averaging_codec=averaging_codec,
                       name=name)
