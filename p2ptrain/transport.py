"""Messages over hivemind's libp2p streaming RPCs: a msgpack header plus named tensors.

Tensors always travel as streams of chunks of at most 1 MiB: hivemind refuses unary requests over 4 MiB and a unary
response over 4 MiB hangs the caller (DESIGN §7). Streaming stubs take no timeout, so every call is wrapped.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, TypeVar

import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from p2ptrain.compression import deserialize, serialize

Proto = TypeVar("Proto", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


@dataclass
class Message:
    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def pack(message: Message, *, codec: str, proto: type[Proto]) -> list[Proto]:
    """Header first, then each tensor's chunks; integer tensors are never compressed."""
    layout, chunks = [], []
    for name, tensor in message.tensors.items():
        parts = serialize(tensor.detach().contiguous(), codec)
        layout.append([name, len(parts)])
        chunks.extend(parts)
    meta = msgpack.packb({"header": message.header, "tensors": layout}, use_bin_type=True)
    return [proto(metadata=meta)] + [proto(tensors=[chunk]) for chunk in chunks]


async def unpack(stream: AsyncIterator[Proto] | Iterable[Proto]) -> Message:
    protos = [item async for item in stream] if hasattr(stream, "__aiter__") else list(stream)
    if not protos:
        raise ConnectionError("the peer sent an empty stream")
    meta = msgpack.unpackb(protos[0].metadata, raw=False)
    chunks = [chunk for proto in protos[1:] for chunk in proto.tensors]
    announced = sum(num_chunks for _, num_chunks in meta["tensors"])
    if len(chunks) < announced:  # a transport failure like an empty stream: the caller may retry
        raise ConnectionError(f"the stream ended early: {len(chunks)} of {announced} tensor chunks arrived")
    tensors, position = {}, 0
    for name, num_chunks in meta["tensors"]:
        tensors[name] = deserialize(chunks[position : position + num_chunks])
        position += num_chunks
    if position != len(chunks):
        raise ValueError(f"the message announced {position} tensor chunks but {len(chunks)} arrived")
    return Message(header=meta["header"], tensors=tensors)


async def _aiter(items: list[Proto]) -> AsyncIterator[Proto]:
    for item in items:
        yield item


class Caller:
    """Calls the rpc_* handlers of servicers on other peers; calls to this peer itself go straight to the handler."""

    def __init__(self, *, p2p: P2P, local: dict[str, Any], codec: str, timeout: float):
        self.p2p, self.local, self.codec, self.timeout = p2p, local, codec, timeout

    async def call(self, peer: str, service: type, method: str, message: Message, *, timeout: float | None = None) -> Message:
        return await asyncio.wait_for(self._call(peer, service, method, message), timeout or self.timeout)

    async def _call(self, peer: str, service: type, method: str, message: Message) -> Message:
        requests = pack(message, codec=self.codec, proto=runtime_pb2.ExpertRequest)
        servicer = self.local.get(peer)
        if isinstance(servicer, service):
            responses = getattr(servicer, method)(_aiter(requests), None)
        else:
            stub = service.get_stub(self.p2p, PeerID.from_base58(peer))
            responses = await getattr(stub, method)(_aiter(requests))
        return await unpack(responses)


def respond(message: Message, *, codec: str) -> list[runtime_pb2.ExpertResponse]:
    return pack(message, codec=codec, proto=runtime_pb2.ExpertResponse)
