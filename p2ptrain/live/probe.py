"""What a joining peer measures for the planner: its compute, its memory, and its links to other peers.

A link is measured over the same libp2p RPC that will later carry activations, so the planner sees what the
runtime will get: latency is half the round trip of a tiny message, bandwidth the time of a ~1 MiB message once
that round trip is taken off.
"""
from __future__ import annotations

import os
import time
from typing import AsyncIterator

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from p2ptrain.dht import Link
from p2ptrain.transport import Caller, Message, respond, unpack

PAYLOAD_BYTES = 2**20
PINGS = 3


class LinkProbe(ServicerBase):
    """Answers probes: echoes how many bytes arrived, so a sender can time tiny and bulky messages."""

    async def rpc_echo(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        message = await unpack(requests)
        received = sum(t.numel() * t.element_size() for t in message.tensors.values())
        for response in respond(Message({"received": received}), codec="none"):
            yield response


async def measure_link(caller: Caller, peer: str) -> Link:
    """The link from this peer to `peer`, which must run a LinkProbe; raises on timeouts and RPC errors."""
    round_trips = []
    for _ in range(PINGS):  # the fastest of a few: the others include scheduling noise on a busy machine
        started = time.perf_counter()
        await caller.call(peer, LinkProbe, "rpc_echo", Message({}))
        round_trips.append(time.perf_counter() - started)
    rtt = min(round_trips)
    payload = torch.zeros(PAYLOAD_BYTES // 4, dtype=torch.float32)
    started = time.perf_counter()
    reply = await caller.call(peer, LinkProbe, "rpc_echo", Message({}, {"payload": payload}))
    elapsed = time.perf_counter() - started
    if reply.header.get("received") != PAYLOAD_BYTES:
        raise ConnectionError(f"peer {peer} echoed {reply.header.get('received')} bytes, not {PAYLOAD_BYTES}")
    # the transfer time is what the bulky message took beyond a tiny one; floor it so a lucky timing on
    # loopback cannot report an infinite bandwidth
    return Link(latency_s=rtt / 2, bandwidth_bps=PAYLOAD_BYTES / max(elapsed - rtt, 1e-4))


def available_memory() -> int:
    """Bytes of RAM free for layers now (the runtime trains on the CPU); POSIX sysconf, no extra dependency."""
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
