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

from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.dht import Announcer, PeerInfo, PlanRecord, get_peers
from p2ptrain.live.swarm import planning_peers, swarm_from_peers
from p2ptrain.planner import Donor, Plan, format_plan, make_plan
from p2ptrain.planner.anytime import default_budget_s
from p2ptrain.planner.presets import ModelSpec, run_spec

logger = logging.getLogger(__name__)


def wait_for_peers(dht: hivemind.DHT, *, run_id: str, expect: int, settings: RuntimeConfig,
                   stop: threading.Event) -> list[PeerInfo] | None:
    """The peers to plan with once `expect` servers measured each other; None if stopped or out of time."""
    started = time.monotonic()
    next_progress = started + settings.progress_every_s
    while not stop.is_set():
        peers = get_peers(dht, run_id)
        ready = planning_peers(peers, expect=expect)
        if ready is not None:
            return ready
        now = time.monotonic()
        measured = sum(1 for p in peers if p.role == "server" and p.compute > 0 and p.memory > 0)
        if now - started > settings.plan_timeout_s:
            logger.error(f"gave up after {settings.plan_timeout_s:.0f} s: {measured} of {expect} servers announced "
                         f"their "
                         f"measurements (servers must be started without --stage, with --planner-key)")
            return None
        if now >= next_progress:
            next_progress = now + settings.progress_every_s
            logger.info(f"waiting for {expect} servers with measured links: {measured} announced so far")
        stop.wait(settings.plan_poll_s)
    return None


def plan_swarm(dht: hivemind.DHT, *, run_id: str, model: ModelSpec, tokens: int, microbatches: int, planner: str,
               stages: int | None, seed: int, expect: int, settings: RuntimeConfig, stop: threading.Event,
               average_every: int = 1, budget_s: float | None = 0.0, rounds: int | None = None,
               searches: int | None = None, jobs: int = 1, heats: int | None = None,
               donor: Donor | None = None) -> Plan | None:
    """Wait for `expect` measured servers, then plan what the DHT holds; None if stopped or out of time. The
    refined planner's anytime search runs for `budget_s` (None: `default_budget_s` of the peers found) or `rounds`,
    from `jobs` seeds at once, each first in `heats` (`planner.portfolio`).

    Raises SwarmFileError or PlanningError when the announced swarm cannot be planned.
    """
    peers = wait_for_peers(dht, run_id=run_id, expect=expect, settings=settings, stop=stop)
    if peers is None:
        return None
    swarm = swarm_from_peers(peers, source=f"the live swarm of run {run_id}")
    if rounds is not None:  # a replay: rounds alone bound it
        budget_s = 0.0
    elif budget_s is None:
        budget_s = default_budget_s(len(swarm.devices))
    return make_plan(swarm, model, batch_tokens=tokens, microbatches=microbatches, planner=planner, stages=stages,
                     seed=seed, average_every=average_every, budget_s=budget_s, clock=time.monotonic, rounds=rounds,
                     searches=searches, donor=donor, jobs=jobs, heats=heats)


def publish(dht: hivemind.DHT, *, signer: RSASignatureValidator, run_id: str, plan: dict,
            publish_for_s: float | None, settings: RuntimeConfig, stop: threading.Event) -> None:
    """Store `plan` signed under the planner's key and refresh it until `stop` or `publish_for_s` seconds."""
    # the version orders plans of successive planner runs: a restarted planner's plan supersedes the old one
    record = PlanRecord(plan=plan, version=int(time.time()), created=time.time())
    announcer = Announcer(dht=dht, run_id=run_id, peer_id=dht.peer_id.to_base58(), owner_key=signer.local_public_key,
                          period_s=settings.record_period_s, ttl_s=settings.record_ttl_s, start=False)
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


def serve_plan(dht: hivemind.DHT, *, signer: RSASignatureValidator, config: RunConfig, planner: str,
               stages: int | None, expect: int | None, settings: RuntimeConfig,
               stop: threading.Event) -> None:
    """A planning server's planner thread: plan the announced peers, then publish and refresh the plan until
    stopped. Raises if the swarm cannot be planned, which ends the server with that error."""
    expect = expect if expect is not None else 2 * (stages or 1)
    tokens = config.tokens_per_epoch
    model = run_spec(config)
    plan = plan_swarm(dht, run_id=config.run_id, model=model, tokens=tokens, microbatches=config.microbatches,
                      planner=planner, stages=stages, seed=config.seed,
                      expect=expect, settings=settings, stop=stop, average_every=config.average_every)
    if plan is None:
        if not stop.is_set():
            raise TimeoutError(f"--plan: {expect} servers did not announce their measurements within "
                               f"{settings.plan_timeout_s:.0f} s")
        return
    logger.info("\n" + format_plan(plan, title=f"{planner} plan for run {config.run_id} ({config.model}, {tokens} "
                                               f"tokens in {config.microbatches} microbatches)"))
    publish(dht, signer=signer, run_id=config.run_id, plan=plan.to_json(), publish_for_s=None, settings=settings,
            stop=stop)
