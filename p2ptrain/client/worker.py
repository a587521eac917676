"""A worker: pulls forward and backward tasks of one stage from its servers, computes, pushes the results.

Clients run it, and so do servers started with --compute. It only dials out, so it works behind NAT. Parameter
gradients of a task are kept aside until the server accepts the task's result, so a refused or duplicate
result never reaches the average: every row's gradient counts exactly once.

With `RuntimeConfig.push_behind` (`--push-behind on`; off by default until a benchmark shows it pays) a result goes to
its server while the worker takes and computes its next task: the server confirms a result with the task's issuer
before it answers, two calls whose latency (8-14 ms a task on a loaded 2-core machine) would otherwise idle the
worker. One result is on its way at a time, in order, and every one has landed before the worker acts on an FS's
word about its epoch (deposit, step, catch-up). Its task may meanwhile come back to it (its lease ran out) and both
results be accepted, so the worker counts each microbatch's rows once.

A worker keeps two copies of its stage: the model it computes with, and the master copy its optimizer steps. When
an epoch closes, the stage averages its gradients and steps the master copy (clipped by the global norm across all
stages, at the learning rate of the epoch); the model takes the master's parameters at an epoch boundary. With
delayed parameter updates (`RunConfig.dpu`, the paper's §3.2.1) the averaging and the step run in the background
while the next epoch computes on the parameters from before them, and the model takes them at the end of that next
epoch: one epoch of staleness, and no stall at the boundary. Without, the worker waits for them before it goes on.
With `RunConfig.dpu_lookahead` the next epoch computes instead where a step on the stage's mean gradient would take
the master copy (`StageParams.look_ahead`, from the same optimizer state), close to where the stage's step in flight
takes it: the mean of the stage's deposits (`GradientDeposits`, one more transfer of the gradients, from the server
that holds them, before the next epoch), or the worker's own gradient where no mean comes. Only the clipping, taken
from the last step's global norm, and what the deposits miss (a codec's error, a mate that died) are late; on its own
gradient, the gap between it and the stage's is late too, which at 2 workers a stage cost 3.7% of held-out loss.
Where the worker's rows are its stage's only ones, the round's average is its own gradient and the look-ahead's step
is the step in flight's, bit for bit: the update takes it (`StageParams.adopt`) instead of stepping again.
With `RunConfig.overlap_epochs` (no drain at the boundary) a worker with no task of its epoch left takes tasks of the
next one, before its stage closed this one, and one that owes the deposit of this one deposits in the background while
it computes them (the FS's reply with the task says where): their gradients are kept apart (`EpochGradients`), and the
model takes new tensors, so that what it computed of this epoch still backpropagates through the parameters it was
computed on.
They hold, after the update in flight (which it waits for), where a step on its own gradient of this epoch so far
takes the master, with the look-ahead (the stage's mean comes only after the close), else the master's parameters.
Why it matters: in a linear model, Adam's momentum (β1 0.9) is stable up to a curvature of 38/lr with fresh
gradients and only about 1/lr with gradients one step late, and Adam trains near that edge.
With `RunConfig.average_every` H > 1 (DiLoCo) a worker steps the master copy on its own gradients at every epoch, and
the stage averages only at the last epoch of every H: how far each holder moved since the last round, weighted by
the rows it computed meanwhile, on which the outer optimizer steps (`StageParams.outer_step`).

With fp16 the last stage multiplies the loss by the run's loss scale before backward (`StageParams.loss_scale`, a
scale of the mean token loss, as torch's GradScaler's: the stage's loss is summed over the task's tokens, so it is
multiplied by the scale over their count), so that small gradients survive fp16's range; every stage divides a task's
parameter gradients by the same factor as it counts them. A task whose gradients overflow (inf or nan) hands in zeros
instead, the input gradients it sends upstream too (servers refuse non-finite tensors), and marks the worker's epoch;
the mark travels in the stage's all-reduce, so every member reads from the same average whether any overflowed, and the
stage's report of its gradient norm carries it to the data source, whose answer tells every stage alike: on an
overflow every worker and replica of every stage skips the epoch's step and halves the scale.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import torch

from p2ptrain.client.averaging import RoundResult, StageAllReduce
from p2ptrain.client.device import autocast, place, to_device, to_host
from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.live.probe import dial_failure
from p2ptrain.models.base import StageModel
from p2ptrain.protocol.closure import judge
from p2ptrain.protocol.messages import (
    BACKWARD_SERVER,
    FRONTAL_SERVER,
    FetchInputs,
    GroupMember,
    Leave,
    Message,
    PushInputGrads,
    PushOutputs,
    ReportGroup,
    ReportNorm,
    Request,
    StageGroup,
    TakeTask,
    TaskOffer,
    TaskReply,
)
from p2ptrain.protocol.optimization import Digest, clip_coefficient
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.sharing import shared_rounds
from p2ptrain.protocol.taskpool import Kind
from p2ptrain.state.params import LookAhead, StageParams
from p2ptrain.transport import Caller, Refused

logger = logging.getLogger(__name__)
T = TypeVar("T")

SLOW_AVERAGING_S = 1.0  # how much longer each round takes with the fault "slow-averaging" (`NodeOptions.fault`)
FAILED_AVERAGING_EPOCH = 3  # the epoch whose round fails with the fault "failed-averaging"
OVERFLOW_EPOCH = 4  # the epoch whose gradients are made infinite in one task with the fault "overflow" (fp16)


@dataclass
class EpochRecord:
    epoch: int
    rows: int
    tokens: int
    averaged: bool  # the step used the stage's average
    seconds: float
    digest: Digest = ()  # of the master parameters after the step (`StageParams.digest`)
    round_failed: bool = False  # the all-reduce of a group of several failed or averaged nothing
    lr: float = 0.0
    grad_norm: float | None = None  # the global gradient norm (with clip_norm set, the step clipped by it)
    unclipped: bool = False  # with clip_norm set: no global norm came in time, the step was not clipped
    rows_lost: int = 0  # rows of groupmates that died in the round: not in the average
    overflow: bool = False  # fp16: the swarm's gradients of the epoch overflowed, and the step was skipped
    loss_scale: float | None = None  # fp16: the loss scale the epoch's gradients were computed at


@dataclass(frozen=True)
class Averaged:
    """What one of a worker's all-reduce rounds brought (`Worker._round`): the averaged gradients (its own where the
    round failed), the round's result, the shared tensors whose norm another stage counts, and whether the round of
    tensors shared across stages failed."""

    averaged: list[torch.Tensor]
    result: RoundResult
    skipped: set[int] = dataclasses.field(default_factory=set)
    shared_failed: bool = False


@dataclass
class ForwardState:
    epoch: int
    rows: Rows
    inputs: torch.Tensor
    outputs: torch.Tensor
    params: list[torch.Tensor]  # the parameters the outputs were computed on, which its backward differentiates by


@dataclass
class EpochGradients:
    """The parameter gradients a worker counted of one epoch (their results accepted), summed, and their rows."""

    epoch: int
    sums: list[torch.Tensor]
    rows: int = 0
    overflowed: bool = False  # fp16: some of them overflowed (module doc)
    fs: tuple[str, ...] = ()  # the FS of the stage in the epoch's layout, once known


class Worker:
    """The task loop of one worker of one stage.

    Owns its stage model, its master copy (`state.params.StageParams`: parameters, optimizer, schedule) and the gradients it accumulated this epoch (counted only once a server accepted
    the result they belong to), and the forward activations it keeps for its own backward tasks. It reaches servers
    only through its caller (pulling tasks, pushing results) and the stage's other workers only through the
    all-reduce in `averager`.
    """

    def __init__(
        self, *, worker_id: str, stage: int, config: RunConfig, settings: RuntimeConfig, model: StageModel,
        averager: StageAllReduce, caller: Caller, servers: Callable[[], tuple[list[str], list[str]]],
        compute: float, suspect: Callable[[], None] = lambda: None,
        norm_keeper: Callable[[], str | None] = lambda: None, client_mode: bool = False,
        fault: str = "none", dump_dir: Path | None = None,
        download_state: Callable[[Worker], Awaitable[int | None]] | None = None,
        holds_only: bool = False, after_step: Callable[[Worker], Awaitable[None]] | None = None,
        pretrained: bool = False, shared_averager: StageAllReduce | None = None,
        device: torch.device = torch.device("cpu"), recompute: bool = False,
    ):
        self.worker_id, self.stage, self.config, self.settings = worker_id, stage, config, settings
        self.averager, self.caller, self.norm_keeper = averager, caller, norm_keeper
        # the fp32 master copy, with the accumulated gradients and the optimizer state, on the device or, offloaded,
        # in host memory; the model it computes with on the device, in the run's precision (`client.device`)
        self.device = device
        self.master = StageParams(model=model, config=config,
                                  device=torch.device("cpu") if config.offload_optimizer else device)
        self.model = place(model, device, config.precision)
        self.model.recompute = recompute
        # its model holds a checkpoint's weights (the run starts from it): it serves them as the stage's, and a
        # running stage's are downloaded only if it finds the stage further on (catch-up)
        self.master.loaded = pretrained
        self._update: asyncio.Task | None = None  # the averaging and step of the last closed epoch, with DPU
        self._pushing: asyncio.Task | None = None  # the last task's result on its way, with push_behind
        self._depositing: asyncio.Task | None = None  # its deposit, made while it computes the next epoch's task
        self._ahead: LookAhead | None = None  # the look-ahead's step, where it may be the step in flight's (`_apply`)
        self._clip_scale = 1.0  # the factor the last step's global norm clipped the stage's gradients by
        self._averaging_with: dict[int, frozenset[str]] = {}  # per epoch, the group of an all-reduce under way
        self._stale = False  # the stage stepped and this worker did not: it reloads the stage's state
        self.servers, self.compute, self.client_mode, self.fault = servers, compute, client_mode, fault
        self.suspect = suspect  # a server of its stage did not answer a poll (`MembershipCache.suspect`)
        self.dump_dir = dump_dir
        # a reliable server that computes nothing but holds the stage's state: it takes no tasks, averages with the
        # workers (with no rows of its own) and steps alike, serves its state and saves it (`after_step`)
        self.holds_only, self.after_step = holds_only, after_step
        self.download_state = download_state  # loads the stage's state from a mate before the first task
        self._stepping: int | None = None  # the epoch this worker is averaging and stepping, while it does
        self._deposited: tuple[int, int] = (-1, 0)  # the epoch and rows of the gradients it last deposited
        self._interval_rows = 0  # with average_every > 1: the rows its own steps took since the stage's last round
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # tensors other stages hold copies of (`protocol.sharing`): the index of each in `params` -> checkpoint key;
        # their gradients are summed across the holding stages in rounds of `shared_averager`
        self.shared_averager = shared_averager
        shared = self.model.shared_parameters() if shared_averager is not None else {}
        self.shared_keys = {index: shared[name] for index, name in
                            enumerate(name for name, p in self.model.named_parameters() if p.requires_grad)
                            if name in shared}
        self.accumulated = [torch.zeros_like(p) for p in self.master.trainable]
        self.rows_accumulated = 0
        self.overflowed = False  # fp16: gradients of some rows it counted this epoch overflowed (module doc)
        self._next: EpochGradients | None = None  # overlap_epochs: of the next epoch, begun before this one closed
        self.epoch = 0
        self.cache: dict[str, ForwardState] = {}
        # the rows whose parameter gradients it counted, by epoch and microbatch: with push_behind a server may hand it
        # again a task whose result is still on its way (its lease ran out meanwhile), and accept both results
        self._counted: set[tuple[int, int, Rows]] = set()
        self.epoch_fs: tuple[str, ...] = ()  # the FS of this stage in the current epoch's layout, once known
        self.history: list[EpochRecord] = []
        self.silent_since: dict[str, float] = {}  # FS that have not answered this worker's polls since
        self._fs_quiet = False  # the stage's FS answered its last poll `quiet`
        self._awaits_backward = False  # it holds forward states and every FS answered its last poll with no task
        self._epoch_started = time.monotonic()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.config.num_stages - 1

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            for task in (self._update, self._pushing, self._depositing):
                if task is not None:
                    task.cancel()

    async def _run(self, stop: asyncio.Event) -> None:
        # a worker that joins a running stage must not compute on seed weights; one restored from a checkpoint need
        # not download, and a server that only holds the state computes nothing: it polls at once, so that it is in
        # the first epoch's group, and downloads the state only if it finds the stage further on (catch-up)
        if self.download_state is not None and not (self.master.loaded or self.holds_only):
            await self.download_state(self)
        while not stop.is_set():
            fs_list, bs_list = self.servers()
            # the FS of this epoch's layout are polled even if the DHT briefly misses one: each must close the epoch
            fs_list = sorted({*fs_list, *self.epoch_fs})
            if not fs_list:
                await asyncio.sleep(self.settings.no_servers_wait_s)
                continue
            reply, polls = await self._take(fs_list, bs_list)
            if reply is not None:
                if reply.deposit_to is not None:  # a task of the next epoch, with its deposit of this one due
                    await self._deposit_behind(reply.deposit_to)
                await self._run_task(reply)
            else:
                async with self._heard_by([fs for fs in fs_list if fs != self.worker_id]):
                    await self._after_idle_poll(polls)
        await self._pushed()  # a result it computed still counts, if its server takes it

    async def leave(self) -> None:
        """Tell the servers of this stage that this worker stops, so that what it holds is redone at once (its
        leased tasks, and rows whose parameter gradients it holds in the open epoch) instead of after its
        silence; a server that does not hear it finds out by the silence."""
        await self._pushed()
        fs_list, bs_list = self.servers()
        request = Leave(worker=self.worker_id)
        await asyncio.gather(*(self._call(server, service, request) for server, service in
                               [*((fs, FRONTAL_SERVER) for fs in {*fs_list, *self.epoch_fs}),
                                *((bs, BACKWARD_SERVER) for bs in bs_list)]))

    def load_state(self, *, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], epoch: int) -> None:
        """Take a stage mate's or a checkpoint's parameters and optimizer state, current for `epoch`
        (`client.state_sync`, `state.checkpoint`); the caller settled any update in flight first (`settle`), which
        would step over them."""
        self.master.load(model_state=model_state, optimizer_state=optimizer_state, epoch=epoch)
        self._interval_rows = 0  # with an outer optimizer, its parameters are the anchor now
        if self._update is None:  # not loaded by the update in flight, whose parameters the model takes at `settle`
            self._take_master()
            if epoch > self.epoch:  # never backwards: the stage may have closed the epoch a lagging mate served
                self._advance(epoch)

    @property
    def stale(self) -> bool:
        """The stage stepped and this worker did not (its round failed, or it was left out and no mate served the
        stage's state): its parameters may stand apart from its mates'."""
        return self._stale

    def averages_with(self, peer: str) -> bool:
        """An all-reduce of its under way waits for `peer`: what it serves `peer` must not wait for that round."""
        return any(peer in group for group in self._averaging_with.values())

    async def updated(self) -> None:
        """Until the update in flight (DPU) has stepped the master copy; the model keeps its parameters."""
        if self._update is not None:
            await asyncio.shield(self._update)

    @property
    def stepping(self) -> int | None:
        """The epoch this worker is averaging and stepping now, if it is."""
        return self._stepping

    async def settle(self) -> None:
        """Wait for the update in flight (DPU) and let the model take its parameters."""
        update, self._update = self._update, None
        if update is not None:
            await update
            self._take_master()

    async def _begin_next(self) -> None:
        """Its first task of the next epoch, before its stage closed this one (module doc): the gradients of the next
        epoch are kept apart, and after the update in flight the model takes, as new tensors, where a step on its own
        gradient of this epoch so far takes the master (with the look-ahead and any rows), else the master's."""
        update, self._update = self._update, None
        if update is not None:
            await update
        self._next = EpochGradients(epoch=self.epoch + 1, sums=[torch.zeros_like(a) for a in self.accumulated])
        predict = bool(self.config.dpu_lookahead and self.rows_accumulated)
        if predict:
            # the stage's mean gradient of this epoch comes only after its close: until then, a step on this worker's
            # own gradient so far predicts where the stage's step takes the master, closer than the master itself
            self._model_ahead(self._mean_gradients(), epoch=self.epoch)
        else:
            self._take_master()
        logger.info(f"worker {self.worker_id}: beginning epoch {self.epoch + 1} before its stage closed epoch "
                    f"{self.epoch}" + (f", looking ahead on its own gradient over {self.rows_accumulated} rows"
                                       if predict else ""))

    def _model_ahead(self, grads: list[torch.Tensor], *, epoch: int, keep: bool = False) -> LookAhead | None:
        """The model takes, as new tensors, where a step on `grads` of `epoch` takes the master; the last step's
        clipping factor estimates the global norm's. With `keep`, returns the step for `adopt`."""
        self._fork_params()
        return self.master.look_ahead([grad * self._clip_scale for grad in grads], epoch=epoch, into=self.model,
                                      keep=keep)

    def _take_master(self) -> None:
        """The model takes the master's parameters, as new tensors where graphs it computed await backward."""
        self._fork_params()
        self.master.copy_to(self.model)

    def _fork_params(self) -> None:
        """Give the model new parameter tensors, equal to its own, if it computed forward states that still await
        backward: their graphs keep the tensors they were computed on, which a write of the model would change under
        them. A tensor the model holds in several places (tied weights) stays one."""
        if not self.cache:
            return
        fresh: dict[int, torch.nn.Parameter] = {}
        with torch.no_grad():
            for module in self.model.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    if id(param) not in fresh:
                        fresh[id(param)] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                    module.register_parameter(name, fresh[id(param)])
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    async def _take(self, fs_list: list[str], bs_list: list[str]
                    ) -> tuple[TaskReply | None, dict[str, TaskReply | None]]:
        """Backward work first (it frees memory and unblocks the pipeline), then forward work; long-poll the FS.

        With no task, also returns each FS's reply (its last closed epoch and its recent closures), None where
        an FS could not be reached.
        """
        current = self._deposited == (self.epoch, self.rows_accumulated)
        # the only FS of a stage may hold a poll long while nothing is out (a second FS could hand out rows meanwhile)
        idle_wait_s = self.settings.idle_poll_wait_s if len(fs_list) == 1 else 0.0
        poll = TakeTask(worker=self.worker_id, compute=self.compute, epoch=self.epoch, client_mode=self.client_mode,
                        holds_state=self.holds_only, deposited=self.rows_accumulated if current else 0,
                        idle_wait_s=idle_wait_s, ahead=self.may_overlap)
        # after a quiet FS's answer no backward task can be waiting: the next one follows the FS's next rows; and the
        # last stage's BS issues none (its workers take forward, loss and backward as one task from the FS)
        bs_wait_s = self.settings.bs_poll_wait_s
        if self._awaits_backward and self.is_first and len(bs_list) == 1:
            bs_wait_s = self.settings.bs_poll_wait_backward_s
        self._awaits_backward = False
        for bs in bs_list if not (self.holds_only or self._fs_quiet or self.is_last) else ():
            reply = await self._ask(bs, BACKWARD_SERVER, dataclasses.replace(poll, wait_s=bs_wait_s))
            if reply is not None and reply.task is not None:
                return reply, {}
        polls: dict[str, TaskReply | None] = {}
        self._fs_quiet = False
        wait_s = self.settings.fs_poll_wait_backward_s if self.cache else self.settings.fs_poll_wait_s
        for fs in fs_list:
            reply = await self._ask(fs, FRONTAL_SERVER, dataclasses.replace(poll, wait_s=wait_s))
            if reply is None:
                self.silent_since.setdefault(fs, time.monotonic())
            else:
                self.silent_since.pop(fs, None)
            if reply is not None and reply.task is not None:
                return reply, {}
            polls[fs] = reply
        self._fs_quiet = idle_wait_s > 0 and all(reply is not None and reply.quiet for reply in polls.values())
        self._awaits_backward = bool(self.cache) and all(reply is not None for reply in polls.values())
        return None, polls

    @contextlib.asynccontextmanager
    async def _heard_by(self, servers: list[str]) -> AsyncIterator[None]:
        """While its loop is held between polls (its round and its update, or a state download: each ends by its
        deadline, which may be past `worker_lost_s`), `servers` keep hearing from this worker. Counted gone, it would
        have its rows redone and be left out of the next group; a remote server that holds the stage's state would
        fall behind the workers, and the stage's state could rest on workers in client mode, which serve nobody."""
        beat = asyncio.create_task(self._beat(servers))
        try:
            yield
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _beat(self, servers: list[str]) -> None:
        period = self.settings.worker_lost_s / 4
        while True:
            await asyncio.sleep(period)
            await asyncio.gather(*(self._ping(server, timeout=period) for server in servers))

    async def _ping(self, server: str, *, timeout: float) -> None:
        """A probe's bytes reach the server's node, which hears its sender (`StageServer.heard`)."""
        if (error := await dial_failure(self.caller, server, timeout=timeout)) is not None:
            # out of reach: the next poll tells the loop, which acts on it
            logger.debug(f"worker {self.worker_id}: probing {server} while its loop waits failed: {error!r}")

    async def _after_idle_poll(self, polls: dict[str, TaskReply | None]) -> None:
        """No task anywhere: step, catch up, or wait, by ``protocol.closure.judge``; with every result it pushed
        counted first, since an FS's answer may reflect a result this worker has not heard accepted yet."""
        await self._pushed()
        await self._deposited_behind()
        now = time.monotonic()
        gone = {fs for fs, since in self.silent_since.items() if now - since >= self.settings.server_lost_s}
        verdict = judge(self.epoch, polls, epoch_fs=self.epoch_fs, gone=gone)
        self.epoch_fs = verdict.epoch_fs
        if verdict.catch_up_to is not None:
            await self.settle()
            self._advance(verdict.catch_up_to)
            await self._take_stages_state()
        elif verdict.abandoned:
            logger.warning(f"worker {self.worker_id}: epoch {self.epoch} was abandoned (a server lost its rows); "
                           f"dropping its gradients of {self.rows_accumulated} rows, the data comes again")
            await self.settle()
            self.master.skip(self.epoch)
            self._advance(self.epoch + 1)
        elif verdict.group is not None:
            await self._step(verdict.group)
        else:
            await self._deposit(polls)

    async def _deposit(self, polls: dict[str, TaskReply | None]) -> None:
        """Every row of its epoch is back at an FS, which asks the workers that hold some to deposit their gradients
        with the stage's first FS (`TaskReply.deposit_to`) before they count as ready to average: then this worker
        dying in the round loses none of its rows (`client.averaging`). Again whenever a redo added rows since."""
        server = next((reply.deposit_to for reply in polls.values() if reply is not None and reply.deposit_to), None)
        if server is not None and not await self._deposit_to(server):
            # the FS answers the next poll at once while the deposit is due: do not ask again at once
            await asyncio.sleep(self.settings.unreachable_backoff_s)

    async def _deposit_to(self, server: str) -> bool:
        """Deposit its gradients of its epoch with `server`, unless it did with all its rows; False if that failed."""
        rows, epoch = self.rows_accumulated, self.epoch
        if not rows or self._deposited == (epoch, rows):
            return True
        if not await self.averager.deposit(server, self._mean_gradients(), epoch=epoch, rows=rows,
                                           overflow=self.overflowed):
            return False
        self._deposited = (epoch, rows)
        logger.info(f"worker {self.worker_id}: deposited its gradients of epoch {epoch} ({rows} rows) with {server}")
        return True

    async def _deposit_behind(self, server: str) -> None:
        """Deposit with `server` in the background while it computes a task of the next epoch (`overlap_epochs`),
        with every result it pushed counted first; a failed one is asked for again at a later poll."""
        await self._pushed()
        if self._depositing is None or self._depositing.done():
            self._depositing = asyncio.ensure_future(self._deposit_to(server))

    async def _deposited_behind(self) -> None:
        """Until its deposit in the background, if any, landed or failed."""
        depositing, self._depositing = self._depositing, None
        if depositing is not None:
            await depositing

    async def _ask(self, server: str, service: str, request: TakeTask) -> TaskReply | None:
        reply = await self._call(server, service, request)
        if reply is None:  # unreachable, or it refused the poll: ask the others before this one again
            self.suspect()  # and whether the stage's servers changed
            await asyncio.sleep(self.settings.unreachable_backoff_s)
        return reply

    @property
    def may_overlap(self) -> bool:
        """Whether it may take tasks of the next epoch while its stage has not closed this one (module doc). A model
        that recomputes its forward in backward would recompute on the next epoch's parameters, and a holder that
        takes no tasks has nothing to overlap."""
        return self.config.overlap_epochs and not (self.holds_only or self.model.recompute)

    async def _run_task(self, reply: TaskReply) -> None:
        if reply.task.epoch != self.epoch and not (reply.task.epoch == self.epoch + 1 and self.may_overlap):
            # a server's fault: the task's lease runs out and another worker takes it
            logger.warning(f"worker {self.worker_id}: at epoch {self.epoch}, it was offered task {reply.task.task} "
                           f"of epoch {reply.task.epoch}; not taking it")
            return
        if reply.task.epoch > self.epoch and self._next is None:
            await self._pushed()  # the look-ahead steps on its whole gradient so far
            await self._begin_next()
        inputs, labels, grad = (to_device(t, self.device) for t in (reply.inputs, reply.labels, reply.grad))
        if reply.task.kind == Kind.FORWARD:
            await self._forward(reply.task, inputs, labels)
        elif reply.task.kind == Kind.BACKWARD:
            await self._backward(reply.task, grad)
        else:
            await self._redo(reply.task, inputs, labels, grad)

    async def _redo(self, offer: TaskOffer, inputs: torch.Tensor, labels: torch.Tensor,
                    grad: torch.Tensor | None) -> None:
        """Forward and backward again on rows whose parameter gradients a vanished worker took with it. The outputs
        went on the first time, so only the gradients are handed in; in the last stage the loss too, which the BS
        records unless the vanished worker had delivered it."""
        if self.is_last:
            await self._loss_task(offer, inputs, labels)
            return
        state = await self._forward_state(offer, inputs)
        grads = await asyncio.to_thread(self._backward_compute, state, grad)
        await self._push(self._push_input_grads(offer, grads, issuer=offer.fs))

    def _loss_factor(self, offer: TaskOffer) -> float:
        """What the last stage multiplies a task's summed loss by, and every stage divides the task's parameter
        gradients by: the loss scale over the task's tokens with fp16 (module doc), else 1."""
        scale = self.master.loss_scale
        return 1.0 if scale is None else scale.value / (len(offer.rows) * self.config.seq_len)

    async def _forward(self, offer: TaskOffer, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        if offer.epoch == self.epoch:
            self.epoch_fs = offer.layout.stages[self.stage].fs
        else:
            self._next.fs = offer.layout.stages[self.stage].fs
        if self.is_last:
            await self._loss_task(offer, inputs, labels)
            return
        state = await self._forward_state(offer, inputs)
        result = self._outputs(offer, outputs=self._corrupt(to_host(state.outputs)), labels=to_host(labels))
        self.cache[offer.task] = state  # its backward task comes only after the BS accepted the outputs
        await self._push(self._push_outputs(offer, result))

    async def _push_outputs(self, offer: TaskOffer, result: PushOutputs) -> None:
        # the BS acknowledges a push it recorded already, so a retry after a lost reply is harmless
        if await self._call(offer.bs, BACKWARD_SERVER, result, attempts=self.settings.push_attempts) is None:
            self.cache.pop(offer.task, None)

    async def _loss_task(self, offer: TaskOffer, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """The last stage: forward, loss and backward at once; the input gradients go to the FS and, once it
        accepted them, the loss to the BS."""
        if not self.is_first:
            inputs.requires_grad_(True)
        loss, grads = await asyncio.to_thread(self._loss_and_grads, inputs, labels, self._loss_factor(offer))
        await self._push(self._push_loss(offer, loss, grads))

    async def _push_loss(self, offer: TaskOffer, loss: torch.Tensor, grads: list[torch.Tensor]) -> None:
        if await self._push_input_grads(offer, grads, issuer=offer.fs):
            # the BS counts each row's loss once, so a retry after a lost reply is harmless
            await self._call(offer.bs, BACKWARD_SERVER, self._outputs(offer, loss=self._corrupt(to_host(loss))),
                             attempts=self.settings.push_attempts)

    async def _forward_state(self, offer: TaskOffer, inputs: torch.Tensor) -> ForwardState:
        """The stage's forward pass on some inputs, kept for the backward pass."""
        if not self.is_first:
            inputs.requires_grad_(True)
        params = self.params
        outputs = await asyncio.to_thread(self._forward_compute, inputs)
        return ForwardState(epoch=offer.epoch, rows=offer.rows, inputs=inputs, outputs=outputs, params=params)

    def _outputs(self, offer: TaskOffer, **tensors: torch.Tensor) -> PushOutputs:
        return PushOutputs(task=offer.task, worker=self.worker_id, epoch=offer.epoch, microbatch=offer.microbatch,
                           rows=offer.rows, total_rows=offer.total_rows, layout=offer.layout, fs=offer.fs,
                           client_mode=self.client_mode, **tensors)

    def _forward_compute(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad(), autocast(self.device, self.config.precision):
            return self.model(inputs)

    def _loss_and_grads(self, inputs: torch.Tensor, labels: torch.Tensor, factor: float
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loss, and the gradients of the loss times `factor` (`_loss_factor`)."""
        with torch.enable_grad():
            with autocast(self.device, self.config.precision):
                loss = self.model(inputs, labels)
            targets = self.params + ([] if self.is_first else [inputs])
            return loss, list(torch.autograd.grad(loss if factor == 1.0 else loss * factor, targets))

    async def _backward(self, offer: TaskOffer, grad: torch.Tensor) -> None:
        state = self.cache.pop(offer.forward_task, None)
        if state is None or state.rows != offer.rows:
            state = await self._recompute(offer)
            if state is None:
                return
        grads = await asyncio.to_thread(self._backward_compute, state, grad)
        await self._push(self._push_input_grads(offer, grads, issuer=offer.bs))

    async def _recompute(self, offer: TaskOffer) -> ForwardState | None:
        """Redo the forward pass from the inputs the FS keeps: this task's forward was done elsewhere."""
        stored = await self._call(offer.fs, FRONTAL_SERVER, FetchInputs(epoch=offer.epoch, microbatch=offer.microbatch,
                                                                        rows=offer.rows))
        if stored is None:
            logger.warning(f"worker {self.worker_id}: inputs of {offer.task} are gone")
            return None
        return await self._forward_state(offer, to_device(stored.inputs, self.device))

    def _backward_compute(self, state: ForwardState, grad: torch.Tensor) -> list[torch.Tensor]:
        targets = state.params + ([] if self.is_first else [state.inputs])
        return list(torch.autograd.grad(state.outputs, targets, grad_outputs=grad))

    async def _push_input_grads(self, offer: TaskOffer, grads: list[torch.Tensor], *, issuer: str) -> bool:
        """Send the input gradients to the FS; only once it accepts them do the parameter gradients count. With fp16,
        gradients that overflowed go as zeros, and mark the epoch once accepted (module doc)."""
        overflow = self.master.loss_scale is not None and self._overflows(grads, epoch=offer.epoch)
        if overflow:
            grads = [torch.zeros_like(grad) for grad in grads]
        param_grads = grads[: len(self.params)]
        # the FS answers a repeated push of a result it accepted with "accepted" again: if the first reply was lost,
        # the retry tells this worker to count the gradients the FS already counted
        request = PushInputGrads(task=offer.task, worker=self.worker_id, epoch=offer.epoch,
                                 microbatch=offer.microbatch, rows=offer.rows, issuer=issuer,
                                 client_mode=self.client_mode,
                                 grad=None if self.is_first else self._corrupt(to_host(grads[-1])))
        if await self._call(offer.fs, FRONTAL_SERVER, request, attempts=self.settings.push_attempts) is None:
            return False
        if (offer.epoch, offer.microbatch, offer.rows) in self._counted:
            logger.info(f"worker {self.worker_id}: rows {offer.rows} of {offer.epoch}:{offer.microbatch} were counted "
                        "already (the task came again while its first result was on its way)")
            return True
        self._counted.add((offer.epoch, offer.microbatch, offer.rows))
        factor = self._loss_factor(offer)
        if offer.epoch == self.epoch:
            sums, self.rows_accumulated = self.accumulated, self.rows_accumulated + len(offer.rows)
            overflowed, self.overflowed = self.overflowed, self.overflowed or overflow
        elif self._next is not None and offer.epoch == self._next.epoch:
            sums, self._next.rows = self._next.sums, self._next.rows + len(offer.rows)
            overflowed, self._next.overflowed = self._next.overflowed, self._next.overflowed or overflow
        else:
            raise RuntimeError(f"task of epoch {offer.epoch} computed at epoch {self.epoch}")
        for accumulated, param_grad in zip(sums, param_grads):
            accumulated.add_(param_grad.to(accumulated.device, torch.float32), alpha=1.0 / factor)
        if overflow and not overflowed:
            logger.warning(f"worker {self.worker_id}: fp16 gradients of epoch {offer.epoch} overflowed at loss scale "
                           f"{self.master.loss_scale.value:g}; its stage will skip the step")
        return True

    async def _push(self, delivery: Awaitable[object]) -> None:
        """Deliver a task's result (`delivery` pushes it and counts what the server accepted): with push_behind in
        the background while the worker takes its next task, one result at a time and in order, else at once."""
        await self._pushed()
        if self.settings.push_behind:
            self._pushing = asyncio.ensure_future(delivery)
        else:
            await delivery

    async def _pushed(self) -> None:
        """Until the result on its way (push_behind) was accepted and counted, or refused."""
        pushing, self._pushing = self._pushing, None
        if pushing is not None:
            await pushing

    def _overflows(self, grads: list[torch.Tensor], *, epoch: int) -> bool:
        """Whether any of a task's gradients is inf or nan (fp16); the fault "overflow" makes one task's so."""
        if self.fault == "overflow" and epoch == OVERFLOW_EPOCH and not self.overflowed:
            grads[0].fill_(float("inf"))
        return not all(bool(torch.isfinite(grad).all()) for grad in grads)

    def _corrupt(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fault injection for tests of the servers' input checks (`NodeOptions.fault`)."""
        if self.fault == "wrong-shape":
            return tensor.reshape(-1)[: max(tensor.numel() - 1, 1)]
        if self.fault == "wrong-dtype":
            return tensor.double()
        if self.fault == "nan":
            return torch.full_like(tensor, float("nan"))
        return tensor

    async def _call(self, server: str, service: str, request: Request, *, attempts: int = 1) -> Message | None:
        """The server's reply; None if it refused the request or every attempt failed in transport."""
        try:
            return await self.caller.call_retrying(server, service, request, attempts=attempts,
                                                   backoff_s=self.settings.push_backoff_s,
                                                   backoff_max_s=self.settings.delivery_backoff_max_s,
                                                   what=request.method)
        except Refused as e:
            logger.info(f"worker {self.worker_id}: {server} refused {type(request).__name__}: {e}")
        except Exception as e:
            logger.warning(f"worker {self.worker_id}: {request.method} to {server} failed: {e!r}")
        return None

    async def _step(self, group: tuple[GroupMember, ...]) -> None:
        """The stage closed this epoch: average its gradients with the group the stage's first FS fixed, then step
        the master copy; with DPU in the background, after the previous epoch's update landed (module doc)."""
        rows, epoch = self.rows_accumulated, self.epoch
        if self.worker_id not in {member.peer_id for member in group}:
            await self.settle()
            if rows:  # the FS counted this worker as gone and had its rows redone by others
                logger.warning(f"worker {self.worker_id}: left out of the averaging group of epoch {epoch}; "
                               f"its {rows} rows were redone by others")
            else:  # joined as the epoch closed: nothing of it to hand in
                logger.info(f"worker {self.worker_id}: not in the averaging group of epoch {epoch}; skipping it")
            self._advance(epoch + 1)
            await self._take_stages_state()
            return
        grads, overflow = self._mean_gradients(), self.overflowed
        seconds = time.monotonic() - self._epoch_started
        self._epoch_started = time.monotonic()
        self._advance(epoch + 1)
        if self.master.outer is not None:
            await self.settle()
            await self._local_step(grads, epoch=epoch, rows=rows, group=group, seconds=seconds)
            return
        # the round starts as the epoch closes, at every member alike, even while this worker's update of the last
        # epoch is still in flight (DPU): members leave a failed round at different times (one that failed at once,
        # the others at their deadline), and a reducer that began its next round only after its last one ended would
        # leave its mates' parts of it waiting past their own deadlines, round after round
        averaging = asyncio.ensure_future(self._round(grads, epoch=epoch, weight=rows, group=group,
                                                      overflow=overflow, deposited=True))
        try:
            await self.settle()
            if self.config.dpu and self.config.dpu_lookahead and rows:
                await self._look_ahead(grads, epoch=epoch, rows=rows, group=group)
        except BaseException:
            averaging.cancel()
            raise
        update = self._average_and_step(averaging, epoch=epoch, rows=rows, group=group, seconds=seconds)
        if self.config.dpu:
            self._update = asyncio.create_task(update)
        else:
            await update
            self._take_master()

    async def _look_ahead(self, grads: list[torch.Tensor], *, epoch: int, rows: int,
                          group: tuple[GroupMember, ...]) -> None:
        """With DPU: compute the next epoch where a step on the stage's mean gradient of `epoch`, from its deposits,
        or else on this worker's own, takes the master copy (module doc)."""
        asked = time.monotonic()
        stage_mean = await self.averager.stage_mean(grads, epoch=epoch, group=group)
        ahead = stage_mean[0] if stage_mean is not None else grads
        logger.info(f"worker {self.worker_id}: looking ahead from epoch {epoch} on "
                    + (f"the stage's mean gradient over {stage_mean[1]} rows" if stage_mean is not None
                       else f"its own gradient over {rows} rows")
                    + f" (asked for in {time.monotonic() - asked:.3f} s)")
        # where this worker's rows are the stage's only ones, the round's average is its own gradient (a round of two
        # with the server holding its deposit, `StageAllReduce.average`): then the step in flight is the look-ahead's,
        # kept to be taken instead of stepping twice
        alone = not any(member.rows for member in group if member.peer_id != self.worker_id)
        self._ahead = self._model_ahead(ahead, epoch=epoch, keep=alone)

    async def _local_step(self, grads: list[torch.Tensor], *, epoch: int, rows: int, group: tuple[GroupMember, ...],
                          seconds: float) -> None:
        """DiLoCo (module doc): step on this worker's own gradients of `epoch` (a holder with no rows takes no
        step); at a round epoch, then average how far the master moved since the last round with the group and
        take the outer step."""
        if rows:
            lr = self.master.step(grads, epoch=epoch)
        else:
            lr = self.master.schedule.at(epoch)
            self.master.skip(epoch)
        self._interval_rows += rows
        if self.config.averages_at(epoch):
            weight, self._interval_rows = self._interval_rows, 0
            averaging = self._round([to_host(g) for g in self.master.pseudo_gradient()], epoch=epoch, weight=weight,
                                    group=group)
            await self._average_and_step(averaging, epoch=epoch, rows=rows, group=group, seconds=seconds)
        else:
            self.history.append(EpochRecord(epoch=epoch, rows=rows, tokens=rows * self.config.seq_len, averaged=True,
                                            seconds=seconds, digest=self.master.digest(), lr=lr))
            if self.after_step is not None:
                await self.after_step(self)
        self._take_master()

    def _mean_gradients(self) -> list[torch.Tensor]:
        """What this worker hands in for its epoch (to the round, and deposited before it), on the host: its mean
        gradient per token, which the round weights by its rows, so that the average is the batch mean."""
        tokens = self.rows_accumulated * self.config.seq_len
        return [to_host(accumulated / tokens if tokens else torch.zeros_like(accumulated))
                for accumulated in self.accumulated]

    async def _round(self, grads: list[torch.Tensor], *, epoch: int, weight: int, group: tuple[GroupMember, ...],
                     overflow: bool = False, deposited: bool = False) -> Averaged:
        """Average `grads`, weighing `weight` rows (the epoch's; the interval's with an outer optimizer), with the
        group (`overflow`: fp16 gradients of some of them overflowed; `deposited`: they are the epoch's gradients,
        deposited before the round, `StageAllReduce.average`); no failure raises, the result says it."""
        logger.info(f"worker {self.worker_id}: averaging epoch {epoch} ({weight} rows) in a group of {len(group)}")
        self._averaging_with[epoch] = frozenset(member.peer_id for member in group)
        skipped: set[int] = set()  # shared tensors whose norm another stage counts
        try:
            if self.fault == "slow-averaging":
                await asyncio.sleep(SLOW_AVERAGING_S)
            if self.fault == "failed-averaging" and epoch == FAILED_AVERAGING_EPOCH:
                raise RuntimeError(f"fault failed-averaging: the round of epoch {epoch} fails here on purpose")
            averaged, result = await self.averager.average(grads, epoch=epoch, rows=weight, group=group,
                                                           overflow=overflow, deposited=deposited)
            if self.shared_averager is not None and result.ok:
                averaged, skipped = await self._combine_shared(averaged, epoch=epoch, rows=weight, group=group)
        except SharedRoundFailed as e:  # even a lone worker of its stage must not step its shared copies alone
            return Averaged(grads, RoundResult(group_size=0, ok=False, reason=str(e)), shared_failed=True)
        except Exception as e:  # whatever went wrong, no averaging failure ends the worker: a failed round
            return Averaged(grads, RoundResult(group_size=0, ok=False, reason=repr(e)))
        finally:
            self._averaging_with.pop(epoch, None)
        return Averaged(averaged, result, skipped=skipped)

    async def _average_and_step(self, averaging: Awaitable[Averaged], *, epoch: int, rows: int,
                                group: tuple[GroupMember, ...], seconds: float) -> None:
        """Step on the round `averaging` of `epoch` (`_round`), unless it failed."""
        self._stepping = epoch
        try:
            await self._step_on(await averaging, epoch=epoch, rows=rows, group=group, seconds=seconds)
        finally:
            self._stepping, self._ahead = None, None

    async def _step_on(self, round_: Averaged, *, epoch: int, rows: int, group: tuple[GroupMember, ...],
                       seconds: float) -> None:
        averaged, result, skipped, shared_failed = round_.averaged, round_.result, round_.skipped, round_.shared_failed
        if self.master.epoch > epoch:
            # with DPU, the mate's state its last update reloaded was stepped on this epoch already: a step of its own
            # would take this epoch's twice (without DPU, loading it moved the worker past this epoch)
            logger.info(f"worker {self.worker_id}: stage {self.stage} not stepping epoch {epoch}: the state it took "
                        f"from a mate is of epoch {self.master.epoch}")
            self.history.append(EpochRecord(epoch=epoch, rows=rows, tokens=rows * self.config.seq_len,
                                            averaged=result.ok, seconds=seconds, digest=self._digest_after(epoch),
                                            lr=self.master.schedule.at(epoch)))
            return
        if shared_failed or _failed(result, group):
            # a step on its own gradients would leave this peer's parameters apart from its mates' for good: it skips
            # the step and takes a mate's state after its next round instead
            logger.error(f"worker {self.worker_id}: stage {self.stage} averaging of epoch {epoch} failed "
                         f"({result.reason}); not stepping, reloading the stage's state from a mate after the next "
                         "round")
            self._stale = True
            # no digest: its parameters are of the epoch before, not the stage's after this step. A groupmate that
            # dies mid-round can fail the round for some members while others complete it, and a digest here would
            # read as replicas standing apart; the failure is counted as such (`round_failed`)
            self.history.append(EpochRecord(epoch=epoch, rows=rows, tokens=rows * self.config.seq_len,
                                            averaged=False, seconds=seconds, round_failed=True,
                                            lr=self.master.schedule.at(epoch)))
            return
        lr, norm, overflow = self.master.schedule.at(epoch), None, False  # now: the swarm's decision
        scale = self.master.loss_scale
        scaled_by = scale.value if scale is not None else None
        if self._stale and await self._reload():
            logger.info(f"worker {self.worker_id}: stage {self.stage} took a mate's state after epoch {epoch} in "
                        "place of its own step (its previous round failed)")
        else:
            self._stale = False
            if self.config.clip_norm or scale is not None:
                norm, overflow = await self._global_step([g for i, g in enumerate(averaged) if i not in skipped],
                                                         epoch, members=len(group), overflow=result.overflow)
            if overflow:
                self.master.skip(epoch)
                logger.warning(f"worker {self.worker_id}: stage {self.stage} skipped the step of epoch {epoch}: the "
                               f"swarm's fp16 gradients overflowed at loss scale {scaled_by:g}")
            else:
                adopted = self._apply(averaged, epoch=epoch, norm=norm if self.config.clip_norm else None)
                logger.info(f"worker {self.worker_id}: stage {self.stage} stepped epoch {epoch} ({rows} rows, averaged "
                            f"in a group of {result.group_size}, lr {lr:.3g}"
                            + (f", global gradient norm {norm:.4g}" if norm is not None else "")
                            + (", the look-ahead's step" if adopted else "") + ")")
            if scale is not None:
                scale.update(overflow=overflow)
        self.history.append(EpochRecord(
            epoch=epoch, rows=rows, tokens=rows * self.config.seq_len, averaged=result.ok, seconds=seconds,
            digest=self._digest_after(epoch), lr=lr, grad_norm=norm, rows_lost=result.rows_lost,
            unclipped=bool(self.config.clip_norm) and norm is None and not overflow, overflow=overflow,
            loss_scale=scaled_by))
        if self.after_step is not None:
            await self.after_step(self)

    def _digest_after(self, epoch: int) -> Digest:
        """Of the master copy, where it holds the stage's parameters after the step of `epoch`; none where it took a
        mate's state of a later epoch instead (DPU), which no holder's digest of `epoch` is of."""
        return self.master.digest() if self.master.epoch == epoch + 1 else ()

    def _apply(self, averaged: list[torch.Tensor], *, epoch: int, norm: float | None) -> bool:
        """Step the master copy on the stage's averaged gradients, clipped by the global norm; with an outer
        optimizer, the outer step on the averaged pseudo-gradients (its inner step on `epoch` was taken already).
        True if the step was the look-ahead's, taken on the same gradients, and adopted."""
        scale = clip_coefficient(norm, self.config.clip_norm) if norm is not None else 1.0
        self._clip_scale = scale
        grads = [grad * scale for grad in averaged] if scale < 1.0 else averaged
        adopted = False
        if self.master.outer is not None:
            self.master.outer_step(grads)
        else:
            adopted = self._ahead is not None and self.master.adopt(self._ahead, grads, epoch=epoch) is not None
            if not adopted:
                self.master.step(grads, epoch=epoch)
        if self.dump_dir is not None:
            self._dump_step(epoch, grads)
        return adopted

    async def _take_stages_state(self) -> None:
        """The stage stepped without this worker (it was left out of a group, or it catches up): take its parameters
        from a mate. Where none serves one yet (its mates may still be stepping, or be out of reach), its own stand
        apart from the stage's for good unless it is marked stale: then it takes a mate's state after its next round."""
        if self.download_state is not None and await self.download_state(self) is None:
            logger.warning(f"worker {self.worker_id}: stage {self.stage} stepped without it and no mate served its "
                           "state; it takes a mate's state after its next round")
            self._stale = True

    async def _reload(self) -> bool:
        """After a failed round, or an epoch the stage stepped without it (`_take_stages_state`), this worker's
        parameters stand apart from its mates'; once a round succeeds again it takes a mate's state,
        stepped by that round, in place of stepping its own. It asks only after the round, so that a mate serving it
        waits for nothing this worker still owes. False if no mate could serve (stale mates refuse: their parameters
        did not move either, and this worker steps with them)."""
        if self.download_state is None or await self.download_state(self) is None:
            return False
        self._stale = False
        return True

    async def _combine_shared(self, averaged: list[torch.Tensor], *, epoch: int, rows: int,
                              group: tuple[GroupMember, ...]) -> tuple[list[torch.Tensor], set[int]]:
        """The stage's average with its shared tensors' part summed over every stage that holds them, in one round
        across those stages' groups per set of them (`protocol.sharing`); and the indices of the shared tensors whose
        norm another stage counts (the first holder does), so the global norm counts each once. Raises if the data
        source names no groups in time or a round does not average every member."""
        entry = StageGroup(stage=self.stage, group=group, shared=tuple(sorted(set(self.shared_keys.values()))))
        wait_s = self.averager.deadline_s(self.config.num_stages * sum(g.numel() for g in averaged),
                                          members=len(group))
        stages = await self._ask_data_source(ReportGroup(epoch=epoch, group=entry), lambda reply: reply.stages,
                                             wait_s=wait_s)
        if stages is None:
            raise SharedRoundFailed(f"the data source named no groups of epoch {epoch} of the stages that share "
                                    f"tensors within {wait_s:.0f} s")
        index = {key: i for i, key in self.shared_keys.items()}
        combined, skipped = list(averaged), set()
        for shared in shared_rounds(stages, self.stage):
            indices = [index[key] for key in shared.keys]
            parts, result = await self.shared_averager.average([averaged[i] for i in indices], epoch=epoch, rows=rows,
                                                               group=shared.members)
            if not result.ok or result.group_size != len(shared.members):
                # a member lost in it takes its stage's weight out of the mean, which then is no longer the sum's
                raise SharedRoundFailed(f"the round of the tensors stages {shared.stages} share did not average "
                                        f"all {len(shared.members)} members "
                                        f"({result.reason or f'{result.group_size} did'})")
            for i, part in zip(indices, parts):
                combined[i] = part * len(shared.stages)
            if self.stage != shared.stages[0]:
                skipped.update(indices)
        return combined, skipped

    async def _ask_data_source(self, request: Request, answer: Callable[[Message], T | None], *,
                               wait_s: float) -> T | None:
        """Ask the data source `request` until `answer` finds what it waits for in a reply; None after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            keeper = self.norm_keeper()
            reply = await self._call(keeper, FRONTAL_SERVER, request) if keeper is not None else None
            found = answer(reply) if reply is not None else None
            if found is not None:
                return found
            await asyncio.sleep(self.settings.norm_poll_s)
        return None

    async def _global_step(self, averaged: list[torch.Tensor], epoch: int, *, members: int, overflow: bool
                           ) -> tuple[float | None, bool]:
        """The norm of the whole model's averaged gradient, and whether any stage's overflowed (fp16): this stage's
        part goes to the data source, which answers once every stage's has. No norm if none comes within the
        deadline of as many rounds as there are stages, one after another on this member's link (the slowest stage's
        round ends last; the data source may be gone, or a stage never reported): the step is then not clipped, which
        a warning and the status say (`unclipped`), rather than clipped by a norm the other stages do not share; and
        the stage's own `overflow`, which its mates read alike, decides the skip."""
        squared = math.fsum(grad.double().square().sum().item() for grad in averaged)
        request = ReportNorm(epoch=epoch, stage=self.stage, squared_norm=squared, overflow=overflow)
        wait_s = self.averager.deadline_s(self.config.num_stages * sum(grad.numel() for grad in averaged),
                                          members=members)
        reply = await self._ask_data_source(request, lambda reply: reply if reply.norm is not None else None,
                                            wait_s=wait_s)
        if reply is not None:
            return reply.norm, reply.overflow
        logger.warning(f"worker {self.worker_id}: no global gradient norm of epoch {epoch} within "
                       f"{wait_s:.0f} s; stepping unclipped" + (", skipping by its stage's overflow" if overflow else ""))
        return None, overflow

    def _advance(self, epoch: int) -> None:
        """Move to `epoch`, dropping what this worker holds of the current one: averaged by a step just taken, or
        never to be averaged (a worker that catches up or was left out); what it computed of `epoch` already, begun
        before its stage closed this one, is its epoch's now."""
        began, self._next = self._next, None
        self._counted = {key for key in self._counted if key[0] >= epoch}
        if began is not None and began.epoch == epoch:
            self.accumulated, self.rows_accumulated, self.overflowed = began.sums, began.rows, began.overflowed
            self.cache = {task: state for task, state in self.cache.items() if state.epoch == epoch}
            self.epoch, self.epoch_fs = epoch, began.fs
            return
        for accumulated in self.accumulated:
            accumulated.zero_()
        self.rows_accumulated, self.overflowed = 0, False
        self.epoch, self.epoch_fs = epoch, ()
        self.cache.clear()

    def _dump_step(self, epoch: int, applied: list[torch.Tensor]) -> None:
        """Save the gradients the optimizer applied (the stage's average, clipped) and the parameters it stepped
        to, for the tests that compare them with one process."""
        named = list(self.master.module.named_parameters())
        trainable = [name for name, p in named if p.requires_grad]
        grads = {name: grad.detach().clone() for name, grad in zip(trainable, applied)}
        params = {name: p.detach().clone() for name, p in named}
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"stage": self.stage, "layers": [self.model.start, self.model.end], "grads": grads,
                    "params": params}, self.dump_dir / f"stage{self.stage}-{self.worker_id}-epoch{epoch}.pt")


class SharedRoundFailed(RuntimeError):
    """The tensors this stage shares with others were not summed across them (`Worker._combine_shared`)."""


def _failed(result: RoundResult, group: tuple[GroupMember, ...]) -> bool:
    """A round of several workers that did not average: a lone worker's round has nothing to fail."""
    return len(group) > 1 and not result.ok
