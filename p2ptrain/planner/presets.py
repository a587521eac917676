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
  The parameter state is what a p2ptrain worker allocates (`client.worker`, `state.params`; tests/test_precision.py
  checks it against the runtime's tensors), per parameter tensor of n values, and what stays on the device depends
  on ``offload``:
    * ``"none"``: the weights it computes with, in the compute precision (`--precision`), the gradients it
      accumulates over the epoch, its master copy (both at least fp32), and the optimizer's state (`--optimizer`):
      AdamW's two fp32 moments and its step, LAMB's (bitsandbytes) two moments and an update norm, or
      bitsandbytes' 8-bit AdamW: one byte per moment and value plus an fp32 absmax per block of 256, for a tensor
      of 4096 values or more (smaller ones keep fp32 moments; its two quantization maps, 2 KiB, are shared by all
      tensors and left out). fp32 AdamW: 20 bytes per parameter; bf16 AdamW: 18; bf16 8-bit AdamW: about 12.
    * ``"optimizer"`` (ZeRO-Offload, `--offload-optimizer`): gradients, master weights and optimizer state live in
      host memory; the device keeps only the weights in compute precision.
    * ``"all"`` (ZeRO-Offload of optimizer and parameters, DeepSpeed's ``offload_param``; planning only): weights
      are streamed from host memory layer by layer, so only the checkpointed activations stay per layer.

Shared tensors (``ModelSpec.shared``, docs/design.md §3): parameters several layers apply, whose copies every stage
applying one of those layers holds once and the stages keep equal by a round across them. ALBERT's block groups are
such (a group's layers own nothing else, so their ``P`` is 0 and their ``M`` only the checkpointed input), and so
are embeddings tied to the output layer, which the first and the last stage hold. Untied embeddings are left out, as
the contract leaves them out.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.config import AVERAGING_CODECS, OPTIMIZERS, WIRE_BYTES, RunConfig
from p2ptrain.models.configs import MODEL_CONFIGS, AlbertConfig, ModelConfig

PRECISIONS: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
# bitsandbytes' 8-bit optimizers (0.45 and later, CPU and CUDA alike): tensors below min_8bit_size keep fp32 state;
# the others one byte per value and moment and an fp32 absmax per block of values
EIGHT_BIT_MIN_SIZE, EIGHT_BIT_BLOCK = 4096, 256
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "all")


@dataclass(frozen=True, kw_only=True)
class SharedTensors:
    """Parameters that the layers ``layers`` apply: every stage holding one of them keeps one copy, of
    ``param_bytes`` in an averaging round (the ``P`` of the copy) and ``memory_bytes`` on a worker (its ``M``)."""

    name: str
    layers: tuple[int, ...]
    param_bytes: float
    memory_bytes: float

    def __post_init__(self) -> None:
        if not self.layers or min(self.layers) < 0 or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"shared tensors {self.name!r} need distinct layer indices >= 0 in order, got {self.layers}")
        if self.param_bytes < 0 or self.memory_bytes < 0:
            raise ValueError(f"shared tensors {self.name!r} need bytes >= 0")

    def held_by(self, start: int, end: int) -> bool:
        """Whether a stage of layers [start, end) holds a copy."""
        first = bisect.bisect_left(self.layers, start)
        return first < len(self.layers) and self.layers[first] < end

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "layers": list(self.layers), "param_bytes": self.param_bytes,
                "memory_bytes": self.memory_bytes}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the cost model needs to know about a model (docs/design.md §3: L, f, t, P, M)."""

    layers: int
    flops_per_token_per_layer: float
    activation_bytes_per_token: float
    param_bytes_per_layer: float
    memory_bytes_per_layer: float
    name: str = "custom"
    shared: tuple[SharedTensors, ...] = ()

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        for field in ("flops_per_token_per_layer", "activation_bytes_per_token", "memory_bytes_per_layer"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.param_bytes_per_layer < 0 or (self.param_bytes_per_layer == 0 and not self.shared):
            raise ValueError(f"param_bytes_per_layer must be > 0 (or 0 for layers whose parameters are all shared), "
                             f"got {self.param_bytes_per_layer}")
        for tensors in self.shared:
            if max(tensors.layers) >= self.layers:
                raise ValueError(f"shared tensors {tensors.name!r} name layer {max(tensors.layers)}, "
                                 f"the model has {self.layers}")

    def held(self, start: int, end: int) -> tuple[float, float]:
        """(averaged bytes, memory bytes) of the shared tensors a stage of layers [start, end) holds."""
        held = [t for t in self.shared if t.held_by(start, end)]
        return sum(t.param_bytes for t in held), sum(t.memory_bytes for t in held)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "layers": self.layers, "flops_per_token_per_layer": self.flops_per_token_per_layer,
                "activation_bytes_per_token": self.activation_bytes_per_token,
                "param_bytes_per_layer": self.param_bytes_per_layer,
                "memory_bytes_per_layer": self.memory_bytes_per_layer,
                **({"shared": [t.to_json() for t in self.shared]} if self.shared else {})}


def optimizer_state_bytes(numel: int, optimizer: str, *, width: int = 4) -> float:
    """Bytes of the optimizer's state for a parameter tensor of ``numel`` values (module doc); ``width``: the bytes
    of a full-precision value (4, 8 for fp64 planning)."""
    if optimizer == "adamw8bit":
        if numel >= EIGHT_BIT_MIN_SIZE:
            return 2.0 * numel + 2 * 4 * math.ceil(numel / EIGHT_BIT_BLOCK)
        return 2.0 * width * numel
    return 2.0 * width * numel + 4  # AdamW's step, LAMB's update norm: one fp32 value each


def state_bytes(tensors: Sequence[int], *, precision: str = "fp32", optimizer: str = "adamw",
                offload: str = "none") -> float:
    """Device bytes of parameter tensors of these sizes on a worker that trains them (module doc)."""
    if offload == "all":
        return 0.0
    width, count = PRECISIONS[precision], sum(tensors)
    if offload == "optimizer":
        return float(width * count)
    full = max(width, 4)  # master copy, accumulated gradients and moments are at least fp32
    return width * count + 2.0 * full * count + sum(optimizer_state_bytes(n, optimizer, width=full) for n in tensors)


def _check(precision: str, offload: str, averaging_codec: str | None, optimizer: str = "adamw") -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; use one of {', '.join(OFFLOADS)}")
    if averaging_codec is not None and averaging_codec not in AVERAGING_CODECS:
        raise ValueError(f"unknown averaging codec {averaging_codec!r}; use one of {', '.join(AVERAGING_CODECS)}")


def averaged_bytes(precision: str, averaging_codec: str | None) -> float:
    """Bytes one parameter takes in an averaging round (``P`` per parameter, module doc)."""
    if averaging_codec is None:
        return float(PRECISIONS[precision])
    return WIRE_BYTES[AVERAGING_CODECS[averaging_codec]]


def shared_tensors(config: ModelConfig, *, precision: str = "fp32", optimizer: str = "adamw", offload: str = "none",
                   averaging_codec: str | None = None) -> tuple[SharedTensors, ...]:
    """The tensors of ``config`` that several layers apply (module doc), by the layers whose stages hold them."""
    wire = averaged_bytes(precision, averaging_codec)
    out = []
    if isinstance(config, AlbertConfig):
        block = config.layer_tensors()
        memory = state_bytes(block, precision=precision, optimizer=optimizer, offload=offload)
        for group in range(config.num_groups):
            layers = tuple(i for i in range(config.num_layers) if config.group_of(i) == group)
            out.append(SharedTensors(name=f"group {group}", layers=layers, param_bytes=sum(block) * wire,
                                     memory_bytes=memory))
    tied = config.tied_parameters()
    if tied:
        out.append(SharedTensors(name="tied embeddings", layers=tuple(sorted({0, config.num_layers - 1})),
                                 param_bytes=tied * wire,
                                 memory_bytes=state_bytes((tied,), precision=precision, optimizer=optimizer,
                                                          offload=offload)))
    return tuple(out)


def config_spec(config: ModelConfig, *, precision: str = "fp32", optimizer: str = "adamw", offload: str = "none",
                averaging_codec: str | None = None, name: str | None = None) -> ModelSpec:
    """The cost model's view of a model config. A causal model (Llama) attends on average to (seq + 1) / 2 keys,
    a bidirectional one (ALBERT) to all seq keys.

    ALBERT's layers own no parameters: they apply their group's block, which a stage holds once however many of
    its layers apply it (``shared``), so ``P`` is 0 and ``M`` the checkpointed input alone; the FLOPs are every
    layer's.
    """
    _check(precision, offload, averaging_codec, optimizer)
    seq, hidden, width = config.max_seq_len, config.hidden_size, PRECISIONS[precision]
    attended = (seq + 1) / 2 if config.causal else float(seq)
    own = () if isinstance(config, AlbertConfig) else config.layer_tensors()
    forward = 2.0 * config.layer_parameters() + 4.0 * hidden * attended
    return ModelSpec(
        name=name or config.family, layers=config.num_layers, flops_per_token_per_layer=3.0 * forward,
        activation_bytes_per_token=float(hidden * width),
        param_bytes_per_layer=sum(own) * averaged_bytes(precision, averaging_codec),
        memory_bytes_per_layer=state_bytes(own, precision=precision, optimizer=optimizer, offload=offload)
        + hidden * seq * width,
        shared=shared_tensors(config, precision=precision, optimizer=optimizer, offload=offload,
                              averaging_codec=averaging_codec))


def run_spec(config: RunConfig) -> ModelSpec:
    """The cost model's view of a run: its model at its precision, optimizer, offload and averaging codec, what its
    workers allocate and send."""
    return config_spec(config.model_config, precision=config.precision, optimizer=config.optimizer,
                       offload="optimizer" if config.offload_optimizer else "none",
                       averaging_codec=config.averaging_codec, name=config.model)


PRESETS: tuple[str, ...] = tuple(MODEL_CONFIGS)


def model_spec(name: str, *, precision: str = "fp32", optimizer: str = "adamw", offload: str = "none",
               averaging_codec: str | None = None) -> ModelSpec:
    """The preset ``name`` (one of ``PRESETS``) at the given precision, optimizer, offload mode and averaging
    codec."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    return config_spec(MODEL_CONFIGS[name], precision=precision, optimizer=optimizer, offload=offload,
                       averaging_codec=averaging_codec, name=name)
