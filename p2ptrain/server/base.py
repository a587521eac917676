"""What the frontal and backward servers of a stage share: the task pool, the workers they know, long polls."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from hivemind.p2p import ServicerBase
from hivemind.proto import runtime_pb2

from p2ptrain.protocol.taskpool import Task, TaskPool
from p2ptrain.transport import Caller, Message, respond, unpack

logger = logging.getLogger(__name__)

Requests = AsyncIterator[runtime_pb2.ExpertRequest]
Responses = AsyncIterator[runtime_pb2.ExpertResponse]

REFUSALS_BEFORE_BAN = 3


@dataclass
class WorkerInfo:
    compute: float
    last_seen: float
    epoch: int
    client_mode: bool = False
    refusals: int = 0


@dataclass
class EpochStats:
    rows: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    started: float | None = None
    finished: float | None = None


@dataclass
class StageServerState:
    pool: TaskPool
    workers: dict[str, WorkerInfo] = field(default_factory=dict)
    epochs: dict[int, EpochStats] = field(default_factory=dict)


class StageServer(ServicerBase):
    """Base of FrontalServer and BackwardServer: one instance per server process, registered on its P2P."""

    def __init__(
        self, *, peer_id: str, stage: int, num_stages: int, seq_len: int, hidden_size: int, lease_timeout: float,
        codec: str, clock: Callable[[], float] = time.monotonic,
    ):
        self.peer_id, self.stage, self.num_stages = peer_id, stage, num_stages
        self.seq_len, self.hidden_size, self.codec, self.clock = seq_len, hidden_size, codec, clock
        self.state = StageServerState(pool=TaskPool(lease_timeout=lease_timeout))
        self.caller: Caller | None = None
        self.task_added = asyncio.Event()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def epoch_stats(self, epoch: int) -> EpochStats:
        return self.state.epochs.setdefault(epoch, EpochStats())

    def add_task(self, task: Task) -> None:
        self.state.pool.add(task)
        self.task_added.set()

    def _worker(self, worker: str, epoch: int) -> WorkerInfo:
        info = self.state.workers.get(worker)
        if info is None:
            info = self.state.workers[worker] = WorkerInfo(compute=1.0, last_seen=0.0, epoch=epoch)
        return info

    def see_worker(self, header: dict) -> WorkerInfo:
        info = self._worker(header["worker"], int(header["epoch"]))
        info.compute, info.epoch, info.last_seen = float(header.get("compute", 1.0)), int(header["epoch"]), self.clock()
        info.client_mode = bool(header.get("client_mode", False))
        return info

    def see_result(self, worker: str, *, epoch: int, client_mode: bool) -> None:
        """A worker that hands in a result is alive, even if it has not polled this server lately (it may have
        taken all its work from another server of the stage)."""
        info = self._worker(worker, epoch)
        info.last_seen, info.client_mode = self.clock(), client_mode

    def active_workers(self, *, within_s: float = 30.0) -> dict[str, float]:
        now = self.clock()
        return {
            worker: info.compute for worker, info in self.state.workers.items()
            if now - info.last_seen <= within_s and info.refusals < REFUSALS_BEFORE_BAN
        }

    def refuse(self, worker: str, task_id: str, error: str) -> list[runtime_pb2.ExpertResponse]:
        """Log a refused result, hand the task to another worker, and ban a worker that keeps sending garbage."""
        info = self.state.workers.get(worker)
        if info is not None:
            info.refusals += 1
        logger.error(f"stage {self.stage}: refused the result of task {task_id} from worker {worker}: {error}")
        return respond(Message({"accepted": False, "error": error}), codec=self.codec)

    async def long_poll_task(self, worker: str, *, epoch: int, wait_s: float) -> Task | None:
        """Take a task for `worker`, waiting up to `wait_s` for one to appear."""
        info = self.state.workers.get(worker)
        if info is not None and info.refusals >= REFUSALS_BEFORE_BAN:
            return None
        deadline = self.clock() + wait_s
        while True:
            self.expire_leases()
            task = self.state.pool.take(worker, now=self.clock(), epoch=epoch)
            remaining = deadline - self.clock()
            if task is not None or remaining <= 0:
                return task
            self.task_added.clear()
            try:
                await asyncio.wait_for(self.task_added.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def expire_leases(self) -> None:
        for task in self.state.pool.expire(now=self.clock()):
            logger.warning(f"stage {self.stage}: task {task.task_id} timed out, back in the pool")
            self.task_added.set()

    async def read(self, requests: Requests) -> Message:
        return await unpack(requests)

    def reply(self, header: dict, tensors: dict | None = None) -> list[runtime_pb2.ExpertResponse]:
        return respond(Message(header, tensors or {}), codec=self.codec)

    async def stream(self, responses: list[runtime_pb2.ExpertResponse]) -> Responses:
        for response in responses:
            yield response
