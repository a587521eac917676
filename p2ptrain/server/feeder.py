"""The data source of the swarm: the stage-0 frontal server with the smallest peer id reads each microbatch,
fixes the epoch's layout from the stage memberships in the DHT, and pushes the rows to the stage-0 FS set.

It bounds how many microbatches are in flight (1F1B: stage 0 sets the pace), and an epoch's microbatches go
out only once the previous epoch has closed at stage 0, which is after it closed at every stage.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from p2ptrain.data import TextSource
from p2ptrain.protocol.layout import Layout
from p2ptrain.protocol.messages import FRONTAL_SERVER, PushRows
from p2ptrain.protocol.rows import Rows
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.transport import Refused

logger = logging.getLogger(__name__)

LAYOUT_WAIT_S = 0.25
LAYOUT_NOTICE_EVERY_S = 5.0


@dataclass
class FeederProgress:
    epoch_seconds: dict[int, float] = field(default_factory=dict)
    finished: bool = False


class DataFeeder:
    """Feeds `epochs` global batches into stage 0 if its FS leads stage 0. Owns its progress; reads the text
    source and the stage-0 FS it runs beside, and calls the stage-0 FS set."""

    def __init__(self, *, server: FrontalServer, source: TextSource, layout: Callable[[], Layout | None],
                 is_leader: Callable[[str], bool], epochs: int, max_in_flight: int):
        self.server, self.source, self.layout, self.is_leader = server, source, layout, is_leader
        self.epochs, self.max_in_flight = epochs, max_in_flight
        self.rows, self.microbatches = server.config.rows_per_microbatch, server.config.microbatches
        self.progress = FeederProgress()

    @property
    def leads(self) -> bool:
        return self.is_leader(self.server.peer_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Feed every epoch if this server leads stage 0; the other stage-0 FS only serve their segments."""
        layout = await self._wait_for_layout(stop)
        if layout is None or not self.leads:
            return
        poll = self.server.settings.feeder_poll_s
        for epoch in range(self.epochs):
            layout = await self._wait_for_layout(stop)
            if layout is None:
                return
            started = time.monotonic()
            for index in range(self.microbatches):
                while self.server.in_flight() >= self.max_in_flight and not stop.is_set():
                    await asyncio.sleep(poll)
                if stop.is_set():
                    return
                await self._push(epoch, index, layout)
            while self.server.state.closed_epoch < epoch:
                if stop.is_set():
                    return
                await asyncio.sleep(poll)
            self.progress.epoch_seconds[epoch] = time.monotonic() - started
        self.progress.finished = True
        logger.info(f"data source: all {self.epochs} epochs done")

    async def _wait_for_layout(self, stop: asyncio.Event) -> Layout | None:
        waited = 0.0
        while not stop.is_set():
            layout = self.layout()
            if layout is not None:
                return layout
            if waited % LAYOUT_NOTICE_EVERY_S < LAYOUT_WAIT_S:
                logger.info("data source: waiting for an FS and a BS in every stage")
            await asyncio.sleep(LAYOUT_WAIT_S)
            waited += LAYOUT_WAIT_S
        return None

    async def _push(self, epoch: int, index: int, layout: Layout) -> None:
        inputs, labels = self.source.microbatch(epoch, index, self.rows)
        for fs, part in layout.route(0, "fs", Rows(0, self.rows), self.rows):
            window = slice(part.start, part.end)
            request = PushRows(epoch=epoch, microbatch=index, rows=part, total_rows=self.rows, layout=layout,
                               inputs=inputs[window], labels=labels[window])
            try:  # a stage-0 FS takes a repeated push of rows it holds as the same one
                await self.server.retrying(fs, FRONTAL_SERVER, request, attempts=None,
                                           what=f"microbatch {epoch}:{index} rows {part}")
            except Refused as e:
                raise RuntimeError(f"stage-0 FS {fs} refused microbatch {epoch}:{index}: {e}") from None
