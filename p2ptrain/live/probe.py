"""What a joining peer measures for the planner: its compute, its memory, and its links to other peers.

A link is measured over the same libp2p RPC that will later carry activations, so the planner sees what the
runtime will get: latency is half the round trip of a tiny message, bandwidth the time of a ~1 MiB message once
that round trip is taken off. Compute is timed on the stage model the peer will run (or one block of it, before
the peer knows its stage), the quantity the planner's cost model divides by.
"""
from __future__ import annotations

import asyncio
import os
import time

import torch
from hivemind.p2p import P2PContext

from p2ptrain.client.device import autocast, place
from p2ptrain.config import RunConfig
from p2ptrain.dht import Link
from p2ptrain.models import build_stage
from p2ptrain.models.base import StageModel
from p2ptrain.protocol.messages import LINK_PROBE, Echo, Probe
from p2ptrain.transport import Caller, Hearing, Refused, Requests, Responses, Service

PAYLOAD_BYTES = 2**20
PINGS = 3


class LinkProbe(Service):
    """Answers probes: echoes how many bytes arrived, so a sender can time tiny and bulky messages.

    Every peer but the bootstrap one runs it. `delay_s` (tests only, `--probe-delay`) makes this peer look as if it
    sat behind a slow link: each echo waits `delay_s`, plus `delay_s` per `PAYLOAD_BYTES` received, so
    `measure_link` reads a latency of about `delay_s / 2` and a bandwidth of at most `PAYLOAD_BYTES / delay_s`.
    Only probes are slowed; the training traffic is not.

    Each echo also tells when this process started (`started`, Unix time), so the data source can tell a server
    that restarted with the same identity, and lost what it held, from one that kept running.
    """

    service = LINK_PROBE

    def __init__(self, *, peer_id: str, delay_s: float = 0.0, started: float | None = None,
                 hearing: Hearing | None = None):
        # `hearing`: the node's, so that a server hears a worker whose loop is held between polls (`Worker._beat`)
        super().__init__(peer_id=peer_id, name="link probe", codec="none", hearing=hearing)
        self.delay_s = delay_s
        self.started = time.time() if started is None else started

    def rpc_echo(self, requests: Requests, context: P2PContext) -> Responses:
        return self.serve(requests, context, Probe, self.echo)

    async def echo(self, request: Probe, sender: str) -> Echo:
        payload = request.payload
        received = 0 if payload is None else payload.numel() * payload.element_size()
        if self.delay_s:
            await asyncio.sleep(self.delay_s * (1 + received / PAYLOAD_BYTES))
        return Echo(received=received, started=self.started)


async def measure_link(caller: Caller, peer: str) -> Link:
    """The link from this peer to `peer`, which must run a LinkProbe; raises on timeouts and RPC errors."""
    round_trips = []
    for _ in range(PINGS):  # the fastest of a few: the others include scheduling noise on a busy machine
        started = time.perf_counter()
        await caller.call(peer, LINK_PROBE, Probe())
        round_trips.append(time.perf_counter() - started)
    rtt = min(round_trips)
    payload = torch.zeros(PAYLOAD_BYTES // 4, dtype=torch.float32)
    started = time.perf_counter()
    echo = await caller.call(peer, LINK_PROBE, Probe(payload=payload))
    elapsed = time.perf_counter() - started
    if echo.received != PAYLOAD_BYTES:
        raise ConnectionError(f"peer {peer} echoed {echo.received} bytes, not {PAYLOAD_BYTES}")
    # the transfer time is what the bulky message took beyond a tiny one; floor it so a lucky timing on
    # loopback cannot report an infinite bandwidth
    return Link(latency_s=rtt / 2, bandwidth_bps=PAYLOAD_BYTES / max(elapsed - rtt, 1e-4))


async def dial_failure(caller: Caller, peer: str, *, timeout: float) -> Exception | None:
    """Why `peer`'s process cannot be reached (its dial failed: it is gone); None if its link probe answered, or
    was only slow or refused (alive but busy: silence must decide, not this probe)."""
    try:
        await caller.call(peer, LINK_PROBE, Probe(), timeout=timeout)
    except (TimeoutError, Refused):
        return None
    except Exception as e:
        return e
    return None


def available_memory(device: torch.device = torch.device("cpu")) -> int:
    """Bytes free for layers now where this peer computes: a CUDA device's free memory (`mem_get_info`), else the
    host's free RAM (POSIX sysconf, no extra dependency)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def measure_compute(model: StageModel, config: RunConfig) -> float:
    """FLOP/s of this process on its stage: time one forward+backward of a microbatch-sized slice."""
    rows = max(1, min(config.rows_per_microbatch, 4))
    device = next(model.parameters()).device
    inputs = model.example_inputs(rows, config.seq_len).to(device)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    with autocast(device, config.precision):
        output = model(inputs)
    output.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    model.zero_grad(set_to_none=True)
    return 6.0 * params * rows * config.seq_len / max(time.perf_counter() - started, 1e-6)


def measure_block_compute(config: RunConfig, *, device: torch.device = torch.device("cpu"),
                          repeats: int = 3) -> float:
    """FLOP/s on one block of the recipe's model, before the peer knows its stage (live planning): on the device
    this peer computes on, at the run's precision.

    A middle block carries neither the embeddings nor the head, so the figure is per-layer throughput. The best of
    a few runs: the first pays one-time allocations.
    """
    start = min(1, config.model_config.num_layers - 1)
    block = place(build_stage(config.model_config, start=start, end=start + 1, seed=config.seed), device,
                  config.precision)
    return max(measure_compute(block, config) for _ in range(repeats))
