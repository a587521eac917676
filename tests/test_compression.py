from __future__ import annotations

import asyncio

import pytest
import torch
from bitsandbytes import functional as bnbf
from hivemind.compression import CompressionInfo
from hivemind.proto import runtime_pb2

from p2ptrain.compression import (
    CODECS,
    INT8_BLOCKSIZE,
    MAX_ZEROS,
    BadTensorError,
    WireCodec,
    check_tensor,
    decode,
    deserialize,
    encode,
    encoded_nbytes,
    int8_error_bound,
    serialize,
)
from p2ptrain.config import WIRE_BYTES
from p2ptrain.transport import Envelope, pack, unpack


def _blockwise_absmax(x: torch.Tensor) -> torch.Tensor:
    """absmax of the block that each element belongs to, flattened like the codec does."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % INT8_BLOCKSIZE
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, INT8_BLOCKSIZE)
    return blocks.abs().amax(dim=1).repeat_interleave(INT8_BLOCKSIZE)[: flat.numel()]


def test_none_is_exact_for_every_dtype() -> None:
    gen = torch.Generator().manual_seed(1)
    for tensor in (
        torch.randn(3, 5, 7, generator=gen),
        torch.randn(4, 9, generator=gen, dtype=torch.float64),
        torch.randn(17, generator=gen).half(),
    ):
        out = deserialize(serialize(tensor, "none"))
        assert out.dtype == tensor.dtype and out.shape == tensor.shape
        assert torch.equal(out, tensor)


@pytest.mark.parametrize("codec", CODECS)
def test_integers_pass_through_uncompressed(codec: str) -> None:
    ids = torch.randint(0, 256, (4, 33), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    parts = serialize(ids, codec)
    assert parts[0].compression == runtime_pb2.CompressionType.NONE
    out = deserialize(parts)
    assert out.dtype == torch.int64 and torch.equal(out, ids)
    mask = ids > 100
    assert torch.equal(deserialize(serialize(mask, codec)), mask)


def test_fp16_roundtrip_error() -> None:
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(3)) * 3
    parts = serialize(x, "fp16")
    out = deserialize(parts)
    assert out.dtype == torch.float32 and out.shape == x.shape
    # fp16 has an 11-bit significand: relative rounding error at most 2^-11 for normal numbers
    assert torch.all((out - x).abs() <= x.abs() * 2.0**-11 + 1e-7)
    assert encoded_nbytes(parts) == x.numel() * 2


def test_int8_bound_is_derived_from_the_code_map() -> None:
    code = bnbf.create_dynamic_map(signed=True).double().sort().values
    points = torch.cat([torch.tensor([-1.0], dtype=torch.float64), code, torch.tensor([1.0], dtype=torch.float64)])
    assert int8_error_bound() == pytest.approx(float((points[1:] - points[:-1]).max()))
    assert 0 < int8_error_bound() < 0.05  # a loose bound would make the next test meaningless


@pytest.mark.parametrize("kind", ["normal", "student_t", "outlier_channels"])
def test_int8_error_bound_holds(kind: str) -> None:
    torch.manual_seed(4)
    if kind == "normal":
        x = torch.randn(8, 128, 256)
    elif kind == "student_t":
        x = torch.distributions.StudentT(1.5).sample((8, 128, 256))
    else:
        x = torch.randn(8, 128, 256)
        x[..., ::37] *= 50
    x = x[:, :, :250]  # a size that is not a multiple of the block: the last block is partial
    out = deserialize(serialize(x, "int8"))
    assert out.dtype == torch.float32 and out.shape == x.shape
    err = (out - x).abs().reshape(-1)
    bound = int8_error_bound() * _blockwise_absmax(x.contiguous()) + 1e-7
    assert torch.all(err <= bound), float((err / bound).max())
    # the codec does real work: far better than coding every value as 0
    assert float(err.norm() / x.norm()) < 0.03


def test_int8_bytes_and_edge_cases() -> None:
    x = torch.randn(8, 128, 256, generator=torch.Generator().manual_seed(5))
    int8_bytes = encoded_nbytes(serialize(x, "int8"))
    fp32_bytes = encoded_nbytes(serialize(x, "none"))
    assert fp32_bytes == x.numel() * 4
    assert int8_bytes <= 0.27 * fp32_bytes
    zeros = torch.zeros(5, 300)
    assert torch.equal(deserialize(serialize(zeros, "int8")), zeros)
    empty = torch.empty(0, 16)
    assert deserialize(serialize(empty, "int8")).shape == (0, 16)
    half = torch.randn(40, 40, generator=torch.Generator().manual_seed(6)).half()
    assert deserialize(serialize(half, "int8")).dtype == torch.float16


def test_chunking_and_many_tensors() -> None:
    gen = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randn(100, 100, generator=gen), "b": torch.arange(10), "c": torch.randn(3, generator=gen)}
    parts = serialize(tensors["a"], "int8", chunk_size_bytes=1000)
    assert len(parts) > 1 and all(len(part.buffer) <= 1000 for part in parts)
    for codec in CODECS:
        protos = pack(Envelope({"n": 1}, tensors), codec=codec, proto=runtime_pb2.ExpertRequest)
        out = asyncio.run(unpack(protos))
        assert out.header == {"n": 1} and [o.shape for o in out.tensors.values()] == [t.shape for t in tensors.values()]
        assert torch.equal(out.tensors["b"], tensors["b"])  # integers always travel exact
    first = serialize(tensors["a"], "int8", chunk_size_bytes=1000)
    with pytest.raises(ValueError, match="chunks"):
        deserialize(first[:-1])


def test_a_tensor_the_sender_encoded_already_travels_as_it_encoded_it() -> None:
    gen = torch.Generator().manual_seed(8)
    sent, other = torch.randn(3000, generator=gen), torch.randn(3000, generator=gen)
    message = encode(sent, "int8")
    protos = pack(Envelope({}, {"g": decode(message)}, {"g": message}), codec="int8", proto=runtime_pb2.ExpertRequest)
    assert torch.equal(asyncio.run(unpack(protos)).tensors["g"], decode(message))
    # the message travels, not the tensor beside it: nothing encodes it again
    protos = pack(Envelope({}, {"g": other}, {"g": message}), codec="int8", proto=runtime_pb2.ExpertRequest)
    assert torch.equal(asyncio.run(unpack(protos)).tensors["g"], decode(message))


def test_int8_rejects_truncated_buffer() -> None:
    [part] = serialize(torch.randn(1000), "int8")
    part.buffer = part.buffer[:-1]
    with pytest.raises(ValueError, match="bytes"):
        deserialize([part])


@pytest.mark.parametrize("codec", CODECS)
def test_the_averaging_codec_sends_zeros_as_their_shape_and_anything_else_in_its_codec(codec: str) -> None:
    wire = WireCodec(codec)
    zeros = torch.zeros(300, 7)
    message = wire.compress(zeros, CompressionInfo.from_tensor(zeros))
    assert message.ByteSize() < 32 and torch.equal(decode(message), zeros)
    one = zeros.clone()
    one[299, 6] = 1.0
    message = wire.compress(one, CompressionInfo.from_tensor(one))
    assert len(message.buffer) >= one.numel() * WIRE_BYTES[codec] and decode(message)[299, 6] == 1.0
    empty = torch.zeros(0, dtype=torch.int64)  # an empty tensor of any dtype still round-trips
    assert decode(serialize(empty, codec)[0]).dtype == torch.int64


def test_a_message_of_zeros_must_be_float32_and_bounded() -> None:
    for size, dtype in (([4], "int64"), ([MAX_ZEROS + 1], "float32"), ([2**12, 2**12], "float32")):
        with pytest.raises(ValueError, match="zeros"):
            decode(runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, size=size, dtype=dtype))


def test_check_tensor() -> None:
    x = torch.zeros(2, 3)
    check_tensor(x, shape=(2, 3), dtype=torch.float32, what="activations")
    with pytest.raises(BadTensorError, match=r"activations.*\(2, 4\).*\(2, 3\)"):
        check_tensor(x, shape=(2, 4), dtype=torch.float32, what="activations")
    with pytest.raises(BadTensorError, match=r"grads.*torch.float16.*torch.float32"):
        check_tensor(x, shape=(2, 3), dtype=torch.float16, what="grads")
    x[1, 2] = float("nan")
    with pytest.raises(BadTensorError, match=r"outputs.*1 NaN/Inf"):
        check_tensor(x, shape=(2, 3), dtype=torch.float32, what="outputs")
    assert issubclass(BadTensorError, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_tensor_finds_every_nan_and_inf_and_passes_finite_values_whose_sum_overflows(dtype: torch.dtype) -> None:
    biggest = torch.finfo(dtype).max
    huge = torch.full((1000,), biggest, dtype=dtype)  # finite, though their sum is not in any float type
    check_tensor(huge, shape=(1000,), dtype=dtype, what="huge")
    for bad, count in (([float("inf"), -float("inf")], 2), ([1.0, float("nan")], 1), ([-float("inf"), 0.0], 1)):
        values = torch.cat([huge, torch.tensor(bad, dtype=dtype)])
        with pytest.raises(BadTensorError, match=rf"grads: expected finite values, got {count} NaN/Inf of 1002"):
            check_tensor(values, shape=(1002,), dtype=dtype, what="grads")
