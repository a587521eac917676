"""P2P daemons on 127.0.0.1 for the tests that cross real libp2p between peers of one process."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from hivemind.p2p import P2P

from p2ptrain.cli import LOOPBACK


@contextlib.asynccontextmanager
async def loopback_p2ps(count: int, *, timeout: float = 30.0) -> AsyncIterator[list[P2P]]:
    """`count` daemons on loopback, every one after the first bootstrapped from it; each waited for up to `timeout`
    seconds to start, and shut down at the end unless the test shut it down already (a peer that died)."""
    p2ps: list[P2P] = []
    try:
        p2ps.append(await asyncio.wait_for(P2P.create(host_maddrs=[LOOPBACK]), timeout))
        for _ in range(count - 1):
            p2ps.append(await asyncio.wait_for(P2P.create(
                host_maddrs=[LOOPBACK], initial_peers=await p2ps[0].get_visible_maddrs()), timeout))
        yield p2ps
    finally:
        for p2p in p2ps:
            if p2p.is_alive:
                await p2p.shutdown()
