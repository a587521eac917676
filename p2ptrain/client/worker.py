"""A worker: pulls forward and backward tasks of one stage from its servers, computes, pushes the results.

Clients run it, and so do servers started with --compute. It only dials out, so it works behind NAT. Parameter
gradients of a task are kept aside until the server accepts the task's result, so a refused or duplicate
result never reaches the average: every row's gradient counts exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import hivemind
import torch

from p2ptrain.models.llama import LlamaStage
from p2ptrain.protocol.rows import Rows
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.transport import Caller, Message

logger = logging.getLogger(__name__)

FAULTS = ("none", "wrong-shape", "wrong-dtype", "nan")


@dataclass
class EpochRecord:
    epoch: int
    rows: int
    tokens: int
    averaged_with: int  # size of the all-reduce group, servers included; 1 when the step was local
    averaged: bool  # the step used the stage's average (or this worker was the stage's only peer)
    seconds: float


@dataclass
class ForwardState:
    rows: Rows
    inputs: torch.Tensor
    outputs: torch.Tensor


@dataclass
class WorkerStats:
    tasks: int = 0
    refused: int = 0
    history: list[EpochRecord] = field(default_factory=list)


class Worker:
    def __init__(
        self, *, worker_id: str, stage: int, num_stages: int, model: LlamaStage, optimizer: hivemind.Optimizer,
        caller: Caller, servers: Callable[[], tuple[list[str], list[str]]], compute: float, seq_len: int,
        fault: str = "none", step_timeout: float = 60.0, dump_dir: str | None = None,
    ):
        self.worker_id, self.stage, self.num_stages = worker_id, stage, num_stages
        self.model, self.optimizer, self.caller, self.servers = model, optimizer, caller, servers
        self.compute, self.seq_len, self.fault, self.step_timeout = compute, seq_len, fault, step_timeout
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.accumulated = [torch.zeros_like(p) for p in self.params]
        self.rows_accumulated = 0
        self.epoch = optimizer.local_epoch
        self.cache: dict[str, ForwardState] = {}
        self.stats = WorkerStats()
        self._epoch_started = time.monotonic()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            fs_list, bs_list = self.servers()
            if not fs_list:
                await asyncio.sleep(0.5)
                continue
            task, closed = await self._take(fs_list, bs_list)
            if task is not None:
                await self._run_task(task)
            elif closed >= self.epoch:
                await self._step()

    async def _take(self, fs_list: list[str], bs_list: list[str]) -> tuple[Message | None, int]:
        """Backward work first (it frees memory and unblocks the pipeline), then forward work; long-poll the FS."""
        request = {"worker": self.worker_id, "compute": self.compute, "epoch": self.epoch}
        for bs in bs_list:
            reply = await self._ask(bs, BackwardServer, {**request, "wait_s": 0.0})
            if reply is not None and reply.header.get("task"):
                return reply, -1
        closed = []
        for fs in fs_list:
            reply = await self._ask(fs, FrontalServer, {**request, "wait_s": 0.1})
            if reply is None:
                closed.append(-1)
            elif reply.header.get("task"):
                return reply, -1
            else:
                closed.append(reply.header["closed_epoch"])
        return None, min(closed)

    async def _ask(self, server: str, service: type, header: dict) -> Message | None:
        try:
            return await self.caller.call(server, service, "rpc_take_task", Message(header))
        except Exception as e:
            logger.warning(f"worker {self.worker_id}: could not reach {server}: {e!r}")
            await asyncio.sleep(0.2)
            return None

    async def _run_task(self, task: Message) -> None:
        self.stats.tasks += 1
        if task.header["kind"] == "forward":
            await self._forward(task)
        else:
            await self._backward(task)

    async def _forward(self, task: Message) -> None:
        header, inputs, labels = task.header, task.tensors["inputs"], task.tensors["labels"]
        rows = Rows(*header["rows"])
        if not self.is_first:
            inputs.requires_grad_(True)
        if self.is_last:
            loss, grads = await asyncio.to_thread(self._loss_and_grads, inputs, labels)
            if await self._push_input_grads(header, rows, grads, issuer=header["fs"]):
                await self._call(header["bs"], BackwardServer, "rpc_push_outputs", Message(
                    self._result_header(header, rows), {"loss": self._corrupt(loss.detach())}))
            return
        outputs = await asyncio.to_thread(self._forward_compute, inputs)
        reply = await self._call(header["bs"], BackwardServer, "rpc_push_outputs", Message(
            self._result_header(header, rows), {"outputs": self._corrupt(outputs.detach()), "labels": labels}))
        if reply is not None and reply.header.get("accepted"):
            self.cache[header["task"]] = ForwardState(rows=rows, inputs=inputs, outputs=outputs)
        else:
            self.stats.refused += 1

    def _forward_compute(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return self.model(inputs)

    def _loss_and_grads(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.enable_grad():
            loss = self.model(inputs, labels)
            targets = self.params + ([] if self.is_first else [inputs])
            return loss, list(torch.autograd.grad(loss, targets))

    async def _backward(self, task: Message) -> None:
        header, grad = task.header, task.tensors["grad"]
        rows = Rows(*header["rows"])
        state = self.cache.pop(header["forward_task"], None)
        if state is None or state.rows != rows:
            state = await self._recompute(header, rows)
            if state is None:
                return
        grads = await asyncio.to_thread(self._backward_compute, state, grad)
        await self._push_input_grads(header, rows, grads, issuer=header["bs"])

    async def _recompute(self, header: dict, rows: Rows) -> ForwardState | None:
        """Redo the forward pass from the inputs the FS keeps: this task's forward was done elsewhere."""
        reply = await self._call(header["fs"], FrontalServer, "rpc_fetch_inputs", Message(
            {"epoch": header["epoch"], "microbatch": header["microbatch"], "rows": [rows.start, rows.end]}))
        if reply is None or not reply.header.get("found"):
            logger.warning(f"worker {self.worker_id}: inputs of {header['task']} are gone")
            return None
        inputs = reply.tensors["inputs"]
        if not self.is_first:
            inputs.requires_grad_(True)
        outputs = await asyncio.to_thread(self._forward_compute, inputs)
        return ForwardState(rows=rows, inputs=inputs, outputs=outputs)

    def _backward_compute(self, state: ForwardState, grad: torch.Tensor) -> list[torch.Tensor]:
        targets = self.params + ([] if self.is_first else [state.inputs])
        return list(torch.autograd.grad(state.outputs, targets, grad_outputs=grad))

    async def _push_input_grads(self, header: dict, rows: Rows, grads: list[torch.Tensor], *, issuer: str) -> bool:
        """Send the input gradients to the FS; only once it accepts them do the parameter gradients count."""
        param_grads = grads[: len(self.params)]
        tensors = {} if self.is_first else {"grad": self._corrupt(grads[-1])}
        reply = await self._call(header["fs"], FrontalServer, "rpc_push_input_grads", Message(
            {**self._result_header(header, rows), "issuer": issuer}, tensors))
        if reply is None or not reply.header.get("accepted"):
            self.stats.refused += 1
            return False
        if header["epoch"] != self.epoch:
            raise RuntimeError(f"task of epoch {header['epoch']} computed at epoch {self.epoch}")
        for accumulated, param_grad in zip(self.accumulated, param_grads):
            accumulated.add_(param_grad)
        self.rows_accumulated += len(rows)
        return True

    def _result_header(self, header: dict, rows: Rows) -> dict:
        return {
            "task": header["task"], "worker": self.worker_id, "epoch": header["epoch"],
            "microbatch": header["microbatch"], "rows": [rows.start, rows.end], "fs": header["fs"],
            "total_rows": header["total_rows"], "layout": header["layout"],
            "microbatches_per_epoch": header["microbatches_per_epoch"],
        }

    def _corrupt(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fault injection for tests of the servers' input checks (--fault)."""
        if self.fault == "wrong-shape":
            return tensor.reshape(-1)[: max(tensor.numel() - 1, 1)]
        if self.fault == "wrong-dtype":
            return tensor.double()
        if self.fault == "nan":
            return torch.full_like(tensor, float("nan"))
        return tensor

    async def _call(self, server: str, service: type, method: str, message: Message) -> Message | None:
        try:
            return await self.caller.call(server, service, method, message)
        except Exception as e:
            logger.warning(f"worker {self.worker_id}: {method} to {server} failed: {e!r}")
            return None

    async def _step(self) -> None:
        """The stage closed this epoch: average gradients with the stage's peers and step (hivemind.Optimizer)."""
        rows = self.rows_accumulated
        tokens = rows * self.seq_len
        with torch.no_grad():
            for param, accumulated in zip(self.params, self.accumulated):
                # Each peer hands in its own mean gradient, weighted by its rows: the average is the batch mean.
                param.grad = accumulated / tokens if tokens else torch.zeros_like(param)
        averaged_with, averaged = await asyncio.to_thread(self._optimizer_step, rows)
        for accumulated in self.accumulated:
            accumulated.zero_()
        self.rows_accumulated = 0
        self.cache.clear()
        now = time.monotonic()
        self.stats.history.append(EpochRecord(epoch=self.epoch, rows=rows, tokens=tokens, averaged_with=averaged_with,
                                              averaged=averaged, seconds=now - self._epoch_started))
        self._epoch_started = now
        self.epoch = self.optimizer.local_epoch
        logger.info(f"worker {self.worker_id}: stage {self.stage} stepped to epoch {self.epoch} "
                    f"({rows} rows, averaged with {averaged_with} peers)")

    def _optimizer_step(self, rows: int) -> tuple[int, bool]:
        """Blocks until the stage's all-reduce is done; returns the averaging group's size and whether it worked."""
        opt, start_epoch = self.optimizer, self.optimizer.local_epoch
        opt.tracker.report_local_progress(start_epoch, rows)
        deadline = time.monotonic() + self.step_timeout
        while not opt.tracker.ready_to_update_epoch and time.monotonic() < deadline:
            time.sleep(0.05)
        if rows:
            opt.step(batch_size=rows)
        while opt.local_epoch == start_epoch and time.monotonic() < deadline:
            if rows == 0:
                opt.load_state_from_peers()
            else:
                time.sleep(0.05)
        if self.dump_dir is not None:
            self._dump_averaged_grads(start_epoch)
        opt.zero_grad()
        stepped = opt.local_epoch > start_epoch
        control = opt.scheduled_grads
        if control is not None and control.done() and not control.cancelled() and control.exception() is None:
            return len(control.result()), stepped
        alone = opt.tracker.global_progress.num_peers <= 1
        if not stepped:
            logger.error(f"worker {self.worker_id}: stage {self.stage} did not step epoch {start_epoch} in time")
        return 1, stepped and alone

    def _dump_averaged_grads(self, epoch: int) -> None:
        """Save the gradients the optimizer applied (the stage's average), for the gradient-equivalence test."""
        applied = [p for group in self.optimizer.state_averager.optimizer.param_groups for p in group["params"]]
        names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        grads = {name: p.grad.detach().clone() for name, p in zip(names, applied) if p.grad is not None}
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"stage": self.stage, "layers": [self.model.start, self.model.end], "grads": grads},
                   self.dump_dir / f"stage{self.stage}-{self.worker_id}-epoch{epoch}.pt")
