"""The backward server (BS) of a stage: collects the workers' output rows into its ledger, assembles its segment
and sends it on to the frontal servers of the next stage; in the backward pass it cuts the incoming output
gradients along the ledger into backward tasks, each meant for the worker that did those forward rows.

In the last stage the workers compute the loss and backward at once; the BS then only records the loss rows. The FS
completed such a task when it accepted the input gradients, before the loss comes here: an FS killed in between
cannot confirm the loss, and a worker killed in between sends none. The data source's commit of the epoch proves
every row passed its FS: the BS counts rows held for a gone issuer then, without the loss it could not confirm, and
closes an epoch committed `worker_lost_s` ago without the losses still missing (else the epoch, and every one after,
never closed here).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from hivemind.p2p import P2PContext

from p2ptrain.compression import BadTensorError, check_tensor
from p2ptrain.protocol.layout import Layout
from p2ptrain.protocol.messages import (
    BACKWARD_SERVER,
    FRONTAL_SERVER,
    Ack,
    DropResult,
    FetchOutputGrads,
    OutputGrads,
    PushOutputGrads,
    PushOutputs,
    PushRows,
    TaskOffer,
    TaskReply,
)
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.taskpool import Kind, Task
from p2ptrain.server.base import IssuerUnreachable, StageServer
from p2ptrain.server.state import BackwardState, BackwardWork, EpochProgress, KeptGrads, MicrobatchOutputs
from p2ptrain.transport import Forbidden, Refused, Requests, Responses

logger = logging.getLogger(__name__)


class BackwardServer(StageServer[BackwardState]):
    """The BS of one stage. Owns its `BackwardState`: the ledger of which worker produced which rows, the output
    rows it assembles, and the backward tasks it issues with their output gradients. It calls the FS of its own
    stage (confirmations, refusals) and of the next stage (assembled rows); workers only pull from it."""

    role = "bs"
    service = BACKWARD_SERVER
    other_service = FRONTAL_SERVER
    state_type = BackwardState

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # the last stage: when this process learnt that an epoch not closed here was committed (`tick`)
        self._committed_at: dict[int, float] = {}

    # -- forward results in --------------------------------------------------------------------------------------

    def rpc_push_outputs(self, requests: Requests, context: P2PContext) -> Responses:
        """A worker's forward result: output rows (or, in the last stage, their summed loss)."""
        return self.serve(requests, context, PushOutputs, self.push_outputs)

    async def push_outputs(self, request: PushOutputs, sender: str) -> Ack:
        self.check_sender(request.worker, sender)
        await self.check_authorized(request.layout)
        epoch, index, rows = request.epoch, request.microbatch, request.rows
        if self.ended(epoch):  # a retry whose first push got through (counted already), or an abandoned epoch
            raise Refused(f"duplicate or late: epoch {epoch} ended here")
        segment = self.check_layout(request.layout, epoch=epoch, microbatch=index, total_rows=request.total_rows)
        if self.state.ledger.holds(epoch=epoch, microbatch=index, task_id=request.task, worker=request.worker):
            return Ack(again=True)  # a push repeated after its reply was lost
        self.check_peer(request.fs, request.layout, stage=self.stage, role="fs", what="issuer")
        try:
            if rows.intersect(segment) != rows:
                raise BadTensorError(f"rows {rows} are not in this server's segment {segment}")
            if self.is_last:
                check_tensor(request.loss, shape=(), dtype=torch.float32, what="loss")
            else:
                check_tensor(request.outputs, shape=(len(rows), *self.hidden_shape), dtype=torch.float32,
                             what="stage outputs")
                check_tensor(request.labels, shape=(len(rows), self.config.seq_len), dtype=torch.int64,
                             what="labels")
        except BadTensorError as e:
            # a forward task of the last stage was completed by its FS already, when it accepted the input gradients
            await self.refuse_result(task=request.task, worker=request.worker, epoch=epoch,
                                     issuer=None if self.is_last else request.fs, error=str(e))
        # a worker killed while its result is confirmed breaks the stream: the issuer counts the task done then, so
        # this server must count the rows too, or they are lost for good (the epoch never closes)
        return await self.unbroken(self._accept(request, segment))

    async def _accept(self, request: PushOutputs, segment: Rows) -> Ack:
        """Confirm the result with its issuer and count its rows; the segment goes on once they are all in. The last
        stage: a loss whose issuer is gone is held (no other result takes its rows), and its rows count without it
        once the data source commits the epoch (`commit`), at once if it did already."""
        epoch, index, rows = request.epoch, request.microbatch, request.rows
        ledger = self.state.ledger
        unconfirmed = None
        try:
            await self.confirm_result(request.fs, task=request.task, worker=request.worker, epoch=epoch,
                                      microbatch=index, rows=rows, taken=ledger.rows(epoch=epoch, microbatch=index))
        except IssuerUnreachable as e:
            if not self.is_last:
                raise
            if rows.intersect(request.layout.segment(self.stage, "fs", request.fs, request.total_rows)) != rows:
                raise Refused(f"rows {rows} are not {request.fs}'s to issue: {e}") from None
            unconfirmed = str(e)
        if self.ended(epoch):
            raise Refused(f"epoch {epoch} was abandoned while the result was confirmed")
        if ledger.holds(epoch=epoch, microbatch=index, task_id=request.task, worker=request.worker):
            return Ack(again=True)  # its FS dropped the result meanwhile (`drop_result`), and it counted then
        mb = self.open_microbatch(epoch, index, lambda: MicrobatchOutputs(segment=segment,
                                                                          total_rows=request.total_rows,
                                                                          layout=request.layout))
        ledger.record(epoch=epoch, microbatch=index, worker=request.worker, rows=rows, task_id=request.task)
        stats = self.epoch_stats(epoch)
        stats.rows += len(rows)
        progress = self._progress(epoch)
        if unconfirmed is None or progress.committed:
            progress.rows_recorded += len(rows)
        else:
            progress.rows_unconfirmed += len(rows)
        if unconfirmed is not None:
            logger.warning(f"{self.name}: rows {rows} of {epoch}:{index} from {request.worker} count without their "
                           f"loss once the data source commits the epoch{' (it did)' if progress.committed else ''}: "
                           f"{unconfirmed}")
        if self.is_last:
            if unconfirmed is None:
                stats.loss_sum += float(request.loss)
                stats.tokens += len(rows) * self.config.seq_len
            self.close_ready()
            return Ack()
        if mb.outputs is None:
            mb.outputs = torch.empty(len(mb.segment), *self.hidden_shape)
            mb.labels = torch.empty(len(mb.segment), self.config.seq_len, dtype=torch.int64)
        window = rows.relative_to(mb.segment)
        mb.outputs[window] = request.outputs
        mb.labels[window] = request.labels
        if ledger.covered(epoch=epoch, microbatch=index) == len(mb.segment):
            self.spawn(self._forward(epoch, index, mb), what=f"forwarding microbatch {epoch}:{index}")
        return Ack()

    def commit(self, epoch: int, *, batch: int, layout: Layout) -> Ack:
        """The last stage: every row of `epoch` passed its FS; those held for an issuer that is gone count now, and
        every microbatch is held, so that the epoch may close without the losses that never come (`tick`)."""
        if self.is_last and not self.ended(epoch):
            segment = self.check_layout(layout, epoch=epoch, microbatch=0, total_rows=self.config.rows_per_microbatch)
            for index in range(self.config.microbatches):
                self.open_microbatch(epoch, index, lambda: MicrobatchOutputs(
                    segment=segment, total_rows=self.config.rows_per_microbatch, layout=layout))
            progress = self._progress(epoch)
            progress.committed = True
            progress.rows_recorded += progress.rows_unconfirmed
            progress.rows_unconfirmed = 0
            self.close_ready()
            if not self.ended(epoch):
                self._committed_at.setdefault(epoch, self.clock())
        return Ack()

    def tick(self) -> None:
        """The last stage: an epoch the data source committed `worker_lost_s` ago closes without the losses still
        missing (their workers were killed after their FS accepted the input gradients)."""
        if not self.is_last:
            return
        now = self.clock()
        for epoch in [epoch for epoch in self._committed_at if epoch <= self.state.closed_epoch]:
            del self._committed_at[epoch]
        while True:
            epoch = self.state.closed_epoch + 1
            progress = self.state.progress.get(epoch)
            if progress is None or not progress.committed:
                return
            # from a restored state, the grace starts when this process first looks
            since = now - self._committed_at.setdefault(epoch, now)
            if since < self.settings.worker_lost_s:
                return
            expected = sum(len(mb.segment) for key, mb in self.state.microbatches.items() if key[0] == epoch)
            logger.warning(f"{self.name}: epoch {epoch} closes without the loss of {expected - progress.rows_recorded} "
                           f"of its rows: committed {since:.0f} s ago, they never came")
            progress.rows_recorded = expected
            self.close_ready()
            if self.state.closed_epoch < epoch:
                return

    def rpc_drop_result(self, requests: Requests, context: P2PContext) -> Responses:
        """From an FS of this stage, the last (fault policy swarm): a gone worker's result is dropped, not redone."""
        return self.serve(requests, context, DropResult, self.drop_result)

    async def drop_result(self, request: DropResult, sender: str) -> Ack:
        if not self.is_last:
            raise Refused("only the last stage's BS waits for the loss of a result")
        await self.check_authorized(request.layout)
        epoch, index, rows = request.epoch, request.microbatch, request.rows
        if self.ended(epoch):
            return Ack(again=True)
        segment = self.check_layout(request.layout, epoch=epoch, microbatch=index, total_rows=request.total_rows)
        self.check_peer(sender, request.layout, stage=self.stage, role="fs", what="sender")
        ledger = self.state.ledger
        if ledger.holds(epoch=epoch, microbatch=index, task_id=request.task, worker=request.worker):
            return Ack(again=True)  # its loss came before the worker vanished
        if rows.intersect(segment) != rows or any(part.intersect(rows) for part in ledger.rows(epoch=epoch,
                                                                                               microbatch=index)):
            raise Refused(f"rows {rows} of {epoch}:{index} are not this server's, or another result's")
        self.open_microbatch(epoch, index, lambda: MicrobatchOutputs(segment=segment, total_rows=request.total_rows,
                                                                     layout=request.layout))
        ledger.record(epoch=epoch, microbatch=index, worker=request.worker, rows=rows, task_id=request.task)
        self._progress(epoch).rows_recorded += len(rows)  # counted through, with no loss
        self.close_ready()
        return Ack()

    def _progress(self, epoch: int) -> EpochProgress:
        return self.state.progress.setdefault(epoch, EpochProgress())

    async def _forward(self, epoch: int, index: int, mb: MicrobatchOutputs) -> None:
        """The segment is complete: send it to the next stage's frontal servers, segmented over them."""
        outputs, labels = mb.outputs, mb.labels
        mb.outputs, mb.labels = None, None  # the pushes below hold their rows; nothing else needs them
        await asyncio.gather(*(
            self.deliver(fs, FRONTAL_SERVER, PushRows(epoch=epoch, microbatch=index, rows=part,
                                                      total_rows=mb.total_rows, layout=mb.layout,
                                                      inputs=outputs[part.relative_to(mb.segment)],
                                                      labels=labels[part.relative_to(mb.segment)]),
                         epoch=epoch, what=f"rows {part} of {epoch}:{index}")
            for fs, part in mb.layout.route(self.stage + 1, "fs", mb.segment, mb.total_rows)))

    # -- backward tasks out --------------------------------------------------------------------------------------

    def rpc_push_output_grads(self, requests: Requests, context: P2PContext) -> Responses:
        """Gradients of this stage's outputs from a frontal server of the next stage: cut them by the ledger."""
        return self.serve(requests, context, PushOutputGrads, self.push_output_grads)

    async def push_output_grads(self, request: PushOutputGrads, sender: str) -> Ack:
        if self.is_last:
            raise Refused("the last stage computes its own output gradients")
        epoch, index, rows = request.epoch, request.microbatch, request.rows
        mb = self.held(epoch, index)
        self.check_peer(sender, mb.layout, stage=self.stage + 1, role="fs", what="sender")
        if mb.segment.intersect(rows) != rows:
            raise Refused(f"rows {rows} of microbatch {epoch}:{index} are not held here")
        if any(part.intersect(rows) for part in mb.grads_received):
            if rows in mb.grads_received:
                return Ack(again=True)  # a push repeated after its reply was lost: its tasks exist already
            raise Refused(f"output gradients of rows {rows} of {epoch}:{index} overlap ones received already")
        try:
            check_tensor(request.grad, shape=(len(rows), *self.hidden_shape), dtype=torch.float32,
                         what="output gradients")
            entries = self.state.ledger.split(epoch=epoch, microbatch=index, rows=rows)
        except (BadTensorError, KeyError) as e:
            raise Refused(str(e)) from None
        kept = self.state.kept_grads.get((epoch, index))
        if kept is None:
            kept = self.state.kept_grads[(epoch, index)] = KeptGrads(
                segment=mb.segment, grad=torch.zeros(len(mb.segment), *self.hidden_shape),
                fs=mb.layout.stages[self.stage].fs)
        kept.grad[rows.relative_to(mb.segment)] = request.grad
        for entry in entries:
            task = Task(task_id=self.new_task_id(epoch, index, "B"), kind=Kind.BACKWARD, epoch=epoch, microbatch=index,
                        rows=entry.rows, preferred=entry.worker)
            self.state.work[task.task_id] = BackwardWork(task=task, grad=request.grad[entry.rows.relative_to(rows)]
                                                         .clone(), forward_task=entry.task_id)
            self.add_task(task)
        mb.grads_received.append(rows)
        return Ack()

    def rpc_fetch_output_grads(self, requests: Requests, context: P2PContext) -> Responses:
        """The output gradients of some rows, for an FS that redoes the rows of a vanished worker."""
        return self.serve(requests, context, FetchOutputGrads, self.fetch_output_grads)

    async def fetch_output_grads(self, request: FetchOutputGrads, sender: str) -> OutputGrads:
        kept = self.state.kept_grads.get((request.epoch, request.microbatch))
        if kept is not None and sender not in kept.fs:
            raise Forbidden(f"{sender} is no FS of stage {self.stage} for microbatch {request.epoch}:"
                            f"{request.microbatch}")
        if kept is None or kept.segment.intersect(request.rows) != request.rows:
            raise Refused(f"no output gradients of rows {request.rows} of {request.epoch}:{request.microbatch} here")
        return OutputGrads(grad=kept.grad[request.rows.relative_to(kept.segment)])

    def offer(self, task: Task) -> TaskReply:
        mb = self.state.microbatches[(task.epoch, task.microbatch)]
        (fs, _), = mb.layout.route(self.stage, "fs", task.rows, mb.total_rows)
        work = self.state.work[task.task_id]
        offer = TaskOffer(task=task.task_id, kind=task.kind, epoch=task.epoch, microbatch=task.microbatch,
                          rows=task.rows, total_rows=mb.total_rows, fs=fs, bs=self.peer_id, layout=mb.layout,
                          forward_task=work.forward_task)
        return TaskReply(task=offer, closed_epoch=self.state.closed_epoch, grad=work.grad)

    def completed(self, task: Task) -> None:
        del self.state.work[task.task_id]
        self._progress(task.epoch).rows_backward += len(task.rows)
        self.close_ready()

    def drop_epoch(self, epoch: int) -> None:
        state = self.state
        state.ledger.forget_epoch(epoch)
        state.progress.pop(epoch, None)
        for task_id in [task_id for task_id, work in state.work.items() if work.task.epoch == epoch]:
            del state.work[task_id]
        for key in [key for key in state.kept_grads if key[0] == epoch]:
            del state.kept_grads[key]

    def close_ready(self) -> None:
        """An epoch closes here when every row of its segment has done its backward (or, last stage, its loss)."""
        while True:
            epoch = self.state.closed_epoch + 1
            if epoch in self.state.abandoned:
                self.close_epoch(epoch)
                continue
            keys = [key for key in self.state.microbatches if key[0] == epoch]
            if len(keys) < self.config.microbatches:
                return
            expected = sum(len(self.state.microbatches[key].segment) for key in keys)
            progress = self._progress(epoch)
            if (progress.rows_recorded if self.is_last else progress.rows_backward) < expected:
                return
            self.state.ledger.forget_epoch(epoch)
            self.state.progress.pop(epoch, None)
            for key in [key for key in self.state.kept_grads if key[0] <= epoch - self.settings.closures_kept]:
                del self.state.kept_grads[key]
            self.close_epoch(epoch)
