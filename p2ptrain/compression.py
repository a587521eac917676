"""Codecs for the activations and gradients that travel over hivemind streaming RPCs.

`serialize` turns one tensor into a list of `runtime_pb2.Tensor` messages ready to stream (the first carries
dtype, shape, codec and chunk count, the rest only bytes, as hivemind's `split_for_streaming` does);
`deserialize` turns them back without being told the codec. Codecs:

- "none": raw bytes, exact for every dtype (token ids, labels, the no-compression reference runs).
- "fp16": hivemind's FLOAT16 codec, half the bytes, ~1e-3 relative error.
- "int8": bitsandbytes blockwise dynamic 8-bit quantization on the CPU, about a quarter of the bytes.
  hivemind's own 8-bit codecs cannot decode under numpy >= 2.4 (docs/design.md §7), so the message is ours:
  compression=BLOCKWISE_8BIT, dtype/size of the original tensor, buffer = float32 absmax of every block
  followed by one uint8 code per element. The 256-entry code map is not sent: both sides rebuild it with
  `create_dynamic_map()`. Error bound: see `int8_error_bound`. bitsandbytes is imported on the first int8
  tensor only: it takes seconds to import, and peers that do not use int8 need none of it.

Integer and bool tensors are always sent uncompressed, whatever the codec. The averaging codec (`WireCodec`) sends a
tensor of zeros as its shape alone, a message without a buffer (`encode_zeros`): what a server that only keeps its
stage's replica hands in to an average (`client.averaging`).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from types import ModuleType

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2ptrain.config import CODECS, INT8_BLOCKSIZE, WIRE_BYTES

# One message per MiB: far below the 4 MiB per-message limit of hivemind's P2P (docs/design.md §7), and few enough
# messages that per-message overhead does not matter for activation-sized tensors.
CHUNK_BYTES = 2**20

# The most values a message of zeros may stand for: as many as hivemind's P2P carries in its largest message (4 MiB)
# at int8's byte per value. A bound, so that a peer's message cannot make its receiver allocate without limit.
MAX_ZEROS = 2**22

# INT8_BLOCKSIZE: bitsandbytes supports blocks of 64..4096 values. Measured on (8, 128, 256) activations with outlier
# channels and on Student-t(2) samples: 256 gives ~30% less relative error than 4096 for 1.5% more bytes
# (0.254x vs 0.250x of fp32); 64 gains little more and costs 6% more bytes.


class _KernelsNotice(logging.Filter):
    """bitsandbytes warns on import, on every CPU with AVX512-BF16, that an optional Hub kernel package for 4-bit
    matmuls is missing; p2ptrain uses only its 8-bit blockwise quantization, which needs no such kernel."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


@cache
def _bnb() -> ModuleType:
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_KernelsNotice())
    from bitsandbytes import functional

    return functional


def load(*codecs: str) -> None:
    """Import now what `codecs` need: bitsandbytes (int8) takes seconds to import, which on a peer's first int8
    message would stall its event loop, and every poll and round of that peer with it, as long."""
    for codec in codecs:
        _check_codec(codec)
        if codec == "int8":
            _bnb()


@cache
def _dynamic_map() -> torch.Tensor:
    return _bnb().create_dynamic_map(signed=True).to(torch.float32)


@cache
def int8_error_bound() -> float:
    """Per element, |x - decode(encode(x))| <= this x absmax(|x| over x's block); ~0.014 for the map.

    It is the largest gap between neighbouring points of [-1, code..., 1]: a normalized value x/absmax lies in
    [-1, 1] and is encoded as one of the two code points that bracket it (or the nearest end of the map). Exact
    nearest rounding would halve this, but the CPU kernel picks the farther neighbour for values within ~1e-5 of a
    midpoint, so only the bracket is guaranteed.
    """
    points = torch.cat([torch.tensor([-1.0, 1.0]), _dynamic_map().double()]).sort().values
    return float((points[1:] - points[:-1]).max())

_PROTO_CODEC = {
    "none": runtime_pb2.CompressionType.NONE,
    "fp16": runtime_pb2.CompressionType.FLOAT16,
    "int8": runtime_pb2.CompressionType.BLOCKWISE_8BIT,
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class BadTensorError(ValueError):
    """A tensor received from a peer does not have the shape, dtype or finite values it must have."""


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def encode(tensor: torch.Tensor, codec: str) -> runtime_pb2.Tensor:
    """Encode `tensor` with `codec` into one message (integer and bool tensors always travel exact)."""
    _check_codec(codec)
    tensor = tensor.detach().cpu()
    if tensor.dtype not in _FLOAT_DTYPES:
        codec = "none"  # ids, labels, masks must arrive exact
    elif codec == "fp16" and tensor.dtype in (torch.float16, torch.bfloat16):
        codec = "none"  # already 2-byte floats; hivemind's FLOAT16 codec refuses bfloat16
    if codec == "int8":
        return _encode_int8(tensor)
    return serialize_torch_tensor(tensor, _PROTO_CODEC[codec])


def encode_zeros(shape: Sequence[int]) -> runtime_pb2.Tensor:
    """A float32 tensor of zeros as a message of its shape and no bytes: no codec's message of a non-empty tensor
    has an empty buffer, so `decode` tells it apart."""
    return runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, size=list(shape), dtype="float32")


def decode(message: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode one message made by `encode` or `encode_zeros`; the codec is read from the message."""
    shape = torch.Size(message.size)
    if not message.buffer and message.compression == runtime_pb2.CompressionType.NONE and shape.numel():
        if message.dtype != "float32" or shape.numel() > MAX_ZEROS:
            raise ValueError(f"a message of zeros must be float32 and of at most {MAX_ZEROS} values, not "
                             f"{message.dtype!r} of shape {tuple(shape)}")
        return torch.zeros(shape)
    if message.compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT:
        return _decode_int8(message)
    if message.compression not in (runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16):
        raise ValueError(f"unsupported compression {runtime_pb2.CompressionType.Name(message.compression)}")
    return deserialize_torch_tensor(message)


def serialize(tensor: torch.Tensor, codec: str, *, chunk_size_bytes: int = CHUNK_BYTES) -> list[runtime_pb2.Tensor]:
    """Encode `tensor` with `codec` into streaming chunks of at most `chunk_size_bytes` bytes each."""
    return as_chunks(encode(tensor, codec), chunk_size_bytes=chunk_size_bytes)


def as_chunks(message: runtime_pb2.Tensor, *, chunk_size_bytes: int = CHUNK_BYTES) -> list[runtime_pb2.Tensor]:
    """One encoded tensor (`encode`) as streaming chunks of at most `chunk_size_bytes` bytes each."""
    return list(split_for_streaming(message, chunk_size_bytes))


def deserialize(parts: Sequence[runtime_pb2.Tensor]) -> torch.Tensor:
    """Decode the chunks of one tensor produced by `serialize`; the codec is read from the first chunk."""
    if not parts:
        raise ValueError("no parts to deserialize")
    expected = max(parts[0].chunks, 1)  # an empty buffer is sent as one chunk that announces zero
    if len(parts) != expected:
        raise ValueError(f"tensor announced {parts[0].chunks} chunks but {len(parts)} arrived")
    return decode(combine_from_streaming(parts))


class WireCodec(CompressionBase):
    """A codec of this module as hivemind's `CompressionBase`, for hivemind's averaging runner to send parts with
    (`client.averaging`); whoever receives them decodes with `decode`, since hivemind's own registry knows no int8
    codec that works on this stack."""

    def __init__(self, codec: str):
        _check_codec(codec)
        self.codec = codec
        self.compression_type = _PROTO_CODEC[codec]

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if tensor.dtype == torch.float32 and not tensor.any():
            return encode_zeros(tensor.shape)
        return encode(tensor, self.codec)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return decode(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return WIRE_BYTES[self.codec] / WIRE_BYTES["none"]


def encoded_nbytes(parts: Sequence[runtime_pb2.Tensor]) -> int:
    """Payload bytes of encoded chunks (buffers only; the few bytes of proto headers are left out)."""
    return sum(len(part.buffer) for part in parts)


def check_tensor(tensor: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    """Raise BadTensorError unless `tensor` is there and has exactly `shape` and `dtype` and only finite values."""
    if tensor is None:
        raise BadTensorError(f"{what}: missing")
    if tuple(tensor.shape) != tuple(shape):
        raise BadTensorError(f"{what}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise BadTensorError(f"{what}: expected dtype {dtype}, got {tensor.dtype}")
    if not tensor.is_floating_point():
        return
    # a NaN or an Inf makes the sum non-finite, so a finite sum clears the tensor in one pass, without the mask that
    # costs 20x as much on a stage's deposit; a sum that is not finite (a large finite one overflows too) gets the
    # exact count
    if not bool(torch.isfinite(tensor.sum(dtype=torch.promote_types(tensor.dtype, torch.float32)))):
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise BadTensorError(f"{what}: expected finite values, got {bad} NaN/Inf of {tensor.numel()}")


def _encode_int8(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    flat = tensor.reshape(-1).contiguous()
    if flat.dtype == torch.float64:
        flat = flat.to(torch.float32)  # bitsandbytes quantizes 16/32-bit floats only
    codes, state = _bnb().quantize_blockwise(flat, code=_dynamic_map(), blocksize=INT8_BLOCKSIZE)
    absmax = state.absmax.to(torch.float32).numpy().astype("<f4", copy=False)
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.BLOCKWISE_8BIT,
        buffer=absmax.tobytes() + codes.numpy().tobytes(),
        size=tensor.shape,
        dtype=str(tensor.dtype).removeprefix("torch."),
    )


def _decode_int8(message: runtime_pb2.Tensor) -> torch.Tensor:
    shape = torch.Size(message.size)
    dtype = getattr(torch, message.dtype, None)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"int8 message with non-float dtype {message.dtype!r}")
    numel = shape.numel()
    blocks = -(-numel // INT8_BLOCKSIZE)
    if len(message.buffer) != 4 * blocks + numel:
        raise ValueError(
            f"int8 message for shape {tuple(shape)} should hold {4 * blocks + numel} bytes, got {len(message.buffer)}"
        )
    raw = bytearray(message.buffer)  # writable copy: torch warns on read-only numpy views
    absmax = torch.from_numpy(np.frombuffer(raw, dtype="<f4", count=blocks).astype(np.float32))
    codes = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=4 * blocks, count=numel))
    # without a QuantState, bitsandbytes dequantizes to float32
    values = _bnb().dequantize_blockwise(codes, absmax=absmax, code=_dynamic_map(), blocksize=INT8_BLOCKSIZE)
    return values.reshape(shape).to(dtype)
