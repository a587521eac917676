"""The data source's watch on the stage servers: it pings each one's link probe, which answers with the time its
process started, so a server that restarted (with the same identity, having lost what it held) or fell silent for
good is noticed within seconds, without waiting for its DHT records to expire.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from p2ptrain.protocol.messages import LINK_PROBE, Probe
from p2ptrain.transport import Caller

logger = logging.getLogger(__name__)


class ServerWatch:
    """Pings `servers()` every `period_s`. A server that does not answer for `lost_s` is `lost` until it answers
    again; one whose start time changed restarted. Either, for a server of the `watched` set (the open epoch's
    layout), sets `fault` with the `reason`; `restarts` counts each server's. A lost server that answers again, or one
    that restarted, is put on `returned` (with whether it restarted): it missed what the data source told the servers
    meanwhile."""

    def __init__(self, *, caller: Caller, servers: Callable[[], Iterable[str]], period_s: float, lost_s: float,
                 timeout_s: float, suspect: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        # `suspect`: told of every ping that failed (`MembershipCache.suspect`)
        self.caller, self.servers, self.suspect, self.clock = caller, servers, suspect, clock
        self.period_s, self.lost_s, self.timeout_s = period_s, lost_s, timeout_s
        self.started: dict[str, float] = {}  # each server's process start, as last echoed
        self.silent_since: dict[str, float] = {}
        self.lost: set[str] = set()
        # a call retried across a restart would reach a process that knows nothing of what it was about
        self.restarts: Counter[str] = Counter()
        self.watched: frozenset[str] = frozenset()
        self.fault = asyncio.Event()
        self.reason = ""
        self.returned: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    def watch(self, servers: Iterable[str]) -> None:
        """From now on, a restart or loss of one of `servers` is a fault (and earlier ones are forgotten)."""
        self.watched, self.reason = frozenset(servers), ""
        self.fault.clear()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            peers = {*self.servers(), *self.watched} - {self.caller.peer_id}  # its own process it knows
            await asyncio.gather(*(self._ping(peer) for peer in peers))
            try:
                await asyncio.wait_for(stop.wait(), self.period_s)
            except asyncio.TimeoutError:
                pass

    async def _ping(self, peer: str) -> None:
        asked = self.clock()
        try:
            echo = await asyncio.wait_for(self.caller.call(peer, LINK_PROBE, Probe()), self.timeout_s)
        except Exception:
            self.suspect()
            since = self.silent_since.setdefault(peer, asked)
            if asked - since >= self.lost_s and peer not in self.lost:
                self.lost.add(peer)
                self._fault(peer, f"silent for {asked - since:.0f} s")
            return
        self.silent_since.pop(peer, None)
        back = peer in self.lost
        if back:
            self.lost.discard(peer)
            logger.info(f"data source: server {peer} answers again")
        before, self.started[peer] = self.started.get(peer), echo.started
        restarted = before is not None and before != echo.started
        if restarted:
            self.restarts[peer] += 1
            self._fault(peer, "restarted")
        if back or restarted:
            self.returned.put_nowait((peer, restarted))

    def _fault(self, peer: str, what: str) -> None:
        logger.warning(f"data source: server {peer} {what}")
        if peer in self.watched and not self.fault.is_set():
            self.reason = f"server {peer} {what}"
            self.fault.set()
