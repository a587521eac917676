"""A worker: pulls forward and backward tasks of one stage from its servers, computes, pushes the results.

Clients run it, and so do servers started with --compute. It only dials out, so it works behind NAT. Parameter
gradients of a task are kept aside until the server accepts the task's result, so a refused or duplicate
result never reaches the average: every row's gradient counts exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from p2ptrain.averaging import GroupMember, StageAllReduce
from p2ptrain.models.llama import LlamaStage
from p2ptrain.protocol.closure import judge
from p2ptrain.protocol.rows import Rows
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.transport import Caller, Message

logger = logging.getLogger(__name__)

FAULTS = ("none", "wrong-shape", "wrong-dtype", "nan")
RETRIES = 3  # attempts at pushing a result whose reply was lost in transport


@dataclass
class EpochRecord:
    epoch: int
    rows: int
    tokens: int
    averaged_with: int  # size of the all-reduce group, servers included; 0 when the round failed
    averaged: bool  # the step used the stage's average
    seconds: float


@dataclass
class ForwardState:
    rows: Rows
    inputs: torch.Tensor
    outputs: torch.Tensor


class Worker:
    def __init__(
        self, *, worker_id: str, stage: int, num_stages: int, model: LlamaStage, optimizer: torch.optim.Optimizer,
        averager: StageAllReduce, caller: Caller, servers: Callable[[], tuple[list[str], list[str]]],
        compute: float, seq_len: int, client_mode: bool = False, fault: str = "none", dump_dir: str | None = None,
    ):
        self.worker_id, self.stage, self.num_stages = worker_id, stage, num_stages
        self.model, self.optimizer, self.averager, self.caller = model, optimizer, averager, caller
        self.servers, self.compute = servers, compute
        self.seq_len, self.client_mode, self.fault = seq_len, client_mode, fault
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.accumulated = [torch.zeros_like(p) for p in self.params]
        self.rows_accumulated = 0
        self.epoch = 0
        self.cache: dict[str, ForwardState] = {}
        self.epoch_fs: tuple[str, ...] = ()  # the FS of this stage in the current epoch's layout, once known
        self.history: list[EpochRecord] = []
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
            # the FS of this epoch's layout are polled even if the DHT briefly misses one: each must close the epoch
            fs_list = sorted({*fs_list, *self.epoch_fs})
            if not fs_list:
                await asyncio.sleep(0.5)
                continue
            task, polls = await self._take(fs_list, bs_list)
            if task is not None:
                await self._run_task(task)
            else:
                await self._after_idle_poll(polls)

    async def _take(self, fs_list: list[str], bs_list: list[str]) -> tuple[Message | None, dict[str, dict | None]]:
        """Backward work first (it frees memory and unblocks the pipeline), then forward work; long-poll the FS.

        With no task, also returns each FS's reply (its last closed epoch and its recent closures), None where
        an FS could not be reached.
        """
        request = {"worker": self.worker_id, "compute": self.compute, "epoch": self.epoch,
                   "client_mode": self.client_mode}
        for bs in bs_list:
            reply = await self._ask(bs, BackwardServer, {**request, "wait_s": 0.0})
            if reply is not None and reply.header.get("task"):
                return reply, {}
        polls: dict[str, dict | None] = {}
        for fs in fs_list:
            reply = await self._ask(fs, FrontalServer, {**request, "wait_s": 0.1})
            if reply is not None and reply.header.get("task"):
                return reply, {}
            polls[fs] = None if reply is None else reply.header
        return None, polls

    async def _after_idle_poll(self, polls: dict[str, dict | None]) -> None:
        """No task anywhere: step, catch up, or wait, by ``protocol.closure.judge``."""
        verdict = judge(self.epoch, polls, epoch_fs=self.epoch_fs)
        self.epoch_fs = verdict.epoch_fs
        if verdict.catch_up_to is not None:
            self._advance(verdict.catch_up_to)
        elif verdict.group is not None:
            await self._step([GroupMember(peer, client_mode) for peer, client_mode in verdict.group])

    async def _ask(self, server: str, service: type, header: dict) -> Message | None:
        try:
            return await self.caller.call(server, service, "rpc_take_task", Message(header))
        except Exception as e:
            logger.warning(f"worker {self.worker_id}: could not reach {server}: {e!r}")
            await asyncio.sleep(0.2)
            return None

    async def _run_task(self, task: Message) -> None:
        if task.header["kind"] == "forward":
            await self._forward(task)
        else:
            await self._backward(task)

    async def _forward(self, task: Message) -> None:
        header, inputs, labels = task.header, task.tensors["inputs"], task.tensors["labels"]
        rows = Rows(*header["rows"])
        self.epoch_fs = tuple(header["layout"][self.stage][0])
        if not self.is_first:
            inputs.requires_grad_(True)
        if self.is_last:
            loss, grads = await asyncio.to_thread(self._loss_and_grads, inputs, labels)
            if await self._push_input_grads(header, rows, grads, issuer=header["fs"]):
                # the BS counts each row's loss once, so a retry after a lost reply is harmless
                await self._call(header["bs"], BackwardServer, "rpc_push_outputs", Message(
                    self._result_header(header, rows), {"loss": self._corrupt(loss.detach())}), attempts=RETRIES)
            return
        outputs = await asyncio.to_thread(self._forward_compute, inputs)
        reply = await self._call(header["bs"], BackwardServer, "rpc_push_outputs", Message(
            self._result_header(header, rows), {"outputs": self._corrupt(outputs.detach()), "labels": labels}))
        if reply is not None and reply.header.get("accepted"):
            self.cache[header["task"]] = ForwardState(rows=rows, inputs=inputs, outputs=outputs)

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
        # the FS answers a repeated push of a result it accepted with "accepted" again: if the first reply was lost,
        # the retry tells this worker to count the gradients the FS already counted
        reply = await self._call(header["fs"], FrontalServer, "rpc_push_input_grads", Message(
            {**self._result_header(header, rows), "issuer": issuer}, tensors), attempts=RETRIES)
        if reply is None or not reply.header.get("accepted"):
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
            "microbatches_per_epoch": header["microbatches_per_epoch"], "client_mode": self.client_mode,
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

    async def _call(self, server: str, service: type, method: str, message: Message, *,
                    attempts: int = 1) -> Message | None:
        """The server's reply, or None if every attempt failed in transport (a refusal is a reply)."""
        for attempt in range(1, attempts + 1):
            try:
                return await self.caller.call(server, service, method, message)
            except Exception as e:
                logger.warning(f"worker {self.worker_id}: {method} to {server} failed (attempt {attempt} of "
                               f"{attempts}): {e!r}")
                if attempt < attempts:
                    await asyncio.sleep(0.2 * attempt)
        return None

    async def _step(self, group: list[GroupMember]) -> None:
        """The stage closed this epoch: average gradients with the group the stage's first FS fixed, then step."""
        rows, epoch = self.rows_accumulated, self.epoch
        if self.worker_id not in {member.peer_id for member in group}:
            if rows:  # the status shows these as rows in the batch that were not averaged
                logger.error(f"worker {self.worker_id}: left out of the averaging group of epoch {epoch}; "
                             f"its {rows} accepted rows are lost")
            else:  # joined as the epoch closed: nothing of it to hand in
                logger.info(f"worker {self.worker_id}: not in the averaging group of epoch {epoch}; skipping it")
            self._advance(epoch + 1)
            return
        tokens = rows * self.seq_len
        # each worker hands in its own mean gradient, weighted by its rows: the average is the batch mean
        grads = [accumulated / tokens if tokens else torch.zeros_like(accumulated) for accumulated in self.accumulated]
        averaged, result = await self.averager.average(grads, epoch=epoch, rows=rows, group=group)
        if not result.ok:
            logger.error(f"worker {self.worker_id}: stage {self.stage} averaging of epoch {epoch} failed; "
                         "stepping on local gradients")
        with torch.no_grad():
            for param, grad in zip(self.params, averaged):
                param.grad = grad
        self.optimizer.step()
        if self.dump_dir is not None:
            self._dump_averaged_grads(epoch)
        self.optimizer.zero_grad(set_to_none=True)
        now = time.monotonic()
        self.history.append(EpochRecord(epoch=epoch, rows=rows, tokens=tokens, averaged_with=result.group_size,
                                              averaged=result.ok, seconds=now - self._epoch_started))
        self._epoch_started = now
        self._advance(epoch + 1)
        logger.info(f"worker {self.worker_id}: stage {self.stage} stepped to epoch {self.epoch} ({rows} rows, "
                    f"averaged in a group of {result.group_size})")

    def _advance(self, epoch: int) -> None:
        """Move to `epoch`, dropping what this worker holds of the current one: averaged by a step just taken, or
        never to be averaged (a worker that catches up or was left out)."""
        for accumulated in self.accumulated:
            accumulated.zero_()
        self.rows_accumulated = 0
        self.epoch, self.epoch_fs = epoch, ()
        self.cache.clear()

    def _dump_averaged_grads(self, epoch: int) -> None:
        """Save the gradients the optimizer applied (the stage's average), for the gradient-equivalence test."""
        grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None}
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"stage": self.stage, "layers": [self.model.start, self.model.end], "grads": grads},
                   self.dump_dir / f"stage{self.stage}-{self.worker_id}-epoch{epoch}.pt")
