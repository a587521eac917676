"""The data source of the swarm: the stage-0 frontal server with the smallest peer id reads each microbatch,
fixes the epoch's layout from the stage memberships in the DHT, and pushes the rows to the stage-0 FS set.

It bounds how many microbatches are in flight (1F1B: stage 0 sets the pace), and an epoch's microbatches go
out only once the previous epoch has closed at stage 0, which is after it closed at every stage.

It also ends each epoch swarm-wide (`EndEpoch`). Once every stage-0 FS has all its rows back, every row went
through every stage, and it commits the epoch: only then may an FS close it and its workers step. If a server of the
epoch's layout restarts (it lost what it held) or falls silent for good before that (`ServerWatch`), it abandons
the epoch instead: every server drops it, every worker drops its gradients of it, and the same global batch of data
is fed again as the next epoch, under a layout without the lost server. No stage can have stepped on an abandoned
epoch, so no row is lost or counted twice. A server that did not hear of the abandon (the DHT showed it only later,
or it was lost) hears of it before the next epoch's rows, since the epoch's workers may poll it next; one that comes
back hears of it at once, and one that restarted also hears that its stage stands past the last committed epoch: its
stage's workers may still wait for every FS of that epoch's layout to close it, and a restarted FS, holding nothing of
it, would never close it.

A stage-0 FS that refuses a push, or to say whether its rows are back, is a fault of the epoch too (a peer may have
sent it a forged end of that epoch): the epoch is abandoned and its batch fed again, after a pause that doubles while
refusals go on. Nothing a server answers ends the data source.

With `RunConfig.overlap_epochs` there is no drain at the boundary (`_feed_overlapped`): once an epoch's microbatches
are all out, the next epoch's follow while it completes, commits and closes; the one after waits for it to close here,
so at most two epochs are open. A fault or a refusal then abandons both open epochs, unless the earlier one was
committed already, and their batches are fed again in order.

Under fault policy swarm (SWARM's way, for comparison) the stages drop the rows a vanished worker held instead of
redoing them, and the data source feeds those microbatches' data again from stage 0 in a later epoch (`SlotPlan`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from p2ptrain.data import TextSource
from p2ptrain.protocol.layout import Layout, ServerRole, StageServers
from p2ptrain.protocol.messages import (
    BACKWARD_SERVER,
    FRONTAL_SERVER,
    STAGE_EVAL,
    AskEpoch,
    EndEpoch,
    EpochState,
    EvalForward,
    PushRows,
)
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.slots import Slot, SlotPlan
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.server.watch import ServerWatch
from p2ptrain.transport import Refused

logger = logging.getLogger(__name__)

LAYOUT_WAIT_S = 0.25
LAYOUT_NOTICE_EVERY_S = 5.0
SERVICE: dict[ServerRole, str] = {"fs": FRONTAL_SERVER, "bs": BACKWARD_SERVER}
ASK_EVERY_S = 0.1  # how often the data source asks the other stage-0 FS whether their rows are all back
REFEED_PAUSE_S = (0.5, 30.0)  # the pause before feeding a refused epoch's batch again: first, and longest


class FeedRefused(Exception):
    """A stage-0 FS refused the epoch's data, or to say whether its rows are back."""


@dataclass
class FeederProgress:
    epoch_seconds: dict[int, float] = field(default_factory=dict)  # committed epochs
    retrained: dict[int, int] = field(default_factory=dict)  # committed epochs: microbatches of data fed again
    eval_loss: dict[int, float] = field(default_factory=dict)  # held-out loss of the parameters after an epoch's step
    finished: bool = False


@dataclass
class Fed:
    """An epoch whose microbatches are all out, completing (`DataFeeder._feed_overlapped`)."""

    epoch: int
    batch: int
    layout: Layout
    started: float
    committed: bool = False


class Faulted(Exception):
    """A server of an open epoch's layout restarted or fell silent (`ServerWatch.fault`)."""


@dataclass(frozen=True)
class HeldOut:
    """Held-out (token ids, labels) windows the data source evaluates the swarm's parameters on, through the
    stages' servers (`server.evaluation`), after every `every` global batches."""

    windows: list[tuple[torch.Tensor, torch.Tensor]]
    every: int


class DataFeeder:
    """Feeds `epochs` global batches into stage 0 if its FS leads stage 0 (an abandoned epoch's batch is fed again,
    so `epochs` batches are trained on whatever fails). Owns its progress; reads the text source, the stage-0 FS it
    runs beside and the `watch` on the servers, and calls the stage servers."""

    def __init__(self, *, server: FrontalServer, source: TextSource, layout: Callable[[], Layout | None],
                 is_leader: Callable[[str], bool], epochs: int, max_in_flight: int, watch: ServerWatch,
                 held_out: HeldOut | None = None, at_end: Callable[[], Awaitable[None]] | None = None):
        self.server, self.source, self.layout, self.is_leader = server, source, layout, is_leader
        self.epochs, self.max_in_flight, self.watch, self.held_out = epochs, max_in_flight, watch, held_out
        self.at_end = at_end  # what the run does once its last epoch closed (the export), before it is finished
        self._evaluations: set[asyncio.Task] = set()
        self.rows, self.microbatches = server.config.rows_per_microbatch, server.config.microbatches
        self.progress = FeederProgress()
        self.plan = SlotPlan(microbatches=self.microbatches, swarm=server.config.fault_policy == "swarm")
        # the epochs abandoned since the last commit, with their layout and the servers that heard of it
        self._abandoned: dict[int, tuple[Layout, set[str]]] = {}
        self._committed: tuple[int, Layout] | None = None  # the last epoch committed, and its layout
        self._last_closed = 0.0  # when the last committed epoch closed here (monotonic)
        self._telling: set[asyncio.Task] = set()

    @property
    def leads(self) -> bool:
        return self.is_leader(self.server.peer_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Feed every epoch if this server leads stage 0; the other stage-0 FS only serve their segments."""
        layout = await self._wait_for_layout(stop)
        if layout is None or not self.leads:
            return
        watching = asyncio.create_task(self.watch.run(stop))
        telling = asyncio.create_task(self._tell_returned(stop))
        try:
            if self.server.config.overlap_epochs:
                await self._feed_overlapped(stop)
            else:
                await self._feed_epochs(stop)
        finally:
            for task in (watching, telling, *self._telling):
                task.cancel()
            await asyncio.gather(watching, telling, *self._telling, return_exceptions=True)

    async def _feed_epochs(self, stop: asyncio.Event) -> None:
        layout = await self._wait_for_layout(stop)
        if layout is None:
            return
        epoch, batch = await self._resume(layout, stop)  # `batch`: how many global batches the swarm trained
        self.plan.fresh = batch * self.microbatches  # policy swarm: a restarted data source lost its retrain queue
        slots: list[Slot] | None = None  # set: an abandoned epoch's data, fed again
        refusals = 0  # epochs refused in a row
        abandoned = self._abandoned
        while batch < self.epochs:
            layout = await self._wait_for_layout(stop)
            if layout is None:
                return
            self.watch.watch(peer for peer, _ in layout.servers())
            await self._tell_abandoned(layout, stop)
            started = time.monotonic()
            if slots is None:
                if self.plan.swarm:
                    await self._collect_dropped(epoch, layout)
                slots = self.plan.slots(epoch, batch)
            else:
                slots = self.plan.refeed(epoch - 1, epoch)
            complete = asyncio.create_task(self._feed(epoch, slots, layout, stop))
            fault = asyncio.create_task(self.watch.fault.wait())
            await asyncio.wait([complete, fault], return_when=asyncio.FIRST_COMPLETED)
            fault.cancel()
            if not complete.done():
                complete.cancel()
                await asyncio.gather(complete, return_exceptions=True)
                abandoned[epoch] = (layout, await self._end(epoch, layout, abandoned=True, stop=stop))
                logger.warning(f"data source: {self.watch.reason} before epoch {epoch} was complete; epoch "
                               f"{epoch} is abandoned, and its batch is fed again as epoch {epoch + 1}")
            elif isinstance(complete.exception(), FeedRefused):
                abandoned[epoch] = (layout, await self._end(epoch, layout, abandoned=True, stop=stop))
                pause = min(REFEED_PAUSE_S[0] * 2 ** refusals, REFEED_PAUSE_S[1])
                refusals += 1
                logger.error(f"data source: {complete.exception()}; epoch {epoch} is abandoned, and its batch is fed "
                             f"again as epoch {epoch + 1} in {pause:.1f} s")
                await asyncio.sleep(pause)
            elif complete.result():
                refusals = 0
                if not await self._commit(Fed(epoch=epoch, batch=batch, layout=layout, started=started), stop):
                    return
                slots = None
                batch += 1
            else:
                return  # stopped
            epoch += 1
        await self._finish()

    async def _feed_overlapped(self, stop: asyncio.Event) -> None:
        """Feed every epoch without a drain at the boundary (module doc): while epoch E's microbatches go out, E - 1
        completes, commits and closes; E + 1 follows once both are done. Fault policy taskpool only (`RunConfig`):
        an abandoned batch is fed again whole."""
        layout = await self._wait_for_layout(stop)
        if layout is None:
            return
        epoch, batch = await self._resume(layout, stop)
        committed, fresh = batch, batch  # global batches trained; the next batch never fed
        again: list[int] = []  # batches of abandoned epochs, fed again first, in order
        closing: Fed | None = None
        refusals = 0
        while committed < self.epochs:
            if fresh < self.epochs or again:
                layout = await self._wait_for_layout(stop)
                if layout is None:
                    return
                servers = {peer for peer, _ in layout.servers()}
                if closing is None:
                    self.watch.watch(servers)
                elif not self.watch.fault.is_set():  # a fault of the completing epoch stays set for the race below
                    self.watch.watch(servers | {peer for peer, _ in closing.layout.servers()})
                await self._tell_abandoned(layout, stop)
                batch = again.pop(0) if again else fresh
                fresh = max(fresh, batch + 1)
                feeding: Fed | None = Fed(epoch=epoch, batch=batch, layout=layout, started=time.monotonic())
                pushing = asyncio.create_task(self._push_all(epoch, self.plan.slots(epoch, batch), layout, stop))
            else:
                feeding, pushing = None, None
            completing = asyncio.create_task(self._complete_and_commit(closing, stop)) if closing else None
            running = [task for task in (pushing, completing) if task is not None]
            fault = asyncio.create_task(self.watch.fault.wait())
            try:
                while not all(task.done() for task in running):
                    await asyncio.wait([*(task for task in running if not task.done()), fault],
                                       return_when=asyncio.FIRST_COMPLETED)
                    if fault.done() or any(task.done() and not task.cancelled() and task.exception() is not None
                                           for task in running):
                        break
            finally:
                fault.cancel()
            failure = self._failure(running)
            if failure is None and not all(task.result() for task in running):
                return  # stopped
            if failure is None:
                refusals = 0
                if closing is not None:
                    committed += 1
                closing, epoch = feeding, epoch + (feeding is not None)
                continue
            # abandon every open epoch the commit did not reach yet, oldest first, and feed their batches again
            if pushing is not None:
                pushing.cancel()
            if completing is not None and not (closing is not None and closing.committed):
                completing.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            if closing is not None and closing.committed:
                committed += 1
            lost = [fed for fed in (closing, feeding) if fed is not None and not fed.committed]
            for fed in lost:
                self._abandoned[fed.epoch] = (fed.layout, await self._end(fed.epoch, fed.layout, abandoned=True,
                                                                          stop=stop))
            again = sorted({*again, *(fed.batch for fed in lost)})
            cause = failure if isinstance(failure, FeedRefused) else f"{self.watch.reason} before it was complete"
            for fed in lost:
                logger.warning(f"data source: {cause}; epoch {fed.epoch} is abandoned, and its batch is fed again")
            if isinstance(failure, FeedRefused):
                pause = min(REFEED_PAUSE_S[0] * 2 ** refusals, REFEED_PAUSE_S[1])
                refusals += 1
                logger.error(f"data source: {failure}; feeding again in {pause:.1f} s")
                await asyncio.sleep(pause)
            closing, epoch = None, epoch + (feeding is not None)
        await self._finish()

    def _failure(self, running: list[asyncio.Task]) -> Exception | None:
        """What ended a round of `_feed_overlapped` early: a refusal (`FeedRefused`), or a fault of the watch."""
        for task in running:
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                if isinstance(error, (FeedRefused, Faulted)):
                    return error
                raise error
        return Faulted(self.watch.reason) if self.watch.fault.is_set() else None

    async def _complete_and_commit(self, fed: Fed, stop: asyncio.Event) -> bool:
        """Wait until every stage-0 FS has all of `fed`'s rows back, then commit it, unless a fault came first
        (`Faulted`); False if stopped."""
        if not await self._complete(fed.epoch, fed.layout, stop):
            return False
        if self.watch.fault.is_set():
            raise Faulted(self.watch.reason)
        return await self._commit(fed, stop)

    async def _commit(self, fed: Fed, stop: asyncio.Event) -> bool:
        """Commit an epoch whose rows are all back at stage 0, wait until it closed here, and count it; False if
        stopped first."""
        fed.committed = True
        self._abandoned.clear()  # this epoch's workers hear of its end from its FS: nobody polls past it
        self._committed = (fed.epoch, fed.layout)
        await self._end(fed.epoch, fed.layout, abandoned=False, batch=fed.batch, stop=stop)
        if not await self._until(lambda: self.server.state.closed_epoch >= fed.epoch, stop):
            return False
        closed = time.monotonic()
        self.progress.epoch_seconds[fed.epoch] = closed - max(fed.started, self._last_closed)
        self._last_closed = closed
        self.progress.retrained[fed.epoch] = self.plan.retrained[fed.epoch]
        if self.held_out is not None and (fed.batch + 1) % self.held_out.every == 0:
            evaluation = asyncio.create_task(self._evaluate(fed.epoch))
            self._evaluations.add(evaluation)
            evaluation.add_done_callback(self._evaluations.discard)
        return True

    async def _finish(self) -> None:
        await asyncio.gather(*self._evaluations)
        if self.at_end is not None:
            await self.at_end()
        self.progress.finished = True
        logger.info(f"data source: all {self.epochs} epochs done")

    async def _tell_abandoned(self, layout: Layout, stop: asyncio.Event) -> None:
        """Tell the servers of `layout` that did not hear of an abandon since the last commit (module doc)."""
        for ended, (ended_layout, heard) in self._abandoned.items():
            unheard = [(peer, role) for peer, role in layout.servers() if peer not in heard]
            if unheard:
                heard |= await self._end(ended, ended_layout, abandoned=True, stop=stop, to=unheard)

    async def _evaluate(self, epoch: int) -> None:
        """The held-out loss of the parameters after `epoch`'s step, through every stage (`server.evaluation`)."""
        total = tokens = 0.0
        try:
            for inputs, labels in self.held_out.windows:
                reply = await self.server.caller.call(
                    self.server.peer_id, STAGE_EVAL, EvalForward(epoch=epoch + 1, stage=0, inputs=inputs,
                                                                 labels=labels),
                    timeout=self.server.settings.rpc_timeout_s)
                total, tokens = total + reply.loss_sum, tokens + reply.tokens
        except Exception as e:  # a server refused or failed: this evaluation is lost, training goes on
            logger.warning(f"data source: evaluating the parameters after epoch {epoch} failed: {e!r}")
            return
        self.progress.eval_loss[epoch] = total / tokens
        logger.info(f"data source: held-out loss after epoch {epoch}: {total / tokens:.4f}")

    async def _feed(self, epoch: int, slots: list[Slot], layout: Layout, stop: asyncio.Event) -> bool:
        """Push the epoch's microbatches (the data of `slots`), then wait until every stage-0 FS has all its rows
        back; False if stopped."""
        return await self._push_all(epoch, slots, layout, stop) and await self._complete(epoch, layout, stop)

    async def _push_all(self, epoch: int, slots: list[Slot], layout: Layout, stop: asyncio.Event) -> bool:
        """Push the epoch's microbatches (the data of `slots`), at most `max_in_flight` at stage 0 at a time; False
        if stopped."""
        for index, slot in enumerate(slots):
            if not await self._until(lambda: self.server.in_flight() < self.max_in_flight, stop):
                return False
            await self._push(epoch, slot, index, layout)
        return True

    async def _complete(self, epoch: int, layout: Layout, stop: asyncio.Event) -> bool:
        """Wait until every stage-0 FS has all the epoch's rows back; False if stopped."""
        state = self.server.state
        if not await self._until(lambda: len(state.completed.get(epoch, ())) >= self.microbatches
                                 or state.closed_epoch >= epoch, stop):
            return False
        for fs in layout.stages[0].fs:
            if fs == self.server.peer_id:
                continue
            while not await self._complete_at(fs, epoch):
                if stop.is_set():
                    return False
                await asyncio.sleep(ASK_EVERY_S)
        return True

    async def _until(self, ready: Callable[[], bool], stop: asyncio.Event) -> bool:
        """Once `ready()` holds of the stage-0 FS's state (True), woken by its progress; False if stopped first."""
        return await self.server.progress.until(ready, stop, check_s=self.server.settings.feeder_poll_s)

    async def _complete_at(self, fs: str, epoch: int) -> bool:
        try:
            state = await self.server.retrying(fs, FRONTAL_SERVER, AskEpoch(epoch=epoch), attempts=None,
                                               what=f"asking about epoch {epoch}")
        except Refused as e:
            raise FeedRefused(f"stage-0 FS {fs} refused to say whether epoch {epoch} is complete: {e}") from None
        return state.complete

    async def _resume(self, layout: Layout, stop: asyncio.Event) -> tuple[int, int]:
        """The epoch and batch to feed first. A data source that restarted finds the swarm further on: it asks
        every server where it stands, ends the last epoch an FS closed again as it ended (the old data source may have
        died telling the others), abandons every epoch after it (their rows died with it), and goes on with the batch
        after the last committed one. Servers save when their own stage steps, so they may restore checkpoints of
        different epochs: within a stage, one that stands further back than a stage mate catches up to it (`catch_up`:
        it takes its mate's newer state, which holders of one stage must share); a whole stage that stands further
        back than the swarm has the epochs between abandoned: it trains on from its newest checkpoint's parameters."""
        servers = layout.servers()

        async def ask(peer: str, role: ServerRole) -> EpochState | None:
            try:
                return await self.server.retrying(peer, SERVICE[role], AskEpoch(epoch=0), attempts=self.server.
                                                  settings.push_attempts, what="asking where the swarm stands")
            except Exception as e:
                logger.warning(f"data source: {peer} did not say where it stands: {e!r}")
                return None

        answers = dict(zip(servers, await asyncio.gather(*(ask(*server) for server in servers))))
        top = max((answer.held_epoch for answer in answers.values() if answer is not None), default=-1)
        if top < 0:
            return 0, 0  # a new swarm
        stands = {peer: answer.closed_epoch for (peer, _), answer in answers.items() if answer is not None}
        state_epochs = {peer: answer.state_epoch for (peer, _), answer in answers.items() if answer is not None}
        for stage in layout.stages:
            mates = [peer for peer in (*stage.fs, *stage.bs) if peer in stands]
            # the last epoch the stage's newest state stepped on (a server closes an epoch before its replica steps)
            newest = max((state_epochs[peer] - 1 for peer in mates), default=-1)
            behind = {peer for peer in mates if stands[peer] < newest}
            if behind:
                await self._end(newest, layout, abandoned=False, caught_up=True, stop=stop, only=behind)
                stands.update(dict.fromkeys(behind, newest))
        fs = {peer: answer for (peer, role), answer in answers.items() if role == "fs" and answer is not None}
        closed = max((stands[peer] for peer in fs), default=-1)
        batch = max((answer.batch for answer in fs.values()), default=-1)
        logger.warning(f"data source: the swarm is at epoch {top} (closed through {closed}, batch {batch}); "
                       f"resuming at epoch {top + 1}, batch {batch + 1}")
        if closed >= 0:
            abandoned = any(answer.abandoned for answer in fs.values() if answer.closed_epoch == closed)
            if not abandoned:
                self._committed = (closed, layout)
            await self._end(closed, layout, abandoned=abandoned, batch=batch, stop=stop)
        for epoch in range(closed + 1, top + 1):
            await self._end(epoch, layout, abandoned=True, stop=stop)
        # a server standing at -1 restored nothing: like any joiner, it stands where its first rows or EndEpoch put it
        # (abandoning every epoch before at it would be refused, and cost an RPC an epoch)
        restored = {peer: stood for peer, stood in stands.items() if stood >= 0}
        for epoch in range(min(restored.values(), default=closed) + 1, closed + 1):
            await self._end(epoch, layout, abandoned=True, stop=stop,
                            only={peer for peer, stood in restored.items() if stood < epoch})
        return top + 1, batch + 1

    async def _end(self, epoch: int, layout: Layout, *, abandoned: bool, stop: asyncio.Event, batch: int = -1,
                   only: set[str] | None = None, caught_up: bool = False,
                   to: list[tuple[str, ServerRole]] | None = None) -> set[str]:
        """Tell the servers of the epoch's layout (those in `only`, if given) that it is committed (every FS, and the
        last stage's BS, which may wait for losses that never come; `batch`: its global batch of data), abandoned
        (every server), or that their stage mates' state stands past it (`caught_up`: every server); a server lost
        for good is skipped. `to`: the servers told instead, of an
        abandon: those that did not hear of it (laid out later, or back from the fault), whose start would otherwise
        stand past it (`StageServer.end_epoch`). The servers that answered."""
        request = EndEpoch(epoch=epoch, abandoned=abandoned, caught_up=caught_up, layout=layout, batch=batch)
        verb = "abandon" if abandoned else "catch up through" if caught_up else "commit"
        targets = to if to is not None else [
            (peer, role) for peer, role in (layout.servers() if abandoned or caught_up else
                                            layout.servers("fs") + [(bs, "bs") for bs in layout.stages[-1].bs])
            if only is None or peer in only]

        async def end(peer: str, role: ServerRole) -> str | None:
            # for the server's process of now: a retry after it restarted would reach its next process, which held
            # nothing of the epoch (a commit there would stand for rows it never reports); `_tell` brings a restarted
            # server up to date instead
            restarts = self.watch.restarts[peer]
            try:
                await self.server.retrying(peer, SERVICE[role], request, attempts=None, what=f"{verb} epoch {epoch}",
                                           moot=lambda: (peer in self.watch.lost or stop.is_set()
                                                         or self.watch.restarts[peer] != restarts))
            except Refused as e:
                logger.error(f"data source: {peer} refused to {verb} epoch {epoch}: {e}")
            except Exception as e:
                logger.warning(f"data source: could not {verb} epoch {epoch} at {peer}, lost or stopping: {e!r}")
                return None
            return peer

        return {peer for peer in await asyncio.gather(*(end(peer, role) for peer, role in targets)) if peer}

    async def _tell_returned(self, stop: asyncio.Event) -> None:
        """Bring each server the watch sees come back up to date, at once and each on its own (a server not yet
        serving is asked again until it serves, or is lost again)."""
        while True:
            peer, restarted = await self.watch.returned.get()
            telling = asyncio.create_task(self._tell(peer, restarted=restarted, stop=stop))
            self._telling.add(telling)
            telling.add_done_callback(self._telling.discard)

    async def _tell(self, peer: str, *, restarted: bool, stop: asyncio.Event) -> None:
        """Tell a server that came back the ends it missed of epochs laid out with it, whose workers may wait for its
        word: if it `restarted`, that its stage stands past the last committed epoch (it closes every epoch through
        it; its replica takes its mates' state); then every abandon since that it did not hear of. (A server laid out
        only later hears of an abandon before its first rows, from `_feed_epochs`.)"""
        def role_in(layout: Layout) -> ServerRole | None:
            return next((role for server, role in layout.servers() if server == peer), None)

        if restarted and self._committed is not None:
            epoch, layout = self._committed
            if (role := role_in(layout)) is not None:
                await self._end(epoch, layout, abandoned=False, caught_up=True, stop=stop, to=[(peer, role)])
        for ended, (ended_layout, heard) in list(self._abandoned.items()):
            if peer not in heard and (role := role_in(ended_layout)) is not None:
                heard |= await self._end(ended, ended_layout, abandoned=True, stop=stop, to=[(peer, role)])

    async def _wait_for_layout(self, stop: asyncio.Event) -> Layout | None:
        waited = 0.0
        while not stop.is_set():
            layout = self._usable(self.layout())
            if layout is not None:
                return layout
            if waited % LAYOUT_NOTICE_EVERY_S < LAYOUT_WAIT_S:
                logger.info("data source: waiting for an FS and a BS in every stage")
            await asyncio.sleep(LAYOUT_WAIT_S)
            waited += LAYOUT_WAIT_S
        return None

    def _usable(self, layout: Layout | None) -> Layout | None:
        """The layout without the servers the watch holds lost (the DHT keeps their records a while), or None if a
        stage then lacks an FS or a BS."""
        if layout is None:
            return None
        def alive(peers: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(peer for peer in peers if peer not in self.watch.lost)

        stages = tuple(StageServers(fs=alive(stage.fs), bs=alive(stage.bs)) for stage in layout.stages)
        return Layout(stages) if all(s.fs and s.bs for s in stages) else None

    async def _collect_dropped(self, epoch: int, layout: Layout) -> None:
        """Fault policy swarm: ask every FS which microbatches of its recent epochs it dropped rows of, and queue
        their data to be fed again."""
        async def ask(fs: str) -> EpochState | None:
            try:
                return await self.server.retrying(fs, FRONTAL_SERVER, AskEpoch(epoch=epoch), attempts=self.server.
                                                  settings.push_attempts, what="asking for dropped microbatches")
            except Exception as e:
                logger.warning(f"data source: {fs} did not say what it dropped: {e!r}")
                return None

        for answer in await asyncio.gather(*(ask(fs) for fs, _ in layout.servers("fs"))):
            for ref in answer.dropped if answer is not None else ():
                if self.plan.dropped(ref.epoch, ref.microbatch):
                    logger.info(f"data source: microbatch {ref.epoch}:{ref.microbatch} lost rows with a vanished "
                                f"worker; its data is fed again")
        self.plan.forget_before(epoch - 2 * self.server.settings.closures_kept)

    async def _push(self, epoch: int, slot: Slot, index: int, layout: Layout) -> None:
        inputs, labels = self.source.microbatch(*slot, self.rows)
        for fs, part in layout.route(0, "fs", Rows(0, self.rows), self.rows):
            window = slice(part.start, part.end)
            request = PushRows(epoch=epoch, microbatch=index, rows=part, total_rows=self.rows, layout=layout,
                               inputs=inputs[window], labels=labels[window])
            try:  # a stage-0 FS takes a repeated push of rows it holds as the same one
                await self.server.retrying(fs, FRONTAL_SERVER, request, attempts=None,
                                           what=f"microbatch {epoch}:{index} rows {part}")
            except Refused as e:
                raise FeedRefused(f"stage-0 FS {fs} refused microbatch {epoch}:{index}: {e}") from None
