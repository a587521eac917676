"""The backward server (BS) of a stage: collects the workers' output rows into its ledger, assembles its segment
and sends it on to the frontal servers of the next stage; in the backward pass it cuts the incoming output
gradients along the ledger into backward tasks, each meant for the worker that did those forward rows.

In the last stage the workers compute the loss and backward at once; the BS then only records the loss rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from p2ptrain.compression import BadTensorError, check_tensor
from p2ptrain.layout import Layout
from p2ptrain.protocol.ledger import Ledger
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.taskpool import Kind, Task
from p2ptrain.server.base import StageServer
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.transport import Message

logger = logging.getLogger(__name__)


@dataclass
class MicrobatchOutputs:
    segment: Rows
    total_rows: int
    layout: Layout
    outputs: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    forwarded: bool = False
    backward_rows: int = 0


@dataclass
class BackwardWork:
    task: Task
    grad: torch.Tensor
    forward_task: str


@dataclass
class EpochProgress:
    rows_recorded: int = 0
    rows_backward: int = 0
    microbatches: set[int] = field(default_factory=set)


class BackwardServer(StageServer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ledger = Ledger()
        self.microbatches: dict[tuple[int, int], MicrobatchOutputs] = {}
        self.work: dict[str, BackwardWork] = {}
        self.microbatches_per_epoch: int | None = None
        self.progress: dict[int, EpochProgress] = {}
        self.closed_epoch = -1
        self._task_counter = 0

    def _microbatch(self, header: dict) -> tuple[tuple[int, int], MicrobatchOutputs]:
        key = (header["epoch"], header["microbatch"])
        layout = Layout.from_header(header["layout"])
        self.microbatches_per_epoch = header["microbatches_per_epoch"]
        mb = self.microbatches.get(key)
        if mb is None:
            if self.closed_epoch < 0 and not self.microbatches:
                self.closed_epoch = key[0] - 1  # joined a running swarm: earlier epochs never come here
            segment = layout.bs_segment(self.stage, self.peer_id, header["total_rows"])
            mb = self.microbatches[key] = MicrobatchOutputs(segment=segment, total_rows=header["total_rows"], layout=layout)
        return key, mb

    async def rpc_push_outputs(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A worker's forward result: output rows (or, in the last stage, their summed loss)."""
        message = await self.read(requests)
        header = message.header
        worker, task_id = header["worker"], header["task"]
        rows = Rows(*header["rows"])
        if header["epoch"] <= self.closed_epoch:  # a retry whose first push got through: counted already
            async for response in self.stream(self.reply({"accepted": False, "error": "duplicate"})):
                yield response
            return
        key, mb = self._microbatch(header)
        try:
            if mb.segment.intersect(rows) != rows:
                raise BadTensorError(f"rows {rows} are not in this server's segment {mb.segment}")
            if self.is_last:
                loss = message.tensors.get("loss")
                check_tensor(loss, shape=(), dtype=torch.float32, what="loss")
            else:
                check_tensor(message.tensors.get("outputs"), shape=(len(rows), self.seq_len, self.hidden_size),
                             dtype=torch.float32, what="stage outputs")
                check_tensor(message.tensors.get("labels"), shape=(len(rows), self.seq_len), dtype=torch.int64,
                             what="labels")
        except BadTensorError as e:
            if not self.is_last:
                await self._report(header["fs"], task_id, worker, ok=False)
            async for response in self.stream(self.refuse(worker, task_id, str(e))):
                yield response
            return
        if not self.ledger.record(epoch=key[0], microbatch=key[1], worker=worker, rows=rows, task_id=task_id):
            async for response in self.stream(self.reply({"accepted": False, "error": "duplicate"})):
                yield response
            return
        stats = self.epoch_stats(key[0])
        progress = self._progress(key[0])
        progress.rows_recorded += len(rows)
        if self.is_last:
            stats.loss_sum += float(message.tensors["loss"])
            stats.tokens += len(rows) * self.seq_len
            stats.rows += len(rows)
            self._maybe_close_epochs()
        else:
            if mb.outputs is None:
                mb.outputs = torch.empty(len(mb.segment), self.seq_len, self.hidden_size)
                mb.labels = torch.empty(len(mb.segment), self.seq_len, dtype=torch.int64)
            window = rows.relative_to(mb.segment)
            mb.outputs[window] = message.tensors["outputs"]
            mb.labels[window] = message.tensors["labels"]
            stats.rows += len(rows)
            await self._report(header["fs"], task_id, worker, ok=True)
        async for response in self.stream(self.reply({"accepted": True})):
            yield response
        if not self.is_last and self.ledger.covered(epoch=key[0], microbatch=key[1]) == len(mb.segment):
            await self._forward(key, mb)

    def _progress(self, epoch: int) -> EpochProgress:
        return self.progress.setdefault(epoch, EpochProgress())

    async def _forward(self, key: tuple[int, int], mb: MicrobatchOutputs) -> None:
        """The segment is complete: send it to the next stage's frontal servers, segmented over them."""
        for fs, part in mb.layout.route_to_fs(self.stage + 1, mb.segment, mb.total_rows):
            window = part.relative_to(mb.segment)
            message = Message(
                {"epoch": key[0], "microbatch": key[1], "rows": [part.start, part.end], "total_rows": mb.total_rows,
                 "layout": mb.layout.to_header(), "microbatches_per_epoch": self.microbatches_per_epoch},
                {"inputs": mb.outputs[window], "labels": mb.labels[window]},
            )
            reply = await self.caller.call(fs, FrontalServer, "rpc_push_rows", message)
            if not reply.header.get("accepted"):
                logger.error(f"stage {self.stage} BS: stage {self.stage + 1} FS {fs} refused rows: {reply.header}")
        mb.forwarded, mb.outputs, mb.labels = True, None, None

    async def rpc_push_output_grads(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Gradients of this stage's outputs from a frontal server of the next stage: cut them by the ledger."""
        message = await self.read(requests)
        header = message.header
        key = (header["epoch"], header["microbatch"])
        rows = Rows(*header["rows"])
        mb = self.microbatches.get(key)
        try:
            if mb is None or mb.segment.intersect(rows) != rows:
                raise BadTensorError(f"rows {rows} of microbatch {key} are not held here")
            check_tensor(message.tensors.get("grad"), shape=(len(rows), self.seq_len, self.hidden_size),
                         dtype=torch.float32, what="output gradients")
            entries = self.ledger.split(epoch=key[0], microbatch=key[1], rows=rows)
        except (BadTensorError, KeyError) as e:
            logger.error(f"stage {self.stage} BS: refused output gradients for {rows} of {key}: {e}")
            async for response in self.stream(self.reply({"accepted": False, "error": str(e)})):
                yield response
            return
        grad = message.tensors["grad"]
        for entry in entries:
            self._task_counter += 1
            task = Task(task_id=f"{key[0]}:{key[1]}:{self.stage}:B{self._task_counter}", kind=Kind.BACKWARD,
                        epoch=key[0], microbatch=key[1], rows=entry.rows, preferred=entry.worker)
            self.work[task.task_id] = BackwardWork(task=task, grad=grad[entry.rows.relative_to(rows)].clone(),
                                                   forward_task=entry.task_id)
            self.add_task(task)
        async for response in self.stream(self.reply({"accepted": True})):
            yield response

    async def rpc_take_task(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        header = (await self.read(requests)).header
        self.see_worker(header)
        task = await self.long_poll_task(header["worker"], epoch=header["epoch"], wait_s=header.get("wait_s", 0.0))
        if task is None:
            reply = self.reply({"task": None})
        else:
            mb = self.microbatches[(task.epoch, task.microbatch)]
            (fs, _), = mb.layout.route_to_fs(self.stage, task.rows, mb.total_rows)
            work = self.work[task.task_id]
            reply = self.reply({
                "task": task.task_id, "kind": task.kind.value, "epoch": task.epoch, "microbatch": task.microbatch,
                "rows": [task.rows.start, task.rows.end], "total_rows": mb.total_rows, "fs": fs, "bs": self.peer_id,
                "forward_task": work.forward_task, "layout": mb.layout.to_header(),
                "microbatches_per_epoch": self.microbatches_per_epoch,
            }, {"grad": work.grad})
        async for response in self.stream(reply):
            yield response

    async def _report(self, fs: str, task_id: str, worker: str, *, ok: bool) -> None:
        try:
            await self.caller.call(fs, FrontalServer, "rpc_task_result",
                                   Message({"task": task_id, "worker": worker, "ok": ok}))
        except Exception as e:
            logger.warning(f"stage {self.stage} BS: could not report task {task_id} to {fs}: {e!r}")

    async def rpc_task_result(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A frontal server accepted or refused the input gradients of one of this server's backward tasks."""
        header = (await self.read(requests)).header
        task_id = header["task"]
        if header["ok"]:
            if self.state.pool.complete(task_id):
                task = self.work.pop(task_id).task
                self._progress(task.epoch).rows_backward += len(task.rows)
                self._maybe_close_epochs()
        elif self.state.pool.fail(task_id, header["worker"]) is not None:
            self.task_added.set()
        async for response in self.stream(self.reply({})):
            yield response

    def _maybe_close_epochs(self) -> None:
        """An epoch closes here when every row of its segment has done its backward (or, last stage, its loss)."""
        while self.microbatches_per_epoch is not None:
            epoch = self.closed_epoch + 1
            keys = [key for key in self.microbatches if key[0] == epoch]
            if len(keys) < self.microbatches_per_epoch:
                return
            expected = sum(len(self.microbatches[key].segment) for key in keys)
            progress = self._progress(epoch)
            if (progress.rows_recorded if self.is_last else progress.rows_backward) < expected:
                return
            self.closed_epoch = epoch
            self.epoch_stats(epoch).finished = self.clock()
            for key in keys:
                del self.microbatches[key]
            self.ledger.forget_epoch(epoch)
            self.state.pool.forget_epoch(epoch)
            self.progress.pop(epoch, None)
            logger.info(f"stage {self.stage} BS: epoch {epoch} closed")
