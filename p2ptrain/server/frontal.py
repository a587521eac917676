"""The frontal server (FS) of a stage: receives the stage's input rows, hands out forward tasks, collects the
input gradients of the backward pass and passes them to the backward servers of the previous stage.

It keeps each microbatch's inputs until the epoch closes, so a backward task whose worker no longer holds the
forward activations (or another worker's) can be recomputed (paper §3.2.1).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from functools import cached_property

import torch
from hivemind.p2p import P2PContext

from p2ptrain.compression import BadTensorError, check_tensor
from p2ptrain.protocol.layout import Layout
from p2ptrain.protocol.messages import (
    BACKWARD_SERVER,
    FRONTAL_SERVER,
    GRADIENT_DEPOSITS,
    Ack,
    Closure,
    DropResult,
    FetchInputs,
    FetchOutputGrads,
    GlobalNorm,
    GroupMember,
    Inputs,
    MicrobatchRef,
    PushInputGrads,
    PushOutputGrads,
    PushRows,
    ReportGroup,
    ReportNorm,
    ReportTask,
    StageGroups,
    TaskOffer,
    TaskReply,
)
from p2ptrain.protocol.optimization import NormBook
from p2ptrain.protocol.rows import Rows, split_by_compute
from p2ptrain.protocol.sharing import GroupBook
from p2ptrain.protocol.taskpool import Kind, Task
from p2ptrain.server.base import StageServer
from p2ptrain.server.state import FrontalState, MicrobatchInputs, RedoWork, Result
from p2ptrain.transport import Refused, Requests, Responses

logger = logging.getLogger(__name__)


def _covered(parts: list[Rows]) -> int:
    return sum(len(part) for part in parts)


def _overlaps(parts: list[Rows], rows: Rows) -> bool:
    return any(part.intersect(rows) for part in parts)


class FrontalServer(StageServer[FrontalState]):
    """The FS of one stage. Owns its `FrontalState`: the stage inputs of each microbatch it holds (kept for
    recomputation until the epoch closes), the forward tasks it issues, the input gradients that come back, and the
    closure of every epoch with its averaging group. It calls the BS of its own stage (confirmations, refusals)
    and of the previous stage (input gradients); workers only pull from it."""

    role = "fs"
    service = FRONTAL_SERVER
    other_service = BACKWARD_SERVER
    state_type = FrontalState
    closes_by_commit = True

    # -- rows in -----------------------------------------------------------------------------------------------

    def rpc_push_rows(self, requests: Requests, context: P2PContext) -> Responses:
        """Rows of a microbatch from the data source (stage 0) or a backward server of the previous stage."""
        return self.serve(requests, context, PushRows, self.push_rows)

    async def push_rows(self, request: PushRows, sender: str) -> Ack:
        await self.check_authorized(request.layout)
        segment = self.check_layout(request.layout, epoch=request.epoch, microbatch=request.microbatch,
                                    total_rows=request.total_rows)
        if self.is_first:
            self.check_source(sender, request.layout)
        else:
            self.check_peer(sender, request.layout, stage=self.stage - 1, role="bs", what="sender")
        if self.ended(request.epoch):
            raise Refused(f"epoch {request.epoch} ended here")
        key = (request.epoch, request.microbatch)
        rows = request.rows
        try:
            if rows.intersect(segment) != rows:
                raise BadTensorError(f"rows {rows} are not in this server's segment {segment}")
            row_shape = (self.config.seq_len,) if self.is_first else self.hidden_shape
            dtype = torch.int64 if self.is_first else torch.float32
            check_tensor(request.inputs, shape=(len(rows), *row_shape), dtype=dtype, what="stage inputs")
            check_tensor(request.labels, shape=(len(rows), self.config.seq_len), dtype=torch.int64, what="labels")
        except BadTensorError as e:
            raise Refused(str(e)) from None
        mb = self.open_microbatch(*key, lambda: self._new_microbatch(request, segment, row_shape, dtype))
        if _overlaps(mb.received, rows):
            return Ack(again=True)
        mb.inputs[rows.relative_to(segment)] = request.inputs
        mb.labels[rows.relative_to(segment)] = request.labels
        mb.received.append(rows)
        if _covered(mb.received) == len(segment):
            self._make_forward_tasks(request.epoch, request.microbatch, mb)
        return Ack()

    def _new_microbatch(self, request: PushRows, segment: Rows, row_shape: tuple[int, ...],
                        dtype: torch.dtype) -> MicrobatchInputs:
        stats = self.epoch_stats(request.epoch)
        stats.started = stats.started or self.clock()
        return MicrobatchInputs(segment=segment, total_rows=request.total_rows, layout=request.layout,
                                inputs=torch.empty(len(segment), *row_shape, dtype=dtype),
                                labels=torch.empty(len(segment), self.config.seq_len, dtype=torch.int64))

    def _make_forward_tasks(self, epoch: int, index: int, mb: MicrobatchInputs) -> None:
        """Cut the segment at the backward servers' boundaries, then in shares of the known workers' compute."""
        compute = self.active_workers() or {"": 1.0}
        for _, part in mb.layout.route(self.stage, "bs", mb.segment, mb.total_rows):
            for worker, rows in split_by_compute(part, compute):
                self.add_task(Task(task_id=self.new_task_id(epoch, index, "F"), kind=Kind.FORWARD, epoch=epoch,
                                   microbatch=index, rows=rows, preferred=worker or None))
        self.epoch_stats(epoch).rows += len(mb.segment)

    # -- tasks out -----------------------------------------------------------------------------------------------

    def offer(self, task: Task) -> TaskReply:
        mb = self.state.microbatches[(task.epoch, task.microbatch)]
        window = task.rows.relative_to(mb.segment)
        offer = TaskOffer(task=task.task_id, kind=task.kind, epoch=task.epoch, microbatch=task.microbatch,
                          rows=task.rows, total_rows=mb.total_rows, fs=self.peer_id, bs=self._bs_of(mb, task.rows),
                          layout=mb.layout)
        redo = self.state.redo.get(task.task_id)
        return TaskReply(task=offer, closed_epoch=self.state.closed_epoch, inputs=mb.inputs[window],
                         labels=mb.labels[window], grad=None if redo is None else redo.grad)

    def _bs_of(self, mb: MicrobatchInputs, rows: Rows) -> str:
        """The BS that the microbatch's layout routes these rows to: it keeps their output gradients."""
        (bs, _), = mb.layout.route(self.stage, "bs", rows, mb.total_rows)
        return bs

    def gradient_holders(self) -> set[str]:
        return {result.worker for results in self.state.results.values() for result in results} | set(
            self.state.interval_rows)

    def may_work(self, worker: str, epoch: int) -> bool:
        return worker not in self.state.lost.get(epoch, ())  # judged gone: its rows went to others

    def no_task(self, *, epoch: int) -> TaskReply:
        closures = tuple(self.state.closures[epoch] for epoch in sorted(self.state.closures))
        return TaskReply(closed_epoch=self.state.closed_epoch, closures=closures, deposit_to=self._depository(epoch))

    def quiet(self, epoch: int, *, holds_state: bool) -> bool:
        """The worker's epoch is this FS's open one and no row of it is out: with every microbatch this FS received
        done, no backward task of its rows can wait at a BS either, and a replica, which takes no tasks, waits only
        for the epoch's rows to be all back. Rows arriving, the rows all back, or a closure are news."""
        state = self.state
        if epoch != state.closed_epoch + 1 or self.has_all_rows(epoch) or epoch in state.abandoned:
            return False
        return holds_state or (self.in_flight() == 0 and not state.redo)

    def due(self, worker: str, epoch: int) -> bool:
        # its epoch is over here (it steps, catches up or drops it), or it owes its deposit
        return self.ended(epoch) or self.deposit_owed(worker, epoch) is not None

    def deposit_owed(self, worker: str, epoch: int) -> str | None:
        # every row is back and it has not deposited all it holds of this FS's rows (`close_ready` waits for that)
        record = self.state.workers.get(worker)
        depository = self._depository(epoch)
        if record is None or depository is None or record.deposited >= self._rows_held(epoch).get(worker, 0):
            return None
        return depository

    def _rows_held(self, epoch: int) -> dict[str, int]:
        """How many of this FS's rows of `epoch` each worker holds the parameter gradients of (its accepted results)."""
        rows: dict[str, int] = {}
        for result in self.state.results.get(epoch, ()):
            rows[result.worker] = rows.get(result.worker, 0) + len(result.rows)
        return rows

    def _depository(self, epoch: int) -> str | None:
        """Once every row of the open `epoch` is back here, the server its workers deposit their gradients with
        before it counts them ready to average (`close_ready`): the stage's first FS, which closes the epoch for all
        and, being in every round, brings the deposits of groupmates that die in it (`client.averaging`)."""
        if epoch != self.state.closed_epoch + 1 or not self.has_all_rows(epoch) or self.ended(epoch):
            return None
        if self.config.average_every > 1:  # DiLoCo: a worker's part of a round is its own steps' sum, held by it alone
            return None
        layout = self._layout_of(epoch)
        return layout.stages[self.stage].fs[0] if layout is not None else None

    def _layout_of(self, epoch: int) -> Layout | None:
        """The layout `epoch`'s rows came with, while this FS holds some."""
        return next((mb.layout for key, mb in self.state.microbatches.items() if key[0] == epoch), None)

    # -- the global gradient norm (the data source) -----------------------------------------------------------------

    @cached_property
    def norms(self) -> NormBook:
        return NormBook(num_stages=self.config.num_stages, kept=self.settings.closures_kept)

    def rpc_report_norm(self, requests: Requests, context: P2PContext) -> Responses:
        """A stage's squared gradient norm (and overflow) of an epoch; the answer is the global norm (and whether any
        stage overflowed) once every stage reported."""
        return self.serve(requests, context, ReportNorm, self.report_norm)

    async def report_norm(self, request: ReportNorm, sender: str) -> GlobalNorm:
        if self._counts_report(request.stage, sender, what="gradient norms"):
            step = self.norms.report(epoch=request.epoch, stage=request.stage, squared_norm=request.squared_norm,
                                     overflow=request.overflow)
        else:
            step = self.norms.global_step(request.epoch)
        return GlobalNorm() if step is None else GlobalNorm(norm=step.norm, overflow=step.overflow)

    @cached_property
    def groups(self) -> GroupBook:
        return GroupBook(num_stages=self.config.num_stages, kept=self.settings.closures_kept)

    def rpc_report_group(self, requests: Requests, context: P2PContext) -> Responses:
        """A worker's stage group of an epoch, for the rounds across stages that hold the same tensors."""
        return self.serve(requests, context, ReportGroup, self.report_group)

    async def report_group(self, request: ReportGroup, sender: str) -> StageGroups:
        if not self._counts_report(request.group.stage, sender, what="stage groups"):
            return StageGroups(stages=self.groups.groups(request.epoch))
        return StageGroups(stages=self.groups.report(epoch=request.epoch, entry=request.group))

    def _counts_report(self, stage: int, sender: str, *, what: str) -> bool:
        """Whether the data source records `sender`'s report for `stage` (else the sender only reads the answer).
        In a run with an owner, only the stage's servers (in its every group) count: anyone may be a volunteer, and
        the first report of a stage sets what every stage does with it."""
        if not self.is_first:
            raise Refused(f"{what} go to the data source, a stage-0 FS")
        if stage >= self.config.num_stages:
            raise Refused(f"stage {stage} is not in 0..{self.config.num_stages - 1}")
        return self.authority is None or any(self.authority.authorizes(sender, stage, role) for role in ("fs", "bs"))

    def rpc_fetch_inputs(self, requests: Requests, context: P2PContext) -> Responses:
        """The stored inputs of some rows, for a worker that recomputes a forward pass it does not hold."""
        return self.serve(requests, context, FetchInputs, self.fetch_inputs)

    async def fetch_inputs(self, request: FetchInputs, sender: str) -> Inputs:
        mb = self.held(request.epoch, request.microbatch)
        if mb.segment.intersect(request.rows) != request.rows:
            raise Refused(f"rows {request.rows} are not in this server's segment {mb.segment}")
        window = request.rows.relative_to(mb.segment)
        return Inputs(inputs=mb.inputs[window], labels=mb.labels[window])

    # -- results in ----------------------------------------------------------------------------------------------

    def rpc_push_input_grads(self, requests: Requests, context: P2PContext) -> Responses:
        """The result of a backward task: gradients of the stage inputs (none at stage 0), checked, then kept."""
        return self.serve(requests, context, PushInputGrads, self.push_input_grads)

    async def push_input_grads(self, request: PushInputGrads, sender: str) -> Ack:
        self.check_sender(request.worker, sender)
        epoch, rows = request.epoch, request.rows
        if (request.task, request.worker) in self.state.accepted.get(epoch, ()):
            return Ack(again=True)  # a retry after a lost reply: the rows counted once, and the worker must count them
        mb = self.held(epoch, request.microbatch)
        self.check_peer(request.issuer, mb.layout, stage=self.stage, role="bs", what="issuer")
        if request.worker in self.state.lost.get(epoch, ()):
            if self.state.pool.fail(request.task, request.worker) is not None:
                self.news.set()
            raise Refused(f"worker {request.worker} was judged gone in epoch {epoch} and its rows went to others; "
                          "it takes no further part in the epoch")
        redo = self.state.redo.get(request.task)
        try:
            if mb.segment.intersect(rows) != rows:
                raise BadTensorError(f"rows {rows} are not in this server's segment {mb.segment}")
            if not self.is_first:
                check_tensor(request.grad, shape=(len(rows), *self.hidden_shape), dtype=torch.float32,
                             what="input gradients")
            elif request.grad is not None:
                raise BadTensorError("input gradients: stage 0 takes none (its inputs are token ids)")
        except BadTensorError as e:
            await self.refuse_result(task=request.task, worker=request.worker, epoch=epoch, issuer=request.issuer,
                                     error=str(e))
        # a worker killed while its result is confirmed breaks the stream: the issuer counts the task done then, so
        # this server must count the rows too, or they are lost for good (the epoch never closes)
        return await self.unbroken(self._accept(request, mb, redo))

    async def _accept(self, request: PushInputGrads, mb: MicrobatchInputs, redo: RedoWork | None) -> Ack:
        """Confirm the result with its issuer and count its rows; the microbatch finishes once they are all in."""
        if redo is not None:
            return await self._accept_redo(request, redo)
        epoch, rows = request.epoch, request.rows
        await self.confirm_result(request.issuer, task=request.task, worker=request.worker, epoch=epoch,
                                  microbatch=request.microbatch, rows=rows, taken=mb.grads_received)
        if self.ended(epoch):
            raise Refused(f"epoch {epoch} was abandoned while the result was confirmed")
        self._record(request)
        if not self.is_first:
            if mb.grads is None:
                mb.grads = torch.zeros(len(mb.segment), *self.hidden_shape)
            mb.grads[rows.relative_to(mb.segment)] = request.grad
        mb.grads_received.append(rows)
        if _covered(mb.grads_received) == len(mb.segment):
            accepted_at = self.state.workers[request.worker].last_seen
            self.spawn(self._finish_microbatch(epoch, request.microbatch, mb, at=accepted_at),
                       what=f"finishing microbatch {epoch}:{request.microbatch}")
        return Ack()

    def _record(self, request: PushInputGrads) -> None:
        """The worker now holds these rows' parameter gradients: note it, for the averaging group and for a redo."""
        self.see_result(request.worker, epoch=request.epoch, client_mode=request.client_mode)
        self.state.accepted.setdefault(request.epoch, set()).add((request.task, request.worker))
        self.state.results.setdefault(request.epoch, []).append(Result(
            task=request.task, worker=request.worker, microbatch=request.microbatch, rows=request.rows))

    async def _accept_redo(self, request: PushInputGrads, redo: RedoWork) -> Ack:
        """A redo's result: its input gradients went on the first time, so only who holds the rows changes."""
        await self.confirm_result(self.peer_id, task=request.task, worker=request.worker, epoch=request.epoch,
                                  microbatch=request.microbatch, rows=request.rows, taken=[])
        del self.state.redo[request.task]
        self._record(request)
        self.epoch_stats(request.epoch).rows_recomputed += len(request.rows)
        self.close_ready()
        return Ack()

    def tick(self) -> None:
        self.close_ready()

    def settle(self, report: ReportTask, sender: str) -> Ack:
        if (report.task, report.worker) in self.state.accepted.get(report.epoch, ()):
            return Ack(again=True)  # the last stage's BS asking about a loss whose rows this FS accepted
        return super().settle(report, sender)

    def may_complete(self, task: Task, sender: str) -> bool:
        # in the last stage a forward task's result is its input gradients, which this FS accepts itself; the BS
        # only asks whether it did before it counts the loss of those rows. A redo is this FS's alone.
        return (not self.is_last and task.kind != Kind.REDO) or sender == self.peer_id

    async def _finish_microbatch(self, epoch: int, index: int, mb: MicrobatchInputs, *, at: float) -> None:
        """All input gradients of this segment are in (the last one accepted `at`): pass them back, then count the
        microbatch done."""
        if not self.is_first:
            await asyncio.gather(*(
                self.deliver(bs, BACKWARD_SERVER, PushOutputGrads(epoch=epoch, microbatch=index, rows=part,
                                                                  grad=mb.grads[part.relative_to(mb.segment)]),
                             epoch=epoch, what=f"output gradients of {epoch}:{index} rows {part}")
                for bs, part in mb.layout.route(self.stage - 1, "bs", mb.segment, mb.total_rows)))
        if self.ended(epoch):  # abandoned meanwhile
            return
        mb.done = True
        completed = self.state.completed.setdefault(epoch, set())
        completed.add(index)
        if len(completed) == self.config.microbatches:
            # the worker whose result completed the epoch was seen then; every other must poll again
            self.epoch_stats(epoch).completed = at
            self.news.set()
        self.progress.moved()
        self.close_ready()

    def expect_replicas(self, peer_ids: Iterable[str]) -> None:
        """`expect_replica` for each server of the stage that announced it holds the state and has not polled here
        yet, so that a BS's replica is in the averaging group from the first epoch (the data source may feed it
        before the replica found this FS). One that went silent is not waited for again while its record stays."""
        for peer_id in peer_ids:
            if peer_id not in self.state.workers:
                self.expect_replica(peer_id)

    def close_ready(self) -> None:
        """Close every epoch whose rows are all back and which the data source committed (`EndEpoch`: so no
        stage steps on an epoch that a server fault may still abandon), once each worker heard from lately (some hold
        its parameter gradients) is known to be alive (it polled since the rows were all back, and one that holds rows
        deposited their gradients) or gone (`gone`: silent for `worker_lost_s`, or not reachable by a probe; left, or
        banned; or no deposit within `averaging_timeout_s`);
        the rows of the gone ones are redone by others first, so every row reaches the average exactly once
        (docs/design.md §5). The averaging group is every worker that polled since, from this epoch or the one before, and is
        not excluded."""
        state, settings = self.state, self.settings
        while True:
            epoch = state.closed_epoch + 1
            if epoch in state.abandoned:
                state.closures[epoch] = Closure(epoch=epoch, fs=state.abandoned[epoch], group=(), abandoned=True)
                state.closures.pop(epoch - settings.closures_kept, None)
                self.close_epoch(epoch)
                continue
            if len(state.completed.get(epoch, ())) < self.config.microbatches or epoch not in state.committed:
                return
            if any(work.task.epoch == epoch for work in state.redo.values()):
                return
            done = self.epoch_stats(epoch).completed
            layout = self._layout_of(epoch)
            judged_gone = state.lost.get(epoch, set())
            fresh = {w for w, record in state.workers.items()
                     if record.last_seen >= done and not self.excluded(record) and w not in judged_gone}
            contributors = {result.worker for result in state.results.get(epoch, ())}
            holders = {w for w, record in state.workers.items() if record.holds_state}
            # with several FS in the stage, any worker heard from lately may hold rows of another FS's segment, and
            # all FS must agree on who is alive (the first one's group is averaged); with one FS, its contributors
            # alone matter, so churn among the others never holds the epoch open. The servers that hold the stage's
            # state must be in every group, or they would fall behind the workers
            watched = contributors | holders | (set(state.workers) if len(layout.stages[self.stage].fs) > 1 else set())
            # DiLoCo: a worker with rows earlier in the interval holds its steps' sum even if it took none of this
            # epoch's; left out of the closure, its part of the round would be lost while it lives
            watched |= set(state.interval_rows)
            # one judged gone in this epoch had its rows here redone by others and takes no further part in it here;
            # should it poll again (it was only silent), waiting for it would hold the epoch open for good
            watched -= judged_gone
            if any(not self.excluded(state.workers[w]) and not self.gone(w) for w in watched - fresh):
                return  # a worker that has not polled since: the next polls here tell whether it is gone
            # a worker one epoch behind steps that one when this poll's reply tells it closed, then this one; one
            # further behind (it joined, or restarted and lost what it held) catches up by loading a mate's state and
            # would never take part in this round: in the group it would hold every member until the timeout. So does
            # one behind by an epoch that closed here without a group (this server stood past it: it caught up to its
            # mates' newer checkpoint, or restarted), as a server's replica restored from an older checkpoint does
            stepped_last = epoch - 1 in state.closures
            ready = {w for w in fresh
                     if state.workers[w].epoch >= epoch or (state.workers[w].epoch == epoch - 1 and stepped_last)}
            rows = self._rows_held(epoch)
            lost = contributors - ready
            if not lost and self.config.average_every == 1:
                # a contributor is ready only once its gradients are deposited (`_depository`): a worker that then
                # dies in the round loses nothing; one that dies before is gone before the closure, its rows redone
                undeposited = {w for w in contributors
                               if state.workers[w].epoch != epoch or state.workers[w].deposited < rows[w]}
                # a deposit still arriving on a slow link is heard (`heard`): only one that stopped moving counts
                lost = {w for w in undeposited
                        if self.clock() - max(done, state.workers[w].last_result, self.hearing.last(w, GRADIENT_DEPOSITS))
                        >= settings.averaging_timeout_s}
                if undeposited - lost:
                    return
                for worker in lost:
                    logger.warning(f"{self.name}: worker {worker} deposited no gradients of epoch {epoch}, and sent "
                                   f"nothing for {settings.averaging_timeout_s:.0f} s; counting it gone")
            if not lost and len(ready) > 1 and all(state.workers[w].client_mode for w in ready):
                return  # nobody in the group could reduce: the servers' replicas, reachable, are in every group
            if lost and self.config.fault_policy == "swarm":
                self._drop(epoch, lost)
                continue
            if lost:
                self._redo(epoch, lost)
                return
            if self.config.average_every > 1:
                # DiLoCo: between rounds each worker steps on its own rows; a round weighs its part by all of them
                rows = {worker: state.interval_rows.get(worker, 0) + rows.get(worker, 0) for worker in ready}
                state.interval_rows = {} if self.config.averages_at(epoch) else rows
            state.closures[epoch] = Closure(
                epoch=epoch, fs=layout.stages[self.stage].fs,
                # servers that hold the state can be dialed: a group of survivors, or of workers that all dial out
                # only, still has a reducer (`client.averaging.reducer_modes`)
                group=tuple(GroupMember(peer_id=w, client_mode=state.workers[w].client_mode, rows=rows.get(w, 0))
                            for w in sorted(ready)))
            state.closures.pop(epoch - settings.closures_kept, None)
            state.accepted.pop(epoch - settings.closures_kept, None)
            state.completed.pop(epoch, None)
            state.committed.discard(epoch)
            state.dropped.pop(epoch - settings.closures_kept, None)
            state.lost.pop(epoch, None)
            self.epoch_stats(epoch).rows_grouped = sum(len(r.rows) for r in state.results.pop(epoch, ()))
            self.close_epoch(epoch)

    def resume(self, *, epoch: int, batch: int) -> None:
        super().resume(epoch=epoch, batch=batch)
        self.state.batch = batch

    def commit(self, epoch: int, *, batch: int, layout: Layout) -> Ack:
        self.state.batch = max(self.state.batch, batch)
        if self.ended(epoch):
            return Ack(again=True)
        if epoch not in self.state.committed:  # tells, if this FS dies before it closes the epoch, what it never reports
            logger.info(f"{self.name}: epoch {epoch} committed")
        self.state.committed.add(epoch)
        self.close_ready()
        return Ack()

    def has_all_rows(self, epoch: int) -> bool:
        return len(self.state.completed.get(epoch, ())) == self.config.microbatches

    def committed_batch(self) -> int:
        return self.state.batch

    def drop_epoch(self, epoch: int) -> None:
        state = self.state
        for table in (state.completed, state.results, state.accepted):
            table.pop(epoch, None)
        state.committed.discard(epoch)
        state.lost.pop(epoch, None)
        for task_id in [task_id for task_id, work in state.redo.items() if work.task.epoch == epoch]:
            del state.redo[task_id]

    def dropped_microbatches(self) -> tuple[MicrobatchRef, ...]:
        return tuple(MicrobatchRef(epoch=epoch, microbatch=index)
                     for epoch, indices in sorted(self.state.dropped.items()) for index in sorted(indices))

    def _take_back(self, epoch: int, lost: set[str], *, then: str) -> list[Result]:
        """The results of `epoch` whose parameter gradients `lost` workers took with them, no longer counted; those
        workers take no further part in the epoch here, and their leases go back to the pool."""
        state = self.state
        kept, gone = [], []
        for result in state.results.get(epoch, []):
            (gone if result.worker in lost else kept).append(result)
        state.results[epoch] = kept
        state.lost.setdefault(epoch, set()).update(lost)
        self.epoch_stats(epoch).workers_lost += len(lost)
        logger.warning(f"{self.name}: worker(s) {sorted(lost)} gone with the parameter gradients of "
                       f"{sum(len(r.rows) for r in gone)} rows of epoch {epoch}; {then}")
        for worker in lost:
            state.pool.requeue_worker(worker)
        return gone

    def _drop(self, epoch: int, lost: set[str]) -> None:
        """SWARM's way (fault policy swarm): the rows whose parameter gradients `lost` workers took are not redone;
        the stage averages without them, and the data source feeds their microbatches again from stage 0 in a later
        epoch (it asks for `dropped_microbatches`)."""
        gone = self._take_back(epoch, lost, then="dropping them (fault policy swarm)")
        self.epoch_stats(epoch).rows_dropped += sum(len(r.rows) for r in gone)
        self.state.dropped.setdefault(epoch, set()).update(r.microbatch for r in gone)
        if not self.is_last:
            return
        for result in gone:  # the BS waits for every row's loss, and a gone worker may not have sent it
            mb = self.state.microbatches[(epoch, result.microbatch)]
            request = DropResult(task=result.task, worker=result.worker, epoch=epoch, microbatch=result.microbatch,
                                 rows=result.rows, total_rows=mb.total_rows, layout=mb.layout)
            self.spawn(self.retrying(self._bs_of(mb, result.rows), BACKWARD_SERVER, request, attempts=None,
                                     what=f"dropping {result.task} at its BS"), what=f"drop {result.task}")

    def _redo(self, epoch: int, lost: set[str]) -> None:
        """Hand the rows whose parameter gradients `lost` workers took with them to other workers."""
        state = self.state
        for result in self._take_back(epoch, lost, then="redoing them"):
            state.accepted.get(epoch, set()).discard((result.task, result.worker))
            task = Task(task_id=self.new_task_id(epoch, result.microbatch, "R"), kind=Kind.REDO, epoch=epoch,
                        microbatch=result.microbatch, rows=result.rows)
            state.redo[task.task_id] = RedoWork(task=task)
            if self.is_last:
                self.state.pool.add(task, again=True)
                self.news.set()
            else:  # from the BS that keeps the rows' output gradients (a redo's result came from this FS's own task)
                bs = self._bs_of(state.microbatches[(epoch, result.microbatch)], result.rows)
                self.spawn(self._fetch_output_grads(task, bs=bs), what=f"redo {task.task_id}")

    async def _fetch_output_grads(self, task: Task, *, bs: str) -> None:
        """Fetch a redo's output gradients from the BS that keeps them, then hand the task out."""
        request = FetchOutputGrads(epoch=task.epoch, microbatch=task.microbatch, rows=task.rows)
        try:
            reply = await self.retrying(bs, BACKWARD_SERVER, request, attempts=None,
                                        what=f"fetching output gradients for {task.task_id}",
                                        moot=lambda: self.ended(task.epoch))
        except Refused as e:
            logger.error(f"{self.name}: {bs} has no output gradients for {task.task_id}, which cannot be redone: {e}")
            return
        except Exception as e:
            logger.info(f"{self.name}: epoch {task.epoch} ended here; redo {task.task_id} dropped ({e!r})")
            return
        if task.task_id not in self.state.redo:  # the epoch was abandoned meanwhile
            return
        self.state.redo[task.task_id].grad = reply.grad
        self.state.pool.add(task, again=True)
        self.news.set()

    def in_flight(self) -> int:
        return sum(1 for mb in self.state.microbatches.values() if not mb.done)
