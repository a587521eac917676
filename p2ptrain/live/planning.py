"""A peer started without --stage: announce what it measured, wait for the planner's signed plan, take its place.

The plan is the planner's JSON (p2ptrain.planner.records.Plan.to_json). A server takes the stage and role under
which the plan lists its peer id; a client takes the stage whose clients list names it, else the stage with the
fewest workers (planned ones plus clients that joined it since), so clients the planner never saw spread out.
A client that finds no plan up joins by probing instead (`p2ptrain.live.joining`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2P

from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.dht import Announcer, Link, PeerInfo, get_peers, get_plan, get_stage_members
from p2ptrain.live.probe import available_memory, measure_block_compute, measure_link
from p2ptrain.protocol.layout import PeerRole, Placement
from p2ptrain.transport import Caller

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Joined:
    """A peer's place from the plan, and what it measured and announced on the way."""

    placement: Placement
    compute: float
    memory: int
    links: dict[str, Link]


def plan_stages(plan: dict[str, Any], *, num_layers: int) -> list[dict[str, Any]]:
    """The plan's stages, checked against this peer's model; ValueError if the plan cannot be run by this peer."""
    stages = plan.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ValueError("the plan has no stages")
    end = 0
    for k, stage in enumerate(stages):
        layers = stage.get("layers") if isinstance(stage, dict) else None
        if not (isinstance(layers, list) and len(layers) == 2 and all(type(x) is int for x in layers)
                and layers[0] == end and layers[1] > end):
            raise ValueError(f"stage {k}: layers {layers} do not continue from layer {end}")
        for role in ("fs", "bs", "clients"):
            if not (isinstance(stage.get(role, []), list) and all(isinstance(p, str) for p in stage.get(role, []))):
                raise ValueError(f"stage {k}: {role} is not a list of peer ids")
        end = layers[1]
    if end != num_layers:
        raise ValueError(f"the plan covers {end} layers but this peer's model has {num_layers} (another --model?)")
    return stages


def place_server(stages: list[dict[str, Any]], peer_id: str) -> Placement | None:
    """This server's place in the plan, or None if the plan leaves it out."""
    for k, stage in enumerate(stages):
        for role in ("fs", "bs"):
            if peer_id in stage[role]:
                return Placement(stage=k, server_role=role, layers=(stage["layers"][0], stage["layers"][1]),
                                 num_stages=len(stages))
    return None


def place_client(stages: list[dict[str, Any]], peer_id: str, joined: dict[int, set[str]]) -> Placement:
    """The stage that names this client, else the one with the fewest workers; `joined`: live workers per stage.

    Ties go by a hash of the peer id: clients that start together read the same counts, and would otherwise
    all crowd into the first of the tied stages.
    """
    named = [k for k, stage in enumerate(stages) if peer_id in stage.get("clients", [])]
    if named:
        k = named[0]
    else:
        load = [len(set(s["fs"]) | set(s["bs"]) | set(s.get("clients", [])) | joined.get(k, set()))
                for k, s in enumerate(stages)]
        tied = [k for k, n in enumerate(load) if n == min(load)]
        k = tied[zlib.crc32(peer_id.encode()) % len(tied)]
    return Placement(stage=k, server_role=None, layers=(stages[k]["layers"][0], stages[k]["layers"][1]),
                     num_stages=len(stages))


async def join_by_plan(*, dht: hivemind.DHT, p2p: P2P, announcer: Announcer, peer_id: str, role: PeerRole,
                       computes: bool, config: RunConfig, settings: RuntimeConfig, planner_key: bytes,
                       compute: float | None, stop: asyncio.Event,
                       device: torch.device = torch.device("cpu")) -> Joined | None:
    """Measure, announce, and wait up to `settings.plan_timeout_s` for a plan signed by `planner_key` that places
    this peer; None if stopped first. `compute`: this peer's FLOP/s if known, else it is measured on one block on
    `device` at the run's precision; the memory it announces is what is free there.
    `p2p` must already answer link probes (`LinkProbe`), so that whoever sees this peer's announcement can probe
    it."""
    caller = Caller(p2p=p2p, peer_id=peer_id, codec="none", timeout=settings.probe_timeout_s)
    compute = compute or await asyncio.to_thread(measure_block_compute, config, device=device)
    memory = available_memory(device)
    logger.info(f"{role} {peer_id} joining without a stage: {compute:.3g} FLOP/s per block, "
                f"{memory / 2**30:.1f} GiB free; waiting for the planner's plan")
    links: dict[str, Link] = {}
    announced: dict[str, Link] | None = None
    seen_versions: set[int] = set()
    joined_at = time.time()
    started = time.monotonic()
    next_progress = started + settings.progress_every_s
    while not stop.is_set():
        peers = await asyncio.to_thread(get_peers, dht, config.run_id)
        for peer in peers:
            # servers measure each other, clients measure the servers; only peers that joined this way run a probe
            probed = peer.role == "server" and (peer.state == "joining" or peer.links)
            if peer.peer_id != peer_id and peer.peer_id not in links and probed:
                try:
                    links[peer.peer_id] = await measure_link(caller, peer.peer_id)
                except Exception as e:  # not reachable yet; the next round retries
                    logger.info(f"could not measure the link to {peer.peer_id} yet: {e!r}")
        if links != announced:
            announcer.set_peer_info(PeerInfo(
                peer_id=peer_id, role=role, reliable=role != "client", computes=computes, compute=compute,
                memory=memory, maddrs=[str(a) for a in dht.get_visible_maddrs()], state="joining", started=joined_at,
                links=dict(links)))
            announced = dict(links)
        record = await asyncio.to_thread(get_plan, dht, config.run_id, planner_key)
        if record is not None and record.version not in seen_versions:
            seen_versions.add(record.version)
            placement = await _place(dht=dht, config=config, role=role, peer_id=peer_id, plan=record.plan,
                                     version=record.version)
            if placement is not None:
                logger.info(f"plan v{record.version} places this {role} in stage {placement.stage} of "
                            f"{placement.num_stages}, layers [{placement.layers[0]}, {placement.layers[1]})"
                            + (f" as {placement.server_role.upper()}" if placement.server_role else ""))
                return Joined(placement=placement, compute=compute, memory=memory, links=links)
        now = time.monotonic()
        if now - started > settings.plan_timeout_s:
            seen = sorted(seen_versions) or "none"
            raise TimeoutError(f"no plan signed by the planner's key placed this peer within "
                               f"{settings.plan_timeout_s:.0f} s (plans seen: {seen}); is the planner running with the "
                               "same --run-id and the key whose .pub this peer trusts?")
        if now >= next_progress:
            next_progress = now + settings.progress_every_s
            logger.info(f"still waiting for a plan after {now - started:.0f} s; measured links to {len(links)} "
                        f"server(s)")
        try:
            await asyncio.wait_for(stop.wait(), settings.plan_poll_s)
        except asyncio.TimeoutError:
            pass
    return None


async def _place(*, dht: hivemind.DHT, config: RunConfig, role: PeerRole, peer_id: str, plan: dict[str, Any],
                 version: int) -> Placement | None:
    try:
        stages = plan_stages(plan, num_layers=config.model_config.num_layers)
    except ValueError as e:
        logger.warning(f"plan v{version} does not fit this peer, waiting for another: {e}")
        return None
    if role == "server":
        placement = place_server(stages, peer_id)
        if placement is None:
            logger.warning(f"plan v{version} leaves this server out; waiting for a plan that places it")
        return placement
    joined = {}
    for k in range(len(stages)):
        members = await asyncio.to_thread(get_stage_members, dht, config.run_id, k)
        joined[k] = {m.peer_id for m in members if m.role == "worker"}
    return place_client(stages, peer_id, joined)
