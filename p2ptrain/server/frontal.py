"""The frontal server (FS) of a stage: receives the stage's input rows, hands out forward tasks, collects the
input gradients of the backward pass and passes them to the backward servers of the previous stage.

It keeps each microbatch's inputs until the epoch closes, so a backward task whose worker no longer holds the
forward activations (or another worker's) can be recomputed (paper §3.2.1).
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
from p2ptrain.protocol.rows import Rows, split_by_compute
from p2ptrain.protocol.taskpool import Kind, Task
from p2ptrain.server.base import StageServer
from p2ptrain.transport import Message

logger = logging.getLogger(__name__)

WORKER_SEEN_S = 5.0  # a worker that has not polled for this long no longer counts for averaging...
CONTRIBUTOR_SEEN_S = 30.0  # ...unless it handed in rows of the epoch and polled within this long
GROUPS_KEPT = 4  # closures of the last few epochs, for workers that are still finishing one


@dataclass
class MicrobatchInputs:
    segment: Rows
    total_rows: int
    layout: Layout
    inputs: torch.Tensor
    labels: torch.Tensor
    received: list[Rows] = field(default_factory=list)
    grads: torch.Tensor | None = None
    grads_received: list[Rows] = field(default_factory=list)
    done: bool = False


def _covered(parts: list[Rows]) -> int:
    return sum(len(part) for part in parts)


def _overlaps(parts: list[Rows], rows: Rows) -> bool:
    return any(part.intersect(rows) for part in parts)


class FrontalServer(StageServer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.microbatches: dict[tuple[int, int], MicrobatchInputs] = {}
        self.microbatches_per_epoch: int | None = None
        self.completed: dict[int, set[int]] = {}
        self.closed_epoch = -1
        # epoch -> {"fs": the stage's FS in that epoch's layout, "group": [[peer id, client mode], ...] of the
        # workers that average it}; workers step only once every FS of the layout has closed the epoch
        self.closures: dict[str, dict] = {}
        # epoch -> (task, worker) of each accepted result, kept past closure: a worker whose reply was lost pushes
        # again and must hear "accepted", not "duplicate", or the rows the FS counted would miss the average
        self.accepted: dict[int, set[tuple[str, str]]] = {}
        self._task_counter = 0

    async def rpc_push_rows(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Rows of a microbatch from the data source (stage 0) or a backward server of the previous stage."""
        message = await self.read(requests)
        header = message.header
        epoch, index, rows, total = header["epoch"], header["microbatch"], Rows(*header["rows"]), header["total_rows"]
        layout = Layout.from_header(header["layout"])
        self.microbatches_per_epoch = header["microbatches_per_epoch"]
        inputs, labels = message.tensors["inputs"], message.tensors["labels"]
        try:
            segment = layout.fs_segment(self.stage, self.peer_id, total)
            if rows.intersect(segment) != rows:
                raise BadTensorError(f"rows {rows} are not in this server's segment {segment}")
            row_shape = (self.seq_len,) if self.is_first else (self.seq_len, self.hidden_size)
            dtype = torch.int64 if self.is_first else torch.float32
            check_tensor(inputs, shape=(len(rows), *row_shape), dtype=dtype, what="stage inputs")
            check_tensor(labels, shape=(len(rows), self.seq_len), dtype=torch.int64, what="labels")
        except BadTensorError as e:
            logger.error(f"stage {self.stage} FS: refused rows {rows} of microbatch {epoch}:{index}: {e}")
            async for response in self.stream(self.reply({"accepted": False, "error": str(e)})):
                yield response
            return
        mb = self.microbatches.get((epoch, index))
        if mb is None:
            if self.closed_epoch < 0 and not self.microbatches:
                self.closed_epoch = epoch - 1  # joined a running swarm: earlier epochs never come here
            mb = self.microbatches[(epoch, index)] = MicrobatchInputs(
                segment=segment, total_rows=total, layout=layout,
                inputs=torch.empty(len(segment), *inputs.shape[1:], dtype=inputs.dtype),
                labels=torch.empty(len(segment), self.seq_len, dtype=torch.int64),
            )
            stats = self.epoch_stats(epoch)
            stats.started = stats.started or self.clock()
        if not _overlaps(mb.received, rows):
            mb.inputs[rows.relative_to(segment)] = inputs
            mb.labels[rows.relative_to(segment)] = labels
            mb.received.append(rows)
            if _covered(mb.received) == len(segment):
                self._make_forward_tasks(epoch, index, mb)
        async for response in self.stream(self.reply({"accepted": True})):
            yield response

    def _make_forward_tasks(self, epoch: int, index: int, mb: MicrobatchInputs) -> None:
        """Cut the segment at the backward servers' boundaries, then in shares of the known workers' compute."""
        compute = self.active_workers() or {"": 1.0}
        for _, part in mb.layout.route_to_bs(self.stage, mb.segment, mb.total_rows):
            for worker, rows in split_by_compute(part, compute):
                self._task_counter += 1
                self.add_task(Task(
                    task_id=f"{epoch}:{index}:{self.stage}:F{self._task_counter}", kind=Kind.FORWARD, epoch=epoch,
                    microbatch=index, rows=rows, preferred=worker or None,
                ))
        self.epoch_stats(epoch).rows += len(mb.segment)

    async def rpc_take_task(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        header = (await self.read(requests)).header
        self.see_worker(header)
        task = await self.long_poll_task(header["worker"], epoch=header["epoch"], wait_s=header.get("wait_s", 0.2))
        if task is None:
            reply = self.reply({"task": None, "closed_epoch": self.closed_epoch, "closures": self.closures})
        else:
            mb = self.microbatches[(task.epoch, task.microbatch)]
            window = task.rows.relative_to(mb.segment)
            tensors = {"inputs": mb.inputs[window], "labels": mb.labels[window]}
            (bs, _), = mb.layout.route_to_bs(self.stage, task.rows, mb.total_rows)
            reply = self.reply({
                "task": task.task_id, "kind": task.kind.value, "epoch": task.epoch, "microbatch": task.microbatch,
                "rows": [task.rows.start, task.rows.end], "total_rows": mb.total_rows, "fs": self.peer_id, "bs": bs,
                "layout": mb.layout.to_header(), "microbatches_per_epoch": self.microbatches_per_epoch,
                "closed_epoch": self.closed_epoch,
            }, tensors)
        async for response in self.stream(reply):
            yield response

    async def rpc_fetch_inputs(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stored inputs of some rows, for a worker that recomputes a forward pass it does not hold."""
        header = (await self.read(requests)).header
        mb = self.microbatches.get((header["epoch"], header["microbatch"]))
        rows = Rows(*header["rows"])
        if mb is None or mb.segment.intersect(rows) != rows:
            reply = self.reply({"found": False})
        else:
            window = rows.relative_to(mb.segment)
            reply = self.reply({"found": True}, {"inputs": mb.inputs[window], "labels": mb.labels[window]})
        async for response in self.stream(reply):
            yield response

    async def rpc_push_input_grads(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The result of a backward task: gradients of the stage inputs (none at stage 0), checked, then kept."""
        message = await self.read(requests)
        header = message.header
        worker, task_id, issuer = header["worker"], header["task"], header["issuer"]
        if (task_id, worker) in self.accepted.get(header["epoch"], ()):
            async for response in self.stream(self.reply({"accepted": True, "again": True})):
                yield response
            return
        mb = self.microbatches.get((header["epoch"], header["microbatch"]))
        rows = Rows(*header["rows"])
        try:
            if mb is None or mb.segment.intersect(rows) != rows:
                raise BadTensorError(f"rows {rows} of microbatch {header['epoch']}:{header['microbatch']} are not held here")
            if not self.is_first:
                check_tensor(message.tensors.get("grad"), shape=(len(rows), self.seq_len, self.hidden_size),
                             dtype=torch.float32, what="input gradients")
        except BadTensorError as e:
            await self._report(issuer, task_id, worker, ok=False)
            async for response in self.stream(self.refuse(worker, task_id, str(e))):
                yield response
            return
        if _overlaps(mb.grads_received, rows):
            # a redone task whose first result arrived after all: the rows count once
            async for response in self.stream(self.reply({"accepted": False, "error": "duplicate"})):
                yield response
            return
        if not self.is_first:
            if mb.grads is None:
                mb.grads = torch.zeros(len(mb.segment), self.seq_len, self.hidden_size)
            mb.grads[rows.relative_to(mb.segment)] = message.tensors["grad"]
        mb.grads_received.append(rows)
        self.see_result(worker, epoch=header["epoch"], client_mode=bool(header.get("client_mode", False)))
        self.accepted.setdefault(header["epoch"], set()).add((task_id, worker))
        await self._report(issuer, task_id, worker, ok=True)
        async for response in self.stream(self.reply({"accepted": True})):
            yield response
        if _covered(mb.grads_received) == len(mb.segment):
            await self._finish_microbatch(header["epoch"], header["microbatch"], mb)

    async def _report(self, issuer: str, task_id: str, worker: str, *, ok: bool) -> None:
        """Tell the server that issued a task whether its result was accepted."""
        if issuer == self.peer_id:
            self.task_result(task_id, worker, ok=ok)
            return
        from p2ptrain.server.backward import BackwardServer  # here: backward.py imports this module

        try:
            await self.caller.call(issuer, BackwardServer, "rpc_task_result",
                                   Message({"task": task_id, "worker": worker, "ok": ok}))
        except Exception as e:
            logger.warning(f"stage {self.stage} FS: could not report task {task_id} to {issuer}: {e!r}")

    def task_result(self, task_id: str, worker: str, *, ok: bool) -> None:
        if ok:
            self.state.pool.complete(task_id)
        elif self.state.pool.fail(task_id, worker) is not None:
            self.task_added.set()

    async def rpc_task_result(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        header = (await self.read(requests)).header
        self.task_result(header["task"], header["worker"], ok=header["ok"])
        async for response in self.stream(self.reply({})):
            yield response

    async def _finish_microbatch(self, epoch: int, index: int, mb: MicrobatchInputs) -> None:
        """All input gradients of this segment are in: pass them back, then count the microbatch done."""
        if not self.is_first:
            from p2ptrain.server.backward import BackwardServer  # here: backward.py imports this module

            for bs, part in mb.layout.route_to_bs(self.stage - 1, mb.segment, mb.total_rows):
                message = Message(
                    {"epoch": epoch, "microbatch": index, "rows": [part.start, part.end]},
                    {"grad": mb.grads[part.relative_to(mb.segment)]},
                )
                await self.caller.call(bs, BackwardServer, "rpc_push_output_grads", message)
        mb.done = True
        self.completed.setdefault(epoch, set()).add(index)
        self._maybe_close_epochs()

    def _maybe_close_epochs(self) -> None:
        while len(self.completed.get(self.closed_epoch + 1, ())) == self.microbatches_per_epoch:
            self.closed_epoch += 1
            epoch = self.closed_epoch
            # workers poll every FS of their stage, so this FS has seen the live ones lately; one whose results it
            # accepted may have been busy with backward work since, and counts unless silent for long
            contributors = {w for _, w in self.accepted.get(epoch, ())} & set(self.active_workers(
                within_s=CONTRIBUTOR_SEEN_S))
            workers = {*self.active_workers(within_s=WORKER_SEEN_S), *contributors}
            layout = next(mb.layout for key, mb in self.microbatches.items() if key[0] == epoch)
            self.closures[str(epoch)] = {
                "fs": list(layout.stages[self.stage].fs),
                "group": [[w, self.state.workers[w].client_mode] for w in sorted(workers)],
            }
            self.closures.pop(str(epoch - GROUPS_KEPT), None)
            self.accepted.pop(epoch - GROUPS_KEPT, None)
            self.epoch_stats(epoch).finished = self.clock()
            for key in [key for key in self.microbatches if key[0] == epoch]:
                del self.microbatches[key]
            self.state.pool.forget_epoch(epoch)
            self.completed.pop(epoch, None)
            logger.info(f"stage {self.stage} FS: epoch {epoch} closed")

    def in_flight(self) -> int:
        return sum(1 for mb in self.microbatches.values() if not mb.done)
