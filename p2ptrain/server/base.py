"""What the frontal and backward servers of a stage share: the epoch bookkeeping, the task pool and the workers
seen, long polls for tasks, and how a worker's result is checked, confirmed with the server that issued its task,
or refused.

A result is accepted only once its task's issuer confirms it (`ReportTask` with ok, which completes the task in
the issuer's pool), so a result for a task nobody handed out never enters the ledger or the gradients, and no row
counts twice. A confirmation is idempotent: the issuer remembers whose result it confirmed, and confirms the same
(task, worker) again, so the confirming server can ask again when a reply is lost in transport (hivemind streams
here sometimes end early under load). A result that fails a check is refused, counted against its worker, and
reported to the issuer, which hands the task to another worker.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

from hivemind.p2p import P2PContext

from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.live.probe import dial_failure
from p2ptrain.protocol.deadlines import transfer_deadline_s
from p2ptrain.protocol.layout import Layout, ServerRole
from p2ptrain.protocol.messages import (
    Ack,
    AskEpoch,
    EndEpoch,
    EpochState,
    Leave,
    MicrobatchRef,
    ReportTask,
    Request,
    TakeTask,
    TaskReply,
)
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.taskpool import Task, TaskPool
from p2ptrain.server.state import EpochStats, MicrobatchInputs, MicrobatchOutputs, ServerState, WorkerRecord
from p2ptrain.transport import Caller, Forbidden, Hearing, Refused, Requests, Responses, Service

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=ServerState)
TASK_ID_PEER = 8  # characters of the issuer's peer id in a task id: base58, so 58**8 ids
SPEED_MEMORY = 0.7  # weight of a worker's past tasks in its measured time per row
M = TypeVar("M", MicrobatchInputs, MicrobatchOutputs)


class IssuerUnreachable(Refused):
    """A result's issuer could not be reached to confirm it (killed, or its link is down), as against refusing it."""


class Progress:
    """Wakes whoever waits on a server's progress (the data source beside the stage-0 FS) as it happens, instead of
    letting it look every few milliseconds: a microbatch done, an epoch closed or its rows dropped (`moved`)."""

    def __init__(self) -> None:
        self._moved = asyncio.Event()

    def moved(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()  # those waiting hold the one just set; later waits take this one

    async def until(self, ready: Callable[[], bool], stop: asyncio.Event, *, check_s: float) -> bool:
        """Once `ready()` holds (True), or `stop` is set (False), looking at `stop` every `check_s` meanwhile."""
        while not ready():
            if stop.is_set():
                return False
            moved = self._moved
            try:
                await asyncio.wait_for(moved.wait(), check_s)
            except asyncio.TimeoutError:
                pass
        return True


class Authority(Protocol):
    """The servers a run's owner authorized, as this server last read their records
    (`dht.membership.MembershipCache` given the owner key)."""

    def data_source(self) -> str | None: ...

    def authorizes(self, peer: str, stage: int, role: ServerRole) -> bool: ...

    async def refreshed(self, timeout: float) -> None: ...


class StageServer(Service, Generic[S]):
    """Base of FrontalServer and BackwardServer: one per server process, registered on its P2P.

    Owns its `state` (everything it knows of open epochs) and nothing else; it reaches other peers only through its
    `caller`, and learns the run's shape from the recipe (`config`), never from messages. In a run with an owner,
    it learns who may serve and feed it from the owner's certificates (`authority`), never from messages either: a
    layout naming a server the owner did not authorize, or another data source, is refused.
    """

    role: ClassVar[ServerRole]
    other_service: ClassVar[str]  # the service of the other role of the stage, which it confirms tasks with
    state_type: ClassVar[type[ServerState]]

    def __init__(self, *, peer_id: str, stage: int, config: RunConfig, settings: RuntimeConfig, caller: Caller,
                 state: S | None = None, clock: Callable[[], float] = time.monotonic, authority: Authority | None = None,
                 hearing: Hearing | None = None):
        # `hearing`: the node's, shared with its other servicers (gradient deposits), in this server's clock
        super().__init__(peer_id=peer_id, name=f"stage {stage} {self.role.upper()}", codec=config.compression,
                         hearing=Hearing(clock=clock) if hearing is None else hearing)
        if not 0 <= stage < config.num_stages:
            raise ValueError(f"stage {stage} is not in 0..{config.num_stages - 1}")
        self.stage, self.config, self.settings, self.caller, self.clock = stage, config, settings, caller, clock
        self.authority = authority
        pool = TaskPool(lease_timeout=settings.lease_timeout_s)
        self.state: S = state if state is not None else self.state_type(pool=pool)
        # set whenever a held task poll may have an answer: a task added or back in the pool, an epoch closed,
        # abandoned or (at an FS) all its rows back
        self.news = asyncio.Event()
        self.progress = Progress()
        # rows of results whose issuer is confirming them: no other copy of those rows may get in meanwhile
        self._confirming: dict[tuple[int, int], list[Rows]] = {}
        caller.add_local(self)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.config.num_stages - 1

    @property
    def hidden_shape(self) -> tuple[int, int]:
        """A row of hidden states at a stage boundary: (seq_len, hidden)."""
        return self.config.seq_len, self.config.model_config.hidden_size

    # -- tasks and workers ---------------------------------------------------------------------------------------

    def rpc_take_task(self, requests: Requests, context: P2PContext) -> Responses:
        """A worker asks for a task of its epoch."""
        return self.serve(requests, context, TakeTask, self.take_task)

    async def take_task(self, request: TakeTask, sender: str) -> TaskReply:
        self.check_sender(request.worker, sender)
        record = self._worker(request.worker, request.epoch)
        record.compute, record.epoch, record.last_seen = request.compute, request.epoch, self.clock()
        record.client_mode, record.holds_state = request.client_mode, request.holds_state
        record.deposited = request.deposited
        self.tick()
        task = await self.long_poll_task(request.worker, epoch=request.epoch, wait_s=request.wait_s,
                                         idle_wait_s=request.idle_wait_s, ahead=request.ahead)
        if task is not None:
            # a task of the next epoch may come while its deposit of this one is due: it deposits as it computes (a
            # task of this one never does: a deposit is owed only once every row of the epoch is back)
            owed = self.deposit_owed(request.worker, request.epoch) if task.epoch > request.epoch else None
            return dataclasses.replace(self.offer(task), deposit_to=owed)
        return dataclasses.replace(self.no_task(epoch=request.epoch),
                                   quiet=self.quiet(request.epoch, holds_state=record.holds_state))

    def offer(self, task: Task) -> TaskReply:
        raise NotImplementedError

    def tick(self) -> None:
        """What a role does on each task poll, besides handing out work."""

    def no_task(self, *, epoch: int) -> TaskReply:
        """The reply to a poll of a worker in `epoch` that found no task."""
        return TaskReply(closed_epoch=self.state.closed_epoch)

    def new_task_id(self, epoch: int, microbatch: int, letter: str) -> str:
        """Unique in the swarm, not only here: with several FS (or BS) in a stage, a worker may hand one server's task
        to a server that keys results by task id and worker (a BS's ledger, an FS's accepted results)."""
        self.state.task_counter += 1
        return f"{epoch}:{microbatch}:{self.stage}:{letter}{self.state.task_counter}.{self.peer_id[-TASK_ID_PEER:]}"

    def add_task(self, task: Task) -> None:
        self.state.pool.add(task)
        self.news.set()

    def _worker(self, worker: str, epoch: int) -> WorkerRecord:
        record = self.state.workers.get(worker)
        if record is None:
            record = self.state.workers[worker] = WorkerRecord(compute=1.0, last_seen=0.0, epoch=epoch)
            if self.role == "fs":  # workers poll every FS of their stage: the stage's FS count joins alone
                self.epoch_stats(self.state.closed_epoch + 1).workers_joined += 1
        return record

    def condition(self) -> str:
        """What this server's stage is doing, as far as it sees: "training", "waiting for workers" (none polled
        lately) or "workers banned" (every one that did is banned for refused results)."""
        now, recent = self.clock(), self.settings.active_worker_s
        seen = [r for r in self.state.workers.values() if now - r.last_seen <= recent and not r.left
                and not r.holds_state]
        if not seen:
            return "waiting for workers"
        if all(self.excluded(record) for record in seen):
            return "workers banned"
        return "training"

    def expect_replica(self, peer_id: str) -> None:
        """A replica of the stage's state (a worker that holds it and takes no tasks: this server's own, or another
        server's that announced itself) is counted from the start: an epoch that completes before the replica's first
        poll (it finds this server in the DHT only once announced) waits for that poll, unless it stays silent for
        `worker_lost_s`, instead of closing without it and leaving the replica to catch up by download."""
        record = self._worker(peer_id, self.state.closed_epoch + 1)
        record.last_seen, record.holds_state = self.clock(), True

    def see_result(self, worker: str, *, epoch: int, client_mode: bool) -> None:
        """A worker that hands in a result is alive, even if it has not polled this server lately (it may have
        taken all its work from another server of the stage)."""
        record = self._worker(worker, epoch)
        record.last_seen = record.last_result = self.clock()
        record.client_mode = client_mode

    def excluded(self, record: WorkerRecord) -> bool:
        """A worker that gets no work here: banned for now for refused results, or gone by its own word."""
        return record.left or self.clock() < record.banned_until

    def may_work(self, worker: str, epoch: int) -> bool:
        """Whether `worker` may take tasks of `epoch` here."""
        return True

    def lease_for(self, worker: str, task: Task) -> float:
        """How long `worker` may take on `task`: a few times what its tasks took here per row (transfers included,
        so it follows the worker's link), at most the bound a task's bytes allow, which a worker not timed yet gets:
        `lease_timeout_s` plus the time the task's activations in and out need at the slowest uplink allowed for."""
        settings = self.settings
        seq, hidden = self.hidden_shape
        moved = 2 * len(task.rows) * seq * hidden * 4  # float32 activations (or their gradients) in and out
        bound = transfer_deadline_s(moved, rate=settings.slowest_uplink, floor_s=settings.lease_timeout_s,
                                    slack=settings.deadline_slack)
        record = self.state.workers.get(worker)
        if record is None or record.seconds_per_row is None:
            return bound
        return min(bound, max(settings.lease_min_s, settings.lease_slack * len(task.rows) * record.seconds_per_row))

    def active_workers(self, *, within_s: float | None = None) -> dict[str, float]:
        """The compute of each worker that polled within `within_s` and is not excluded (servers that only hold the
        stage's state compute nothing)."""
        now, within = self.clock(), self.settings.active_worker_s if within_s is None else within_s
        return {
            worker: record.compute for worker, record in self.state.workers.items()
            if now - record.last_seen <= within and not self.excluded(record) and not record.holds_state
        }

    def rpc_leave(self, requests: Requests, context: P2PContext) -> Responses:
        """A worker stops: what it holds goes to the others now."""
        return self.serve(requests, context, Leave, self.leave)

    async def leave(self, request: Leave, sender: str) -> Ack:
        self.check_sender(request.worker, sender)
        record = self.state.workers.get(request.worker)
        if record is not None and not record.left:
            record.left = True
            tasks = self.state.pool.requeue_worker(request.worker)
            logger.info(f"{self.name}: worker {request.worker} leaves; {len(tasks)} task(s) back in the pool")
            self.news.set()
            self.tick()
        return Ack()

    async def long_poll_task(self, worker: str, *, epoch: int, wait_s: float, idle_wait_s: float,
                             ahead: bool = False) -> Task | None:
        """Take a task for `worker`, waiting up to `wait_s` for one to appear, or up to `idle_wait_s` while the stage
        is `quiet` (then only news ends the wait: a poll answered sooner would only be asked again). `ahead`: one of
        the next epoch if none of `epoch` is left and nothing of `epoch` is `due` (`RunConfig.overlap_epochs`)."""
        record = self.state.workers.get(worker)
        holds_state = record is not None and record.holds_state  # its poll only keeps it in the averaging group
        if not holds_state and ((record is not None and self.excluded(record)) or not self.may_work(worker, epoch)):
            return None
        # a worker is heard when it polls: an idle hold ends well before this server would count it gone
        idle_s = min(idle_wait_s, self.settings.worker_lost_s / 2)
        loop = asyncio.get_running_loop()  # the hold is a wait of this loop, whatever clock the server keeps
        start = loop.time()

        def take(of: int) -> Task | None:
            return self.state.pool.take(worker, now=self.clock(), epoch=of,
                                        lease_s=lambda task: self.lease_for(worker, task))

        while True:
            if not holds_state:
                self.expire_leases()
                if (task := take(epoch)) is not None:
                    return task
            ahead_task = ahead and not holds_state and self.may_work(worker, epoch + 1)
            if self.due(worker, epoch):
                # holding the poll would only delay what its reply tells the worker to do; only a deposit it owes
                # leaves it free to compute the next epoch's task meanwhile (its reply says where to deposit)
                if ahead_task and self.deposit_owed(worker, epoch) is not None and (task := take(epoch + 1)) is not None:
                    return task
                return None
            if ahead_task and (task := take(epoch + 1)) is not None:
                return task
            held = max(wait_s, idle_s) if self.quiet(epoch, holds_state=holds_state) else wait_s
            remaining = start + held - loop.time()
            if remaining <= 0:
                return None
            self.news.clear()
            try:
                await asyncio.wait_for(self.news.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def due(self, worker: str, epoch: int) -> bool:
        """Whether the reply to a poll of `worker` in `epoch` that finds no task tells it to act now (deposit its
        gradients, step, catch up): then the poll is answered at once, not held."""
        return False

    def deposit_owed(self, worker: str, epoch: int) -> str | None:
        """Where `worker` is to deposit its gradients of its open `epoch` now (a due deposit, `due`), if it is."""
        return None

    def quiet(self, epoch: int, *, holds_state: bool) -> bool:
        """Whether nothing but news (`news`) can change what a poll of a worker in `epoch` is answered: no task can
        appear at any server of the stage, and no closure or deposit is due, until rows come. Only an FS can tell."""
        return False

    def expire_leases(self) -> None:
        now, pool = self.clock(), self.state.pool
        for task in pool.expire(now=now):
            logger.warning(f"{self.name}: task {task.task_id} timed out, back in the pool")
            self.news.set()
        for worker, record in self.state.workers.items():
            if self.gone(worker) and pool.leased_to(worker):
                tasks = pool.requeue_worker(worker)
                silent = now - self.heard(worker, record)
                logger.warning(f"{self.name}: worker {worker} gone (silent for {silent:.1f} s); its "
                               f"{len(tasks)} task(s) back in the pool")
                self.news.set()
        self.probe_silent()

    def heard(self, worker: str, record: WorkerRecord) -> float:
        """When `worker` was last heard from: its last poll or result, or the last bytes of any request of it to this
        node, a transfer still arriving on a slow link included (`Hearing`)."""
        return max(record.last_seen, self.hearing.last(worker))

    def gone(self, worker: str) -> bool:
        """Whether a known worker is gone: silent for `worker_lost_s` (`heard`), or its process could not be reached
        since it was last heard from (a probe's dial failed). The stage's replica in this server's own process lives
        as long as the server: its loop may be held past `worker_lost_s` by a round that fails at its deadline, and
        left out of the next group, the replica would fall behind the stage's workers."""
        if worker == self.peer_id:
            return False
        record = self.state.workers[worker]
        heard = self.heard(worker, record)
        return self.clock() - heard >= self.settings.worker_lost_s or record.unreachable > heard

    def gradient_holders(self) -> set[str]:
        """The workers that hold parameter gradients of rows of an open epoch that this server counts on."""
        return set()

    def probe_silent(self) -> None:
        """Probe once each worker silent for `probe_silent_s` that holds work here: a killed process is then known
        gone at once (its dial fails) rather than after `worker_lost_s`."""
        now, holders = self.clock(), None
        for worker, record in self.state.workers.items():
            heard = self.heard(worker, record)
            if now - heard < self.settings.probe_silent_s or record.probed > heard or record.left:
                continue
            if holders is None:
                holders = self.gradient_holders()
            if worker in holders or self.state.pool.leased_to(worker):
                record.probed = now
                self.spawn(self._probe(worker, record), what=f"probing worker {worker}")

    async def _probe(self, worker: str, record: WorkerRecord) -> None:
        error = await dial_failure(self.caller, worker, timeout=self.settings.liveness_timeout_s)
        if error is None or self.heard(worker, record) >= record.probed:
            return  # it answered (or was only slow), or was heard from meanwhile
        record.unreachable = self.clock()
        logger.warning(f"{self.name}: worker {worker} cannot be reached ({type(error).__name__}: {error}); gone")
        self.expire_leases()
        self.tick()

    # -- reports between the servers of a stage -----------------------------------------------------------------

    def rpc_task_result(self, requests: Requests, context: P2PContext) -> Responses:
        """The other role's server accepted (confirm and complete it) or refused a result of a task issued here."""
        return self.serve(requests, context, ReportTask, self.task_result)

    async def task_result(self, request: ReportTask, sender: str) -> Ack:
        task = self.state.pool.get(request.task)
        if task is not None and sender != self.peer_id:
            mb = self.state.microbatches.get((task.epoch, task.microbatch))
            if mb is not None and sender not in mb.layout.stages[self.stage].of(self.other_role):
                raise Forbidden(f"{sender} is no {self.other_role.upper()} of stage {self.stage} for task "
                                f"{request.task}")
        if not request.ok:
            if self.state.pool.fail(request.task, request.worker) is None:
                raise Refused(f"task {request.task} is not leased to {request.worker}")
            self.news.set()
            return Ack()
        return self.settle(request, sender)

    @property
    def other_role(self) -> ServerRole:
        return "bs" if self.role == "fs" else "fs"

    def settle(self, report: ReportTask, sender: str) -> Ack:
        """Complete a task whose result `sender` accepted, or confirm again one completed for the same worker before;
        Refused if it is not this server's to complete."""
        if (report.task, report.worker) in self.state.settled.get(report.epoch, ()):
            return Ack(again=True)
        task, lease = self.state.pool.get(report.task), self.state.pool.lease(report.task)
        if (task is None or task.epoch != report.epoch or not self.may_complete(task, sender)
                or not self.state.pool.complete(report.task)):
            raise Refused(f"task {report.task} of {report.worker} is not done here, or was done by another worker")
        record = self.state.workers.get(report.worker)
        if lease is not None and lease.worker == report.worker and record is not None:
            took = (self.clock() - lease.taken) / len(task.rows)
            record.seconds_per_row = took if record.seconds_per_row is None else (
                SPEED_MEMORY * record.seconds_per_row + (1 - SPEED_MEMORY) * took)
        self.state.settled.setdefault(task.epoch, set()).add((report.task, report.worker))
        self.completed(task)
        return Ack()

    def may_complete(self, task: Task, sender: str) -> bool:
        """Whether `sender`'s confirmation may complete `task` of this server's pool."""
        return True

    def completed(self, task: Task) -> None:
        """What follows in this role when one of its tasks is complete."""

    async def confirm(self, issuer: str, *, task: str, worker: str, epoch: int) -> None:
        """Have `issuer` complete the task in its pool before this server counts the result; Refused if it will not
        (the task is unknown to it, or done by another worker), IssuerUnreachable if it cannot be reached. Asks again
        when the transport fails: the issuer may have completed the task and only the reply been lost, and then it
        confirms again."""
        service = self.service if issuer == self.peer_id else self.other_service
        report = ReportTask(task=task, worker=worker, epoch=epoch, ok=True)
        try:
            await self.retrying(issuer, service, report, attempts=self.settings.push_attempts,
                                what=f"confirming task {task}")
        except Refused as e:
            raise Refused(f"{issuer} does not confirm task {task} of {worker}: {e}") from None
        except Exception as e:
            raise IssuerUnreachable(f"could not confirm task {task} with {issuer}: {e!r}") from None

    async def retrying(self, peer: str, service: str, request: Request, *, attempts: int | None, what: str,
                       moot: Callable[[], bool] | None = None) -> Any:
        """A call to another server, made again on transport failures (`Caller.call_retrying`)."""
        return await self.caller.call_retrying(peer, service, request, attempts=attempts,
                                               backoff_s=self.settings.push_backoff_s,
                                               backoff_max_s=self.settings.delivery_backoff_max_s, what=what,
                                               moot=moot)

    def ended(self, epoch: int) -> bool:
        """Whether `epoch` is over here: closed, or abandoned (`EndEpoch`)."""
        return self.state.closed_epoch >= epoch or epoch in self.state.abandoned

    async def deliver(self, peer: str, service: str, request: Request, *, epoch: int, what: str) -> bool:
        """Push `request` of `epoch` to another server until it lands: True once accepted, False if refused. A
        transport failure is retried with exponential backoff for as long as the epoch is open here, since the
        receiver takes a repeated push as the same one (rows it holds already are acknowledged again), and a
        microbatch must never be left half-delivered; once the epoch was abandoned (the receiver may be gone for
        good), nothing of it needs delivering."""
        try:
            await self.retrying(peer, service, request, attempts=None, what=what, moot=lambda: self.ended(epoch))
            return True
        except Refused as e:
            logger.error(f"{self.name}: {peer} refused {what}: {e}")
        except Exception as e:
            logger.info(f"{self.name}: epoch {epoch} ended here; {what} to {peer} dropped ({e!r})")
        return False

    # -- the end of an epoch, from the data source ---------------------------------------------------------------

    def rpc_end_epoch(self, requests: Requests, context: P2PContext) -> Responses:
        """The data source commits an epoch (an FS may close it) or abandons it (drop all of it)."""
        return self.serve(requests, context, EndEpoch, self.end_epoch)

    async def end_epoch(self, request: EndEpoch, sender: str) -> Ack:
        epoch, layout = request.epoch, request.layout
        await self.check_authorized(layout)
        self.check_source(sender, layout)
        if len(layout.stages) != self.config.num_stages:
            raise Refused(f"epoch {epoch}'s layout has {len(layout.stages)} stages; this run has "
                          f"{self.config.num_stages}")
        # an abandon reaches servers laid out after the epoch too (`DataFeeder`): one took no part in it, but the
        # workers that held rows of it may poll it next and must hear that it was abandoned; otherwise its start at
        # the next epoch would stand past it with no closure of it, which they take for their stage having stepped
        # it without them (`protocol.closure.judge`)
        member = self.peer_id in layout.stages[self.stage].of(self.role)
        if not member and not request.abandoned:
            raise Refused(f"this server is no {self.role.upper()} of stage {self.stage} in epoch {epoch}'s layout")
        if {mb.layout for key, mb in self.state.microbatches.items() if key[0] == epoch} - {layout}:
            raise Refused(f"epoch {epoch} came here with another layout")
        if request.caught_up:
            return self.catch_up(epoch)
        if not request.abandoned:
            return self.commit(epoch, batch=request.batch, layout=layout)
        if self.ended(epoch):
            if not member:
                return Ack(again=True)
            stats = self.state.epochs.get(epoch)
            if self.closes_by_commit and self.state.closed_epoch >= epoch and not (stats and stats.abandoned):
                raise Refused(f"epoch {epoch} was committed and closed here; it cannot be abandoned")
            if stats is not None:  # a BS closes an epoch once its rows are through, which steps nothing
                stats.abandoned = True
            return Ack(again=True)
        state = self.state
        if not member and state.microbatches:
            raise Refused(f"this server took no part in epoch {epoch} but holds rows of others; it cannot close it")
        self._skip_to(epoch)
        self.drop_epoch(epoch)
        self._forget_held(epoch)
        self.epoch_stats(epoch).abandoned = True
        state.abandoned[epoch] = layout.stages[self.stage].fs
        logger.warning(f"{self.name}: epoch {epoch} abandoned by the data source; what was held of it is dropped")
        self.close_ready()  # at once, unless an earlier epoch is still closing here
        self.news.set()  # long polls waiting on the epoch answer now
        return Ack()

    def catch_up(self, epoch: int) -> Ack:
        """Its stage stands past `epoch` (its mates restored a newer checkpoint than this server's, or this server
        restarted after the epoch): every epoch through it closes here without a closure, so the workers polling here,
        this server's replica among them, find the stage further on and load a mate's state, as a late joiner does
        (`protocol.closure`); and no worker waits for this server to close an epoch it holds nothing of."""
        state = self.state
        if state.closed_epoch >= epoch:
            return Ack(again=True)
        if any(key[0] <= epoch for key in state.microbatches):
            raise Refused(f"epoch {epoch} cannot be skipped here: rows of it or of an epoch before are held")
        logger.warning(f"{self.name}: the stage stands past epoch {epoch}, this server through epoch "
                       f"{state.closed_epoch} (a newer checkpoint at its mates, or it restarted); closing the epochs "
                       "between without a step, the stage's state comes from its mates")
        state.closed_epoch = epoch
        self.progress.moved()
        self.close_ready()
        self.news.set()  # long polls waiting on the epoch answer now
        return Ack()

    closes_by_commit: ClassVar[bool] = False  # an FS closes an epoch only once the data source committed it

    def resume(self, *, epoch: int, batch: int) -> None:
        """Stand where this server's checkpoint left its stage: every epoch before `epoch` closed here (an FS: the
        data through global batch `batch` trained)."""
        self.state.closed_epoch = epoch - 1

    def commit(self, epoch: int, *, batch: int, layout: Layout) -> Ack:
        """The data source committed `epoch` (which trained on global batch `batch`, under `layout`): every row of it
        came back at stage 0, so it is never abandoned."""
        return Ack()

    def rpc_ask_epoch(self, requests: Requests, context: P2PContext) -> Responses:
        """The data source asks whether every row of this server's segment of an epoch is back, and where it stands."""
        return self.serve(requests, context, AskEpoch, self.ask_epoch)

    async def ask_epoch(self, request: AskEpoch, sender: str) -> EpochState:
        state = self.state
        stats = state.epochs.get(state.closed_epoch)
        replica = state.workers.get(self.peer_id)
        return EpochState(complete=state.closed_epoch >= request.epoch or self.has_all_rows(request.epoch),
                          closed_epoch=state.closed_epoch, abandoned=bool(stats and stats.abandoned),
                          held_epoch=max((key[0] for key in state.microbatches), default=state.closed_epoch),
                          batch=self.committed_batch(), dropped=self.dropped_microbatches(),
                          state_epoch=replica.epoch if replica is not None and replica.holds_state else -1)

    def has_all_rows(self, epoch: int) -> bool:
        """Whether every row of this server's segment of an open epoch is back."""
        return False

    def committed_batch(self) -> int:
        """The global batch of the last epoch committed here, -1 if none (or if this role is not told)."""
        return -1

    def dropped_microbatches(self) -> tuple[MicrobatchRef, ...]:
        """The microbatches of recent epochs whose rows this server dropped with a vanished worker (policy swarm)."""
        return ()

    def drop_epoch(self, epoch: int) -> None:
        """What a role holds of an abandoned epoch beyond its microbatches and tasks, dropped."""

    def close_ready(self) -> None:
        """Close every epoch that may close here now, in order (an abandoned one as soon as those before it)."""
        raise NotImplementedError

    def check_source(self, sender: str, layout: Layout) -> None:
        """Only the data source of a layout (its first stage-0 FS; in a run with an owner, the one the owner's
        certificates name) feeds and ends its epochs."""
        if sender != layout.stages[0].fs[0]:
            raise Forbidden(f"{sender} is not the data source of this layout")
        if self.authority is not None and sender != self.authority.data_source():
            raise Forbidden(f"{sender} is not the data source the run's owner authorized")

    async def check_authorized(self, layout: Layout) -> None:
        """In a run with an owner: every server `layout` names is authorized for its place, and its data source is
        the run's; Refused if not. This server may not have read a new server's record yet: before it refuses, it
        reads the records again (`Authority.refreshed`), since the sender does not ask again (a refused push costs
        its rows' lease, and a BS's refused delivery stalls the epoch). Handlers check this before they look at
        their state, which may change while it reads."""
        if self.authority is None:
            return
        problem = self._unauthorized(layout)
        if problem is not None:
            await self.authority.refreshed(timeout=self.settings.membership_period_s)
            problem = self._unauthorized(layout)
        if problem is not None:
            raise Refused(problem)

    def _unauthorized(self, layout: Layout) -> str | None:
        """What in `layout` the owner did not authorize, as far as this server has read; None if nothing."""
        source = self.authority.data_source()
        if layout.stages and layout.stages[0].fs and layout.stages[0].fs[0] != source:
            return f"the layout's data source {layout.stages[0].fs[0]} is not the run's ({source})"
        for stage, servers in enumerate(layout.stages):
            for role in ("fs", "bs"):
                for peer in servers.of(role):
                    if not self.authority.authorizes(peer, stage, role):
                        return (f"the layout names {peer} as {role.upper()} of stage {stage}, which the run's owner "
                                f"did not authorize (as far as this server has read)")
        return None

    async def confirm_result(self, issuer: str, *, task: str, worker: str, epoch: int, microbatch: int, rows: Rows,
                             taken: list[Rows]) -> None:
        """Confirm a result with its issuer, holding its rows meanwhile; Refused if any of them are `taken` already
        or held for another result, or if the issuer does not confirm. The caller commits the rows right after,
        before it awaits anything."""
        key = (epoch, microbatch)
        holding = self._confirming.setdefault(key, [])
        if any(part.intersect(rows) for part in (*taken, *holding)):
            raise Refused(f"duplicate: rows {rows} of microbatch {epoch}:{microbatch} are in already")
        holding.append(rows)
        try:
            await self.confirm(issuer, task=task, worker=worker, epoch=epoch)
        finally:
            holding.remove(rows)
            if not holding:
                del self._confirming[key]

    async def refuse_result(self, *, task: str, worker: str, epoch: int, issuer: str | None, error: str) -> NoReturn:
        """Refuse a bad result: count it against the worker (banned for a while after a few, longer each time) and
        hand the task to another."""
        record = self.state.workers.get(worker)
        if record is not None:
            record.refusals += 1
            if record.refusals >= self.settings.refusals_before_ban:
                ban_s = self.settings.ban_s * 2 ** record.bans
                record.refusals, record.bans, record.banned_until = 0, record.bans + 1, self.clock() + ban_s
                logger.warning(f"{self.name}: worker {worker} banned for {ban_s:.0f} s after "
                               f"{self.settings.refusals_before_ban} refused results (ban {record.bans})")
        if issuer is not None:
            service = self.service if issuer == self.peer_id else self.other_service
            try:
                await self.retrying(issuer, service, ReportTask(task=task, worker=worker, epoch=epoch, ok=False),
                                    attempts=self.settings.push_attempts, what=f"reporting refused task {task}")
            except Exception as e:  # the task's lease runs out instead
                logger.warning(f"{self.name}: could not report the refused task {task} to {issuer}: {e!r}")
        raise Refused(f"the result of task {task} from worker {worker}: {error}")

    # -- checks ------------------------------------------------------------------------------------------------

    def check_sender(self, claimed: str, sender: str) -> None:
        """A worker speaks for itself only: the peer id it names must be the one libp2p authenticated."""
        if claimed != sender:
            raise Forbidden(f"worker {claimed} is not the sender {sender}")

    def check_layout(self, layout: Layout, *, epoch: int, microbatch: int, total_rows: int) -> Rows:
        """This server's segment of a microbatch under `layout`; Refused if the layout or the microbatch does not
        fit the run's recipe, the layout leaves this server out, or the microbatch came here with another layout.
        The caller checked that the owner authorized the layout (`check_authorized`) first."""
        if len(layout.stages) != self.config.num_stages:
            raise Refused(f"a layout of {len(layout.stages)} stages, but the run has {self.config.num_stages}")
        if total_rows != self.config.rows_per_microbatch:
            raise Refused(f"a microbatch of {total_rows} rows, but the run's have {self.config.rows_per_microbatch}")
        if microbatch >= self.config.microbatches:
            raise Refused(f"microbatch {microbatch}, but the run's epochs have {self.config.microbatches}")
        known = self.state.microbatches.get((epoch, microbatch))
        if known is not None and known.layout != layout:
            raise Refused(f"microbatch {epoch}:{microbatch} came with another layout")
        try:
            return layout.segment(self.stage, self.role, self.peer_id, total_rows)
        except ValueError as e:
            raise Refused(str(e)) from None

    def check_peer(self, peer: str, layout: Layout, *, stage: int, role: ServerRole, what: str) -> None:
        if peer != self.peer_id and peer not in layout.stages[stage].of(role):
            raise Forbidden(f"{what} {peer} is no {role.upper()} of stage {stage} in the microbatch's layout")

    def held(self, epoch: int, microbatch: int) -> M:
        mb = self.state.microbatches.get((epoch, microbatch))
        if mb is None:
            raise Refused(f"microbatch {epoch}:{microbatch} is not held here")
        return mb

    # -- epochs --------------------------------------------------------------------------------------------------

    def epoch_stats(self, epoch: int) -> EpochStats:
        return self.state.epochs.setdefault(epoch, EpochStats())

    def open_microbatch(self, epoch: int, microbatch: int, make: Callable[[], M]) -> M:
        """The microbatch's entry, made on its first accepted message."""
        mb = self.state.microbatches.get((epoch, microbatch))
        if mb is None:
            if self.ended(epoch):
                raise Refused(f"epoch {epoch} ended here")
            self._skip_to(epoch)
            mb = self.state.microbatches[(epoch, microbatch)] = make()
        return mb

    def _skip_to(self, epoch: int) -> None:
        """Rows of `epoch`, or its abandon, came here while this server holds nothing of an epoch before: those
        between its last closed one and `epoch` were laid out without it (it joined a running swarm, restarted, or was
        lost for a while) and never come here, since a server of an epoch's layout holds rows of it until it closes
        it (no epoch is fed before the one before came back whole at stage 0). It stands just before `epoch`."""
        state = self.state
        if state.closed_epoch < epoch - 1 and not any(key[0] < epoch for key in state.microbatches):
            state.closed_epoch = epoch - 1

    def _forget_held(self, epoch: int) -> None:
        """Drop the epoch's microbatches and tasks (at its closure, or at once when it is abandoned)."""
        for key in [key for key in self.state.microbatches if key[0] == epoch]:
            del self.state.microbatches[key]
        self.state.pool.forget_epoch(epoch)
        self.progress.moved()

    def close_epoch(self, epoch: int) -> None:
        """Every row of the epoch is through here, or it was abandoned: drop what is held of it."""
        self.state.closed_epoch = epoch
        self.state.abandoned.pop(epoch, None)
        self.epoch_stats(epoch).finished = self.clock()
        self._forget_held(epoch)
        self.news.set()
        # a confirmation whose reply was lost may be asked again after the epoch closed here
        self.state.settled.pop(epoch - self.settings.closures_kept, None)
        logger.info(f"{self.name}: epoch {epoch} closed")
