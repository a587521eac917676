"""The live planner: read what peers announced, plan once enough servers are measured, publish the plan signed.

It joins the DHT with its own signer (a DHT keeps only its first RSASignatureValidator, so the planner's key must
be the one the DHT is built with), and keeps the plan alive by refreshing it until stopped, so that peers that
join later still find it; it withdraws the plan when it stops (a planner that crashes leaves it to expire).
"""
from __future__ import annotations

import logging
import threading
import time

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from p2ptrain.dht import Announcer, PeerInfo, PlanRecord, get_peers, make_validators
from p2ptrain.live.swarm import planning_peers, swarm_from_peers
from p2ptrain.planner import Plan, make_plan
from p2ptrain.planner.presets import model_spec

logger = logging.getLogger(__name__)

POLL_S = 2.0
PROGRESS_EVERY_S = 15.0


def join_as_planner(*, initial_peers: list[str], signer: RSASignatureValidator, run_id: str) -> hivemind.DHT:
    return hivemind.DHT(initial_peers=initial_peers, client_mode=True, start=True,
                        record_validators=make_validators(run_id, signer=signer))


def wait_for_peers(dht: hivemind.DHT, *, run_id: str, expect: int, timeout_s: float,
                   stop: threading.Event) -> list[PeerInfo] | None:
    """The peers to plan with once `expect` servers measured each other; None if stopped or out of time."""
    started = time.monotonic()
    next_progress = started + PROGRESS_EVERY_S
    while not stop.is_set():
        peers = get_peers(dht, run_id)
        ready = planning_peers(peers, expect=expect)
        if ready is not None:
            return ready
        now = time.monotonic()
        measured = sum(1 for p in peers if p.role == "server" and p.compute > 0 and p.memory > 0)
        if now - started > timeout_s:
            logger.error(f"gave up after {timeout_s:.0f} s: {measured} of {expect} servers announced their "
                         f"measurements (servers must be started without --stage, with --planner-key)")
            return None
        if now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            logger.info(f"waiting for {expect} servers with measured links: {measured} announced so far")
        stop.wait(POLL_S)
    return None


def plan_swarm(dht: hivemind.DHT, *, run_id: str, model: str, tokens: int, microbatches: int, planner: str,
               stages: int | None, seed: int, expect: int, timeout_s: float, stop: threading.Event) -> Plan | None:
    """Wait for `expect` measured servers, then plan what the DHT holds; None if stopped or out of time.

    Raises SwarmFileError or PlanningError when the announced swarm cannot be planned.
    """
    peers = wait_for_peers(dht, run_id=run_id, expect=expect, timeout_s=timeout_s, stop=stop)
    if peers is None:
        return None
    swarm = swarm_from_peers(peers, source=f"the live swarm of run {run_id}")
    return make_plan(swarm, model_spec(model), batch_tokens=tokens, microbatches=microbatches, planner=planner,
                     stages=stages, seed=seed)


def publish(dht: hivemind.DHT, *, signer: RSASignatureValidator, run_id: str, plan: dict,
            publish_for_s: float | None, stop: threading.Event) -> None:
    """Store `plan` signed under the planner's key and refresh it until `stop` or `publish_for_s` seconds."""
    # the version orders plans of successive planner runs: a restarted planner's plan supersedes the old one
    record = PlanRecord(plan=plan, version=int(time.time()), created=time.time())
    announcer = Announcer(dht=dht, run_id=run_id, peer_id=dht.peer_id.to_base58(), owner_key=signer.local_public_key,
                          period_s=10.0, ttl_s=30.0, start=False)
    announcer.set_plan(record)
    try:
        if not announcer.refresh():
            raise RuntimeError("the DHT refused the plan (does --run-id match the peers'?)")
        logger.info(f"published plan v{record.version} for run {run_id}; refreshing it "
                    + ("until stopped" if publish_for_s is None else f"for {publish_for_s:.0f} s"))
        deadline = None if publish_for_s is None else time.monotonic() + publish_for_s
        while True:
            wait = announcer.period_s if deadline is None else min(announcer.period_s, deadline - time.monotonic())
            if wait <= 0 or stop.wait(wait):
                break
            if not announcer.refresh():
                logger.warning(f"refreshing the plan failed; retrying in {announcer.period_s:.0f} s")
    finally:
        announcer.shutdown()  # withdraws the plan: peers that come later must not adopt one nobody maintains
