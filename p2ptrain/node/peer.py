"""`Peer`: one peer of a swarm, built from the run's recipe and the node's options, with `start()` and `stop()`."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import hivemind
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from p2ptrain.client.averaging import STAGE_MEAN_CODEC, GradientDeposits, StageAllReduce
from p2ptrain.client.device import resolve_device
from p2ptrain.client.state_sync import StageStateServer, load_state_from_peers
from p2ptrain.client.worker import Worker
from p2ptrain.compression import load as load_codecs
from p2ptrain.config import AVERAGING_CODECS, ConfigError, RunConfig, RuntimeConfig
from p2ptrain.data import Masking, TextSource
from p2ptrain.dht import (
    Announcer,
    Membership,
    Metrics,
    PeerInfo,
    RecipeRecord,
    get_metrics,
    get_recipe,
    get_runs,
    start_dht,
    stop_dht,
)
from p2ptrain.dht.membership import MembershipCache
from p2ptrain.dht.readers import get_state_holders
from p2ptrain.live.joining import join_client
from p2ptrain.live.planning import Joined, join_by_plan
from p2ptrain.live.probe import LinkProbe, measure_compute
from p2ptrain.live.publisher import serve_plan
from p2ptrain.models import build_stage
from p2ptrain.models.hf import load_pretrained
from p2ptrain.node.export import export_swarm
from p2ptrain.node.malloc import keep_freed_memory
from p2ptrain.node.metrics import publish_metrics
from p2ptrain.node.options import NodeOptions, RecipeOptions
from p2ptrain.protocol.deadlines import Throughput
from p2ptrain.protocol.layout import Placement
from p2ptrain.recipe import LOCAL_FIELDS, Recipe, adopt
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.base import StageServer
from p2ptrain.server.evaluation import StageEvaluator
from p2ptrain.server.feeder import DataFeeder, HeldOut
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.server.watch import ServerWatch
from p2ptrain.state.checkpoint import load_checkpoint, save_checkpoint
from p2ptrain.transport import Caller, Hearing

logger = logging.getLogger(__name__)
T = TypeVar("T")


def codecs_of(config: RunConfig) -> list[str]:
    """The codecs a peer of `config`'s run encodes or decodes with: its activations', its averaging's, and with the
    look-ahead the stage mean's, which travels in int8 whatever the run's codecs (unloaded, its first use stalled the
    FS that serves it and the workers that take it for 2-4 s, the time bitsandbytes takes to import)."""
    codecs = [config.compression, AVERAGING_CODECS[config.averaging_codec]]
    if config.dpu and config.dpu_lookahead:
        codecs.append(STAGE_MEAN_CODEC)
    return codecs


class Peer:
    """A bootstrap node, a stage server (FS or BS, computing or not) or a client, in one process.

    Owns its DHT node (and p2p daemon), its announcer and the parts its role needs: a `FrontalServer` or
    `BackwardServer`, a `Worker`, the stage-0 `DataFeeder`, and the tasks that keep its view of the swarm and its
    metrics fresh. `start()` joins the swarm, takes the placement from the options, from the planner's plan or (a
    client) by probing the stages' servers, and brings the parts up; `wait()` returns when stopped and raises if a
    part failed; `stop()` takes everything down.
    Several peers can run in one event loop (tests do):

        peer = Peer(config=RunConfig(...), options=NodeOptions(role="client", placement=Placement(...)))
        await peer.start()
        ...
        await peer.stop()
    """

    def __init__(self, *, config: RunConfig, options: NodeOptions, settings: RuntimeConfig | None = None):
        self.config, self.options = config, options
        self.settings = settings or RuntimeConfig()
        self.dht: hivemind.DHT | None = None
        self.peer_id: str | None = None
        self.placement: Placement | None = options.placement
        self.device = torch.device("cpu")  # where it computes: resolved from `options.device` as it starts
        self.server: StageServer | None = None
        self.worker: Worker | None = None
        self.feeder: DataFeeder | None = None
        self._announcer: Announcer | None = None
        self._p2p: P2P | None = None
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._saving = asyncio.Lock()  # one checkpoint written at a time
        self._planner: asyncio.Task | None = None
        self._planner_stop = threading.Event()
        self.started = time.time()  # this process's incarnation: the link probe tells it, and a restart changes it
        self.hearing = Hearing()  # when bytes of each peer last arrived, at any of this node's servicers
        # the run starts from a Hugging Face checkpoint (`--init-from`), which this peer may have no copy of
        self._pretrained_run = config.init_from is not None

    # -- life cycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the swarm and bring up this peer's parts; without a placement, first find its place (the plan's, or
        a client's by probing). Returns once the peer runs (or once it was stopped while finding its place)."""
        options, settings = self.options, self.settings
        self.device = resolve_device(options.device)  # a ConfigError here, before anything is announced
        signer = options.planner.signer if options.planner else None
        taking = options.recipe is not None and options.role != "bootstrap"
        deadline = time.monotonic() + (settings.recipe_timeout_s if options.waits_for_recipe else 0.0)
        if taking and options.recipe.discovers_run:
            self.config = dataclasses.replace(self.config, run_id=await self._find_run(deadline))
        self.dht = await asyncio.to_thread(self._make_dht, signer)
        self.peer_id = self.dht.peer_id.to_base58()
        if taking:
            await self._take_recipe(options.recipe, deadline)
        if self._stopping.is_set():  # stopped while it waited for the swarm's run or recipe
            return
        if options.certificate is not None:  # a certificate of another identity or run would only be ignored
            options.owner.check(options.certificate, run_id=self.config.run_id, peer_id=self.peer_id,
                                stage=options.certificate.stage, role=options.certificate.role)
        # records are signed with hivemind's process-wide key, as hivemind's own records are (a planning server's
        # DHT signs with the planner's key instead: a DHT keeps only its first signer)
        owner = (signer or RSASignatureValidator()).local_public_key
        self._announcer = Announcer(dht=self.dht, run_id=self.config.run_id, peer_id=self.peer_id, owner_key=owner,
                                    period_s=settings.record_period_s, ttl_s=settings.record_ttl_s)
        torch.set_num_threads(options.threads)  # before live planning measures this process's compute
        if options.keep_freed_memory:
            keep_freed_memory()
        if options.planner is not None:
            self._planner = asyncio.create_task(asyncio.to_thread(
                serve_plan, self.dht, signer=options.planner.signer, config=self.config,
                planner=options.planner.planner, stages=options.planner.stages, expect=options.planner.expect,
                settings=settings, stop=self._planner_stop))
        if options.role != "bootstrap":
            self._p2p = await self.dht.replicate_p2p()
            # before anything is announced: planners, planned servers and joining clients measure links to it
            await LinkProbe(peer_id=self.peer_id, delay_s=options.probe_delay_s, started=self.started,
                            hearing=self.hearing).add_p2p_handlers(self._p2p)
        joined = None
        if options.role != "bootstrap" and self.placement is None:
            joined = await self._join()
            if joined is None:  # stopped while waiting for the plan
                return
            self.placement = joined.placement
            self.config = dataclasses.replace(self.config, num_stages=joined.placement.num_stages)
        self._announce(joined)
        if options.role == "bootstrap":
            logger.info(f"bootstrap peer {self.peer_id} at {' '.join(self.maddrs)}")
            return
        await self._start_parts()

    async def wait(self) -> None:
        """Until stopped, or until a part fails (which raises its error instead of leaving the peer half alive)."""
        stopper = asyncio.create_task(self._stopping.wait())
        # not FIRST_EXCEPTION: that waits, once stopped, for every part to end, and a planning server's planner
        # ends only in `stop` (a SIGTERM left it to the launcher's SIGKILL, its plan never withdrawn)
        pending = {stopper, *self._tasks, *([self._planner] if self._planner else [])}
        while stopper in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled() and task.exception() is not None:
                    stopper.cancel()
                    raise task.exception()

    async def stop(self) -> None:
        """Stop every part, withdraw this peer's records and shut its DHT node down; safe to call twice."""
        self._stopping.set()
        self._planner_stop.set()
        if self.options.checkpoint_dir is not None and self.worker is not None and self.server is not None:
            await self._save_checkpoint(self.worker)  # the state of the last step that landed; one in flight is lost
        if self.worker is not None and self._p2p is not None:
            try:
                await asyncio.wait_for(self.worker.leave(), self.settings.leave_timeout_s)
            except asyncio.TimeoutError:
                logger.warning("the servers did not hear that this worker leaves; they find out by its silence")
        for task in self._tasks:
            task.cancel()
        # a thread cannot be cancelled: the planner ends on _planner_stop, withdrawing its plan
        await asyncio.gather(*self._tasks, *([self._planner] if self._planner else []), return_exceptions=True)
        self._tasks, self._planner = [], None
        if self.server is not None:
            await self.server.shutdown()
        if self._p2p is not None:
            await self._p2p.shutdown()
            self._p2p = None
        if self._announcer is not None:
            await asyncio.to_thread(self._announcer.shutdown)
            self._announcer = None
        if self.dht is not None:
            await asyncio.to_thread(stop_dht, self.dht)
            self.dht = None

    async def run(self, stop: asyncio.Event) -> None:
        """Start, run until `stop` is set or a part fails, then stop (the command line's way)."""
        forward = asyncio.create_task(self._forward_stop(stop))
        try:
            await self.start()
            await self.wait()
        finally:
            forward.cancel()
            await self.stop()

    async def _forward_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._stopping.set()

    @property
    def maddrs(self) -> list[str]:
        return [str(addr) for addr in self.dht.get_visible_maddrs()] if self.dht is not None else []

    # -- parts ---------------------------------------------------------------------------------------------------

    def _make_dht(self, signer: RSASignatureValidator | None) -> hivemind.DHT:
        network = self.options.network
        if network.identity_path is not None:
            network.identity_path.parent.mkdir(parents=True, exist_ok=True)
        dht = start_dht(
            self.config.run_id, signer=signer, initial_peers=list(network.initial_peers),
            host_maddrs=list(network.host_maddrs),
            announce_maddrs=list(network.announce_maddrs) if network.announce_maddrs is not None else None,
            identity_path=str(network.identity_path) if network.identity_path else None,
            client_mode=network.client_mode,
        )
        if network.maddrs_file is not None:
            network.maddrs_file.write_text("\n".join(str(a) for a in dht.get_visible_maddrs()) + "\n")
        return dht

    async def _find_run(self, deadline: float) -> str:
        """The run the swarm carries (`dht.get_runs`), read through a DHT client of its own (the peer's DHT is made
        for one run's records); this peer's run id if the swarm lists none by `deadline`. A ConfigError if it lists
        several."""
        network = self.options.network
        reader = await asyncio.to_thread(start_dht, self.config.run_id, initial_peers=list(network.initial_peers),
                                         client_mode=True)
        try:
            if self.options.waits_for_recipe:
                logger.info(f"no run id given: waiting up to {self.settings.recipe_timeout_s:.0f} s for the swarm to "
                            "list its run")
            runs = await self._read_until(lambda: get_runs(reader), deadline)
        finally:
            await asyncio.to_thread(stop_dht, reader)
        if len(runs) > 1:
            raise ConfigError("run_id", "(none given)", f"the swarm carries runs {', '.join(runs)}; choose one")
        return runs[0] if runs else self.config.run_id

    async def _take_recipe(self, take: RecipeOptions, deadline: float) -> None:
        """Take the swarm's recipe (`p2ptrain.recipe`): check the values this peer was given against its data
        source's recipe and take the rest from it, waiting for it until `deadline` (time.monotonic). A ConfigError
        (exit 2 on the command line) names a given value that differs, or says what is missing."""
        options, settings, run_id = self.options, self.settings, self.config.run_id
        if options.waits_for_recipe:
            logger.info(f"waiting up to {max(0.0, deadline - time.monotonic()):.0f} s for the recipe of run {run_id}")
        found = await self._read_until(lambda: get_recipe(self.dht, run_id, owner=options.owner), deadline)
        if found is None:
            if options.waits_for_recipe and not self._stopping.is_set():
                raise ConfigError("run_id", run_id, f"no recipe of this run in the swarm after "
                                                    f"{settings.recipe_timeout_s:.0f} s: is its data source up? Or "
                                                    "give this peer the run's recipe flags")
        else:
            publisher, recipe = found
            config = await asyncio.to_thread(adopt, recipe, {**take.given, "run_id": run_id})  # fingerprints files
            self._pretrained_run = recipe.init_from is not None
            placement = self.placement
            if placement is not None and (placement.stage, placement.server_role) == (0, "fs"):
                for name in LOCAL_FIELDS:  # it may become the data source, which reads them
                    if getattr(recipe, name) is not None and getattr(config, name) is None:
                        raise ConfigError(name, None, f"a stage-0 FS feeds the run's data: give it its own copy of "
                                                      f"the run's {name} (sha256 {getattr(recipe, name)})")
            self.config = config
            logger.info(f"took the recipe of run {run_id} from its data source {publisher}: {recipe.describe()}")
        if self.placement is not None and not take.layers_given and not self._stopping.is_set():
            # the stage's layers in the run's split (a stage the run does not have is refused here)
            self.placement = dataclasses.replace(self.placement, layers=self.config.stage_layers(self.placement.stage),
                                                 num_stages=self.config.num_stages)

    async def _read_until(self, read: Callable[[], T], deadline: float) -> T:
        """`read()` in a thread until it finds something, `deadline` (time.monotonic) passes or the peer stops."""
        while True:
            found = await asyncio.to_thread(read)
            if found or time.monotonic() >= deadline or self._stopping.is_set():
                return found
            await asyncio.sleep(self.settings.recipe_poll_s)

    async def _join(self) -> Joined | None:
        """Take a place from the plan, or (a client) by probing the stages; a planning server also watches its
        planner, which must not fail meanwhile."""
        options = self.options
        if options.role == "client":
            return await join_client(
                dht=self.dht, p2p=self._p2p, announcer=self._announcer, peer_id=self.peer_id, config=self.config,
                settings=self.settings, planner_key=options.planning.planner_key if options.planning else None,
                compute=options.compute_power, stage_choice=options.stage_choice, owner=options.owner,
                device=self.device, stop=self._stopping)
        joining = asyncio.create_task(join_by_plan(
            dht=self.dht, p2p=self._p2p, announcer=self._announcer, peer_id=self.peer_id, role=options.role,
            computes=options.does_compute, config=self.config, settings=self.settings,
            planner_key=options.planning.planner_key,
            compute=options.compute_power, device=self.device, stop=self._stopping))
        if self._planner is None:
            return await joining
        await asyncio.wait([joining, self._planner], return_when=asyncio.FIRST_COMPLETED)
        if not joining.done():
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
            self._planner.result()  # raises the planner's error
            return None
        return joining.result()

    def _announce(self, joined: Joined | None) -> None:
        options, placement = self.options, self.placement
        self._announcer.set_peer_info(PeerInfo(
            peer_id=self.peer_id, role=options.role, stage=placement.stage if placement else None,
            server_role=placement.server_role if placement else None, reliable=options.role != "client",
            computes=options.does_compute, compute=float(options.compute_power or (joined.compute if joined else 0.0)),
            memory=joined.memory if joined else 0, links=joined.links if joined else {}, maddrs=self.maddrs,
            state="online", started=time.time()))

    async def _start_parts(self) -> None:
        config, options, settings, placement = self.config, self.options, self.settings, self.placement
        stage, role = placement.stage, placement.server_role
        # before any message: an import on the first one would stall this peer's event loop (int8: seconds)
        await asyncio.to_thread(load_codecs, *codecs_of(config))
        membership = MembershipCache(dht=self.dht, run_id=config.run_id, num_stages=config.num_stages,
                                     period_s=settings.membership_period_s, retry_s=settings.membership_retry_s,
                                     idle_period_s=settings.membership_idle_period_s,
                                     owner=options.owner)
        self._spawn(membership.run(self._stopping))
        caller = Caller(p2p=self._p2p, peer_id=self.peer_id, codec=config.compression, timeout=settings.rpc_timeout_s,
                        slack=settings.deadline_slack, assumed_rate=settings.slowest_uplink,
                        keep_streams=settings.keep_streams)
        if role is not None:
            kind = FrontalServer if role == "fs" else BackwardServer
            self.server = kind(peer_id=self.peer_id, stage=stage, config=config, settings=settings, caller=caller,
                               authority=membership if options.owner is not None else None, hearing=self.hearing)
            await self.server.add_p2p_handlers(self._p2p)
            if isinstance(self.server, FrontalServer):  # it forms the averaging groups, which its stage's replicas are in
                membership.on_holders(stage, self.server.expect_replicas)
        if options.holds_state(role):  # an FS (and a BS told to) holds the stage's state even if it computes nothing
            self.worker = await self._make_worker(caller, membership)  # a bad checkpoint stops it here, unannounced
            if self.server is not None and not options.does_compute:
                self.server.expect_replica(self.peer_id)
        elif options.checkpoint_dir is not None:  # placed by the plan as a BS
            logger.warning(f"BS {self.peer_id}: holds no state to save in {options.checkpoint_dir} (start it with "
                           "--keep-state for that)")
        if role is not None:
            certificate = options.certificate
            self._announcer.set_membership(stage, Membership(
                peer_id=self.peer_id, role=role, compute=float(options.compute_power or 0.0),
                holds_state=self.worker is not None, certificate=certificate.signature if certificate else None,
                data_source=bool(certificate and certificate.data_source), layers=placement.layers))
        if self.worker is not None:
            if options.role == "client":
                self._announcer.set_membership(stage, Membership(peer_id=self.peer_id, role="worker",
                                                                 compute=self.worker.compute,
                                                                 client_mode=options.network.client_mode,
                                                                 layers=placement.layers))
            self._spawn(self.worker.run(self._stopping))
        if isinstance(self.server, FrontalServer) and stage == 0:
            source = TextSource(path=config.data, seq_len=config.seq_len, seed=config.seed, tokenizer=config.tokenizer,
                                masking=Masking.of(config))
            watch = ServerWatch(caller=caller, servers=membership.all_servers, period_s=settings.server_check_s,
                                lost_s=settings.server_lost_s, timeout_s=settings.probe_timeout_s,
                                suspect=membership.suspect)
            self.feeder = DataFeeder(server=self.server, source=source, layout=membership.layout,
                                     is_leader=membership.leads, epochs=options.epochs,
                                     max_in_flight=options.max_in_flight, watch=watch, held_out=self._held_out(),
                                     at_end=functools.partial(self._export, caller) if options.export_to else None)
            self._spawn(self.feeder.run(self._stopping))
            # the swarm carries its recipe: peers read the data source's (`p2ptrain.recipe`)
            recipe = await asyncio.to_thread(Recipe.of, config)  # fingerprints its data: maybe large
            self._announcer.set_recipe(RecipeRecord(peer_id=self.peer_id, recipe=recipe.to_value(),
                                                    created=time.time()))
        self._spawn(publish_metrics(
            announcer=self._announcer, period_s=settings.metrics_period_s, stop=self._stopping,
            peer_id=self.peer_id, stage=stage, role=role or "worker", server=self.server, worker=self.worker,
            feeder=self.feeder, config=config, previous=await self._previous_record(role or "worker", stage)))
        start, end = placement.layers
        logger.info(f"{options.role} {self.peer_id} up: stage {stage} layers [{start}, {end})"
                    + (f" as {role.upper()}" if role else ""))

    async def _make_worker(self, caller: Caller, membership: MembershipCache) -> Worker:
        config, placement = self.config, self.placement
        start, end = placement.layers
        model = build_stage(config.model_config, start=start, end=end, seed=config.seed)
        if config.init_from is not None:
            await asyncio.to_thread(load_pretrained, model, config.init_from)
        elif self._pretrained_run and self.options.role == "server":  # no mate need have the state: servers bring it
            raise ConfigError("init_from", None, "the run starts from a checkpoint, and a server holds its stage's "
                                                 "state: give it its own copy of the checkpoint (its sha256 is in "
                                                 "the swarm's recipe)")
        deposits = None
        if self.options.role == "server":  # it keeps its stage's workers' gradients while they average
            # deposits still arriving tell the server their sender is alive
            deposits = GradientDeposits(peer_id=self.peer_id, stage=placement.stage, kept=self.settings.closures_kept,
                                        numel=sum(p.numel() for p in model.parameters() if p.requires_grad),
                                        hearing=self.hearing)
            await deposits.add_p2p_handlers(self._p2p)
        throughput = Throughput(assumed=self.settings.slowest_uplink)  # what its rounds measure of its link

        async def all_reduce(*, namespace: str | None = None, deposits: GradientDeposits | None = None
                             ) -> StageAllReduce:
            averager = StageAllReduce(p2p=self._p2p, run_id=config.run_id, stage=placement.stage, namespace=namespace,
                                      timeout=self.settings.averaging_timeout_s, caller=caller, throughput=throughput,
                                      slack=self.settings.deadline_slack, probe_every_s=self.settings.probe_silent_s,
                                      probe_timeout_s=self.settings.liveness_timeout_s, codec=config.averaging_wire,
                                      deposits=deposits)
            await averager.start()
            return averager

        averager = await all_reduce(deposits=deposits)
        # rounds across the stages that hold copies of a tensor
        shared = await all_reduce(namespace="shared") if config.shares_across_stages else None
        holds_only = not self.options.does_compute
        worker = Worker(worker_id=self.peer_id, stage=placement.stage, config=config, settings=self.settings,
                        model=model, averager=averager, caller=caller,
                        servers=lambda: membership.servers(placement.stage), suspect=membership.suspect,
                        norm_keeper=membership.data_source,
                        compute=1.0 if holds_only else self.options.compute_power or 0.0,
                        device=self.device, recompute=self.options.recompute,
                        client_mode=self.options.network.client_mode, fault=self.options.fault,
                        dump_dir=self.options.dump_grads, download_state=self._download_state, holds_only=holds_only,
                        pretrained=config.init_from is not None, shared_averager=shared,
                        after_step=self._after_step if self.options.checkpoint_dir is not None else None)
        if not (holds_only or self.options.compute_power):
            # what live planning measured was one block; tasks are sized by the speed on the whole stage, where and
            # in what precision it computes
            worker.compute = measure_compute(worker.model, config)
        if self.options.checkpoint_dir is not None:
            self._restore(worker)
        state_server = StageStateServer(worker=worker)
        await state_server.add_p2p_handlers(self._p2p)
        caller.add_local(state_server)  # an export by this peer takes its own stage's state from it
        if self.options.role == "server":  # it holds the stage's parameters: it takes part in evaluation
            await StageEvaluator(worker=worker, caller=caller,
                                 servers=lambda stage: sum(membership.servers(stage), [])).add_p2p_handlers(self._p2p)
        return worker

    def _held_out(self) -> HeldOut | None:
        """The data source's held-out windows (`--eval-data`): the first `eval_rows` windows its text source
        draws, in calls of at most one microbatch's rows."""
        options, config = self.options, self.config
        if options.eval_data is None:
            return None
        source = TextSource(path=str(options.eval_data), seq_len=config.seq_len, seed=config.seed,
                            tokenizer=config.tokenizer, masking=Masking.of(config))
        return HeldOut(windows=source.held_out(rows=options.eval_rows, per_call=config.rows_per_microbatch),
                       every=options.eval_every)

    def _restore(self, worker: Worker) -> None:
        """Resume this server's stage from its checkpoint, if it has one: the worker's state, the epoch the server
        stands at and the data position (`state.checkpoint`); a checkpoint that does not fit raises before
        anything of it is loaded."""
        placement = self.placement
        loaded = load_checkpoint(self.options.checkpoint_dir, config=self.config, stage=placement.stage,
                                 layers=placement.layers, params=worker.master)
        if loaded is None:
            return
        checkpoint, model_state, optimizer_state = loaded
        worker.load_state(model_state=model_state, optimizer_state=optimizer_state, epoch=checkpoint.epoch)
        self.server.resume(epoch=checkpoint.epoch, batch=checkpoint.batch)
        logger.info(f"restored stage {placement.stage} at epoch {checkpoint.epoch} (data batch {checkpoint.batch}) "
                    f"from {checkpoint.path}")

    async def _after_step(self, worker: Worker) -> None:
        if worker.master.epoch % self.options.checkpoint_every == 0:
            await self._save_checkpoint(worker)

    async def _save_checkpoint(self, worker: Worker) -> None:
        """Save the worker's state, taken at once (`StageParams.snapshot`), written in a thread."""
        async with self._saving:
            epoch, model_state, optimizer_state = worker.master.snapshot()
            placement = self.placement
            path = await asyncio.to_thread(
                save_checkpoint, self.options.checkpoint_dir, config=self.config, stage=placement.stage,
                layers=placement.layers, role=placement.server_role, epoch=epoch, batch=self.server.committed_batch(),
                model_state=model_state, optimizer_state=optimizer_state)
            logger.info(f"saved stage {placement.stage} at epoch {epoch} to {path}")

    async def _export(self, caller: Caller) -> None:
        """The data source's last act (`--export-to`): the model as every stage stands after the last closed epoch."""
        await export_swarm(dht=self.dht, caller=caller, config=self.config, epoch=self.server.state.closed_epoch + 1,
                           path=self.options.export_to, owner=self.options.owner)

    async def _download_state(self, worker: Worker) -> int | None:
        """Load the stage's current state into `worker` from a stage mate (`client.state_sync`); its epoch, or None
        if no mate served one. A worker that has only the seed's weights of a run that starts from a checkpoint it
        has no copy of must not compute on them: it asks until a mate serves the state, or the peer stops."""
        while True:
            epoch = await self._download_from_mates(worker)
            if epoch is not None or not (self._pretrained_run and worker.master.holds_seed) or self._stopping.is_set():
                return epoch
            logger.warning(f"worker {worker.worker_id}: the run starts from a checkpoint this peer has no copy of, "
                           f"and no stage mate served stage {worker.stage}'s state yet; asking again in "
                           f"{self.settings.membership_period_s:.0f} s")
            await asyncio.sleep(self.settings.membership_period_s)

    async def _download_from_mates(self, worker: Worker) -> int | None:
        try:  # a fresh read: the membership cache knows servers only, and may not have read the DHT yet
            servers, mates = await asyncio.wait_for(asyncio.to_thread(
                get_state_holders, self.dht, self.config.run_id, worker.stage, owner=self.options.owner),
                self.settings.rpc_timeout_s)
        except Exception as e:  # the DHT failed or timed out: start as the first workers of a run do
            logger.warning(f"could not read who holds stage {worker.stage}'s state: {e!r}; starting from the seed")
            return None
        return await load_state_from_peers(worker, caller=worker.caller, servers=servers, candidates=mates)

    async def _previous_record(self, role: str, stage: int) -> Metrics | None:
        """The metrics this peer's previous process published, if its record is still in the DHT (a peer
        restarted with its identity, in the same role). A peer without an identity file has a new peer id each
        time, so it has no earlier record to read."""
        if self.options.network.identity_path is None:
            return None
        try:
            records = await asyncio.wait_for(asyncio.to_thread(get_metrics, self.dht, self.config.run_id),
                                             self.settings.rpc_timeout_s)
        except Exception as e:
            logger.warning(f"could not read this peer's earlier metrics: {e!r}")
            return None
        return next((r for r in records if r.peer_id == self.peer_id and r.role == role and r.stage == stage), None)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(coroutine))
