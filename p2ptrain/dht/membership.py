"""A peer's view of who serves each stage, read from the signed stage records in the DHT and kept fresh."""
from __future__ import annotations

import asyncio
import logging

import hivemind

from p2ptrain.dht.readers import get_stage_members
from p2ptrain.protocol.layout import Layout, StageServers

logger = logging.getLogger(__name__)


class MembershipCache:
    """The FS and BS of every stage as last read from the DHT: re-read every `period_s`, and every `retry_s` while
    some stage lacks an FS or a BS (workers and the data source wait on that)."""

    def __init__(self, *, dht: hivemind.DHT, run_id: str, num_stages: int, period_s: float, retry_s: float):
        self.dht, self.run_id, self.num_stages = dht, run_id, num_stages
        self.period_s, self.retry_s = period_s, retry_s
        self.stages: list[StageServers] = [StageServers(fs=(), bs=()) for _ in range(num_stages)]

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.stages = await asyncio.to_thread(self.read)
            except Exception as e:
                logger.warning(f"could not read stage membership: {e!r}")
            period = self.period_s if self.layout() is not None else min(self.period_s, self.retry_s)
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass

    def read(self) -> list[StageServers]:
        stages = []
        for stage in range(self.num_stages):
            members = get_stage_members(self.dht, self.run_id, stage)
            stages.append(StageServers(
                fs=tuple(sorted(m.peer_id for m in members if m.role == "fs")),
                bs=tuple(sorted(m.peer_id for m in members if m.role == "bs")),
            ))
        return stages

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
        """The stage-0 FS with the smallest peer id is the data source."""
        return self.data_source() == peer_id

    def data_source(self) -> str | None:
        return self.stages[0].fs[0] if self.stages[0].fs else None
