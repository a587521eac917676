"""A peer's view of who serves each stage, read from the signed stage records in the DHT and kept fresh; with the
run's owner key, only the servers the owner authorized (`live.authority`)."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

import hivemind

from p2ptrain.dht.readers import frontal_order, get_authorized_members, holding_servers
from p2ptrain.protocol.layout import Layout, StageServers

if TYPE_CHECKING:
    from p2ptrain.live.authority import Owner

logger = logging.getLogger(__name__)


class MembershipCache:
    """The FS and BS of every stage as last read from the DHT: re-read every `period_s` while they change, backing
    off to `idle_period_s` (doubling) while reads find them unchanged; every `retry_s` while some stage lacks an FS
    or a BS (workers and the data source wait on that). A caller that sees a sign of change (a server stopped
    answering: `suspect`) brings the period back to `period_s`; one that needs a read now (a server handed a layout
    naming a server it has not read yet: `refreshed`) has one within `retry_s`.
    Reads cost every DHT replica of the keys a lookup and a check of every signed entry: an idle swarm that re-read
    every few seconds kept its DHT processes busier than anything else it did (issue 21).

    Stage 0's FS come data source first (a layout's first stage-0 FS is its data source): with an owner, one whose
    certificate names it the data source (the smallest peer id of those), else the smallest peer id."""

    def __init__(self, *, dht: hivemind.DHT, run_id: str, num_stages: int, period_s: float, retry_s: float,
                 idle_period_s: float | None = None, owner: Owner | None = None):
        self.dht, self.run_id, self.num_stages, self.owner = dht, run_id, num_stages, owner
        self.period_s, self.retry_s = period_s, retry_s
        self.idle_period_s = period_s if idle_period_s is None else max(period_s, idle_period_s)
        self.stages: list[StageServers] = [StageServers(fs=(), bs=()) for _ in range(num_stages)]
        self.holders: list[frozenset[str]] = [frozenset() for _ in range(num_stages)]  # servers that hold the state
        self._holder_listeners: list[tuple[int, Callable[[frozenset[str]], None]]] = []
        self.unauthorized: list[set[str]] = [set() for _ in range(num_stages)]  # servers the owner did not authorize
        self._period = period_s  # the wait before the next read, as backed off
        self._suspect = asyncio.Event()
        self._urgent = False  # someone awaits a read that begins after it asked (`refreshed`)
        self._begun = self._ended = 0  # reads begun and ended
        self._read_ended = asyncio.Condition()

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            self._begun, self._urgent = self._begun + 1, False
            try:
                read = await asyncio.to_thread(self.read)
            except Exception as e:
                logger.warning(f"could not read stage membership: {e!r}")
            else:
                changed = read != (self.stages, self.holders)
                self._period = self.period_s if changed else min(2 * self._period, self.idle_period_s)
                self.stages, self.holders = read
            last = loop.time()
            async with self._read_ended:
                self._ended = self._begun
                self._read_ended.notify_all()
            for stage, listener in self._holder_listeners:
                listener(self.holders[stage])
            while not stop.is_set():  # a suspicion shortens the wait under way
                urgent = self._urgent or self.layout() is None
                period = min(self._period, self.retry_s) if urgent else self._period
                remaining = last + period - loop.time()
                if remaining <= 0:
                    break
                self._suspect.clear()
                await _first_of(stop, self._suspect, timeout=remaining)

    def suspect(self) -> None:
        """A server did not answer: read again `period_s` after the last read at the latest, and every `period_s`
        from then on while the servers change or a server stays silent."""
        self._period = self.period_s
        self._suspect.set()

    async def refreshed(self, timeout: float) -> None:
        """Until a read that begins after this call has ended (within `retry_s` of the last read), or `timeout`
        passed. However many ask, reads come at most every `retry_s`: a layout that names strangers costs the DHT no
        more than a stage that lacks a server."""
        wanted = self._begun + 1
        self._urgent = True
        self._suspect.set()
        async with self._read_ended:
            try:
                await asyncio.wait_for(self._read_ended.wait_for(lambda: self._ended >= wanted), timeout)
            except asyncio.TimeoutError:
                pass

    def on_holders(self, stage: int, listener: Callable[[frozenset[str]], None]) -> None:
        """Call `listener` with the servers of `stage` that hold its state, after every read."""
        self._holder_listeners.append((stage, listener))

    def read(self) -> tuple[list[StageServers], list[frozenset[str]]]:
        """Each stage's FS and BS, and the ones among them that hold the stage's state."""
        stages, holders = [], []
        for stage in range(self.num_stages):
            members, unauthorized = get_authorized_members(self.dht, self.run_id, stage, owner=self.owner)
            for peer in set(unauthorized) - self.unauthorized[stage]:
                logger.warning(f"ignoring {peer}: it announces itself as a server of stage {stage}, but the owner "
                               f"did not authorize it there")
            self.unauthorized[stage] = set(unauthorized)
            stages.append(StageServers(fs=frontal_order(members, owner=self.owner),
                                       bs=tuple(sorted(m.peer_id for m in members if m.role == "bs"))))
            holders.append(holding_servers(members))
        return stages, holders

    def all_servers(self) -> set[str]:
        return {peer for peer, _ in Layout(tuple(self.stages)).servers()}

    def servers(self, stage: int) -> tuple[list[str], list[str]]:
        return list(self.stages[stage].fs), list(self.stages[stage].bs)

    def layout(self) -> Layout | None:
        """The layout for the next epoch, or None while some stage lacks an FS or a BS."""
        if all(s.fs and s.bs for s in self.stages):
            return Layout(tuple(self.stages))
        return None

    def leads(self, peer_id: str) -> bool:
        """Whether `peer_id` is the data source: the first stage-0 FS."""
        return self.data_source() == peer_id

    def authorizes(self, peer: str, stage: int, role: str) -> bool:
        """Whether `peer` serves as `role` of `stage` in what was last read (with an owner: by its certificate)."""
        return 0 <= stage < self.num_stages and peer in self.stages[stage].of(role)

    def data_source(self) -> str | None:
        return self.stages[0].fs[0] if self.stages[0].fs else None


async def _first_of(*events: asyncio.Event, timeout: float) -> None:
    """Until one of `events` is set, or `timeout` passed."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
