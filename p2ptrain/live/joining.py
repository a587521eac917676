"""A client started without --stage joins a running swarm by probing (paper §3.2.1 "Dynamic Client Participation").

With a planner's key it first looks once for a plan (a planned swarm places its clients); with none up, or with no
key, it reads who serves each stage of the recipe's pipeline from the DHT, measures its link to every FS and BS
(each probe bounded by `RuntimeConfig.probe_timeout_s`), pieces together the swarm as the cost model sees it and
lets `p2ptrain.planner.join.choose_stage` pick the stage. Stages and their layers are the recipe's
(`--num-stages`, layers split evenly), as for a peer given `--stage`.

What the picture takes from the DHT: a worker's compute is what its stage record announces (else its peer record);
a server that does not compute gets live planning's token figure; a computing server that announced no figure
(started with --stage and no --compute-power) is taken to be as fast as this client. Links are what peers announced
having measured (servers placed by a plan, clients that joined by probing); `choose_stage` fills in the rest.
"""
from __future__ import annotations

import asyncio
import logging
import time

import hivemind
import torch
from hivemind.p2p import P2P

from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.dht import Announcer, Link, PeerInfo, get_peers, get_plan, get_stage_members
from p2ptrain.live.authority import Owner
from p2ptrain.live.planning import Joined, join_by_plan
from p2ptrain.live.probe import available_memory, measure_block_compute, measure_link
from p2ptrain.live.swarm import NONCOMPUTING_FLOPS
from p2ptrain.planner.cost import Workload
from p2ptrain.planner.join import Joiner, LinkEstimate, StageChoice, SwarmView, choose_stage
from p2ptrain.planner.presets import run_spec
from p2ptrain.planner.records import StagePlan
from p2ptrain.protocol.layout import Placement
from p2ptrain.transport import Caller

logger = logging.getLogger(__name__)


async def join_client(*, dht: hivemind.DHT, p2p: P2P, announcer: Announcer, peer_id: str, config: RunConfig,
                      settings: RuntimeConfig, planner_key: bytes | None, compute: float | None, stage_choice: str,
                      stop: asyncio.Event, owner: Owner | None = None,
                      device: torch.device = torch.device("cpu")) -> Joined | None:
    """A client's place: the plan's if a plan signed by `planner_key` is up, else the stage `stage_choice` picks
    among the stages being served. A client with a key and no stage served yet waits for the plan, as before
    probing existed (its servers are still waiting for the plan too); one without a key waits for every stage to
    have an FS and a BS, up to `settings.plan_timeout_s`. With the run's `owner`, only the servers it authorized
    count. None if stopped first."""
    served = await _served(dht, config, settings, owner)
    if planner_key is not None:
        if served is None or await _plan_is_up(dht, config.run_id, planner_key, settings):
            if served is None:
                logger.info("no stage served yet: waiting for the planner's plan")
            return await join_by_plan(dht=dht, p2p=p2p, announcer=announcer, peer_id=peer_id, role="client",
                                      computes=True, config=config, settings=settings, planner_key=planner_key,
                                      compute=compute, stop=stop, device=device)
    started = time.monotonic()
    next_progress = started
    while served is None:
        now = time.monotonic()
        if now - started > settings.plan_timeout_s:
            raise TimeoutError(f"not every one of the {config.num_stages} stages had an FS and a BS within "
                               f"{settings.plan_timeout_s:.0f} s (same --run-id and --num-stages as the servers?)")
        if now >= next_progress:
            next_progress = now + settings.progress_every_s
            logger.info(f"waiting until each of the {config.num_stages} stages has an FS and a BS")
        try:
            await asyncio.wait_for(stop.wait(), settings.plan_poll_s)
            return None
        except asyncio.TimeoutError:
            served = await _served(dht, config, settings, owner)
    stages, computes = served
    return await join_by_probing(dht=dht, p2p=p2p, peer_id=peer_id, config=config, settings=settings,
                                 stages=stages, computes=computes, compute=compute, stage_choice=stage_choice,
                                 device=device)


async def join_by_probing(*, dht: hivemind.DHT, p2p: P2P, peer_id: str, config: RunConfig, settings: RuntimeConfig,
                          stages: list[StagePlan], computes: dict[str, float], compute: float | None,
                          stage_choice: str, device: torch.device = torch.device("cpu")) -> Joined:
    """Probe the servers of `stages` and take the stage `stage_choice` picks; raises if no stage can take it.
    `computes`: the FLOP/s each member's stage record announces."""
    compute = compute or await asyncio.to_thread(measure_block_compute, config, device=device)
    memory = available_memory(device)
    caller = Caller(p2p=p2p, peer_id=peer_id, codec="none", timeout=settings.probe_timeout_s)
    links: dict[str, Link] = {}
    for server in sorted({s for stage in stages for s in stage.fs + stage.bs}):
        try:  # one by one: probes that overlap would share the link they measure
            links[server] = await asyncio.wait_for(measure_link(caller, server), settings.probe_timeout_s)
        except Exception as e:  # its stage is no candidate (choose_stage); the others still are
            logger.warning(f"could not measure the link to server {server} within {settings.probe_timeout_s:.0f} s: "
                           f"{e!r}")
    peers = {p.peer_id: p for p in await asyncio.to_thread(get_peers, dht, config.run_id)}
    view = swarm_view(stages, peers=peers, computes=computes, default_flops=compute)
    joiner = Joiner(peer_id=peer_id, flops=compute, memory=float(memory),
                    links={s: LinkEstimate(latency_s=x.latency_s, bandwidth_bps=x.bandwidth_bps)
                           for s, x in links.items()})
    workload = Workload(model=run_spec(config),
                        batch_tokens=config.tokens_per_epoch, microbatches=config.microbatches,
                        average_every=config.average_every)
    choice = choose_stage(view, joiner, workload=workload, rule=stage_choice)
    logger.info(describe(choice, stages, links))
    k = choice.stage
    return Joined(placement=Placement(stage=k, server_role=None, layers=stages[k].layers, num_stages=len(stages)),
                  compute=compute, memory=memory, links=links)


def swarm_view(stages: list[StagePlan], *, peers: dict[str, PeerInfo], computes: dict[str, float],
               default_flops: float) -> SwarmView:
    """The cost model's picture of `stages` from the peer records and the computes the stage records announce
    (the module docstring says what fills a gap)."""
    flops: dict[str, float] = {}
    for stage in stages:
        for server in stage.fs + stage.bs:
            info = peers.get(server)
            if info is None or not info.computes:
                flops[server] = NONCOMPUTING_FLOPS
            else:
                flops[server] = computes.get(server) or info.compute or default_flops
        for client in stage.clients:
            info = peers.get(client)
            flops[client] = computes.get(client) or (info.compute if info else 0.0) or default_flops
    links = {(p.peer_id, other): LinkEstimate(latency_s=x.latency_s, bandwidth_bps=x.bandwidth_bps)
             for p in peers.values() for other, x in p.links.items()}
    memory = {p.peer_id: float(p.memory) for p in peers.values() if p.memory > 0}
    return SwarmView(stages=tuple(stages), flops=flops, memory=memory, links=links)


def describe(choice: StageChoice, stages: list[StagePlan], links: dict[str, Link]) -> str:
    """The log line of a choice: the stage, then per stage the measured links and the predicted batch time."""
    lines = [f"joining stage {choice.stage} of {len(stages)} by the {choice.rule} rule (predicted batch time "
             f"{choice.chosen.batch_time_s:.4g} s, {choice.baseline_s:.4g} s without this client)"]
    for option, stage in zip(choice.options, stages):
        measured = ", ".join(
            f"{role} {s}: " + (f"{links[s].latency_s * 1e3:.1f} ms, {links[s].bandwidth_bps / 1e6:.1f} MB/s"
                               if s in links else "no answer")
            for role, group in (("FS", stage.fs), ("BS", stage.bs)) for s in group)
        why = "" if option.candidate else (" (not every server answered)" if not option.reachable
                                           else " (too little memory for its layers)")
        lines.append(f"  stage {option.stage}: mean bandwidth {option.mean_bandwidth_bps / 1e6:.1f} MB/s, predicted "
                     f"batch time {option.batch_time_s:.4g} s{why}; {measured}")
    return "\n".join(lines)


async def _plan_is_up(dht: hivemind.DHT, run_id: str, planner_key: bytes, settings: RuntimeConfig) -> bool:
    """One bounded look for a plan signed by `planner_key`: a joining client does not wait for one."""
    try:
        record = await asyncio.wait_for(asyncio.to_thread(get_plan, dht, run_id, planner_key),
                                        settings.probe_timeout_s)
    except asyncio.TimeoutError:
        logger.warning(f"reading the plan took over {settings.probe_timeout_s:.0f} s; joining by probing")
        return False
    return record is not None


async def _served(dht: hivemind.DHT, config: RunConfig, settings: RuntimeConfig,
                  owner: Owner | None = None) -> tuple[list[StagePlan], dict[str, float]] | None:
    """The recipe's stages with their FS, BS and clients, and the FLOP/s each member announced, from the DHT; None
    while some stage lacks an FS or a BS (or the DHT did not answer within `settings.probe_timeout_s`)."""
    stages, computes = [], {}
    for k in range(config.num_stages):
        try:
            members = await asyncio.wait_for(asyncio.to_thread(get_stage_members, dht, config.run_id, k, owner=owner),
                                             settings.probe_timeout_s)
        except asyncio.TimeoutError:
            return None
        fs = tuple(sorted(m.peer_id for m in members if m.role == "fs"))
        bs = tuple(sorted(m.peer_id for m in members if m.role == "bs"))
        if not fs or not bs:
            return None
        clients = tuple(sorted(m.peer_id for m in members if m.role == "worker" and m.peer_id not in fs + bs))
        stages.append(StagePlan(layers=config.stage_layers(k), fs=fs, bs=bs, clients=clients))
        computes.update((m.peer_id, m.compute) for m in members)
    return stages, computes
