"""`python -m p2ptrain.peer`: one peer of a swarm, as a bootstrap node, a stage server (FS or BS) or a client.

    python -m p2ptrain.peer --role bootstrap --host-maddrs /ip4/127.0.0.1/tcp/31337
    python -m p2ptrain.peer --role server --stage 0 --server-role fs --initial-peers ADDR --epochs 20
    python -m p2ptrain.peer --role client --stage 1 --initial-peers ADDR
    python -m p2ptrain.peer --role server --planner-key planner.key.pub --initial-peers ADDR   # placed by the plan
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import hivemind
import torch
from hivemind.dht.crypto import RSASignatureValidator

from p2ptrain.averaging import StageAllReduce
from p2ptrain.client.worker import FAULTS, Worker
from p2ptrain.compression import CODECS
from p2ptrain.compute import measure_compute
from p2ptrain.config import RunConfig
from p2ptrain.data import TextSource
from p2ptrain.dht import Announcer, Membership, PeerInfo, make_validators
from p2ptrain.live.identity import load_or_create_identity, read_planner_key
from p2ptrain.live.planning import Joined, apply_placement, join_by_plan
from p2ptrain.live.publisher import plan_swarm, publish
from p2ptrain.membership import MembershipCache
from p2ptrain.metrics import publish_metrics
from p2ptrain.models.llama import LLAMA_CONFIGS, LlamaStage
from p2ptrain.plan import format_plan
from p2ptrain.planner import PLANNERS
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.feeder import DataFeeder
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.transport import Caller

logger = logging.getLogger("p2ptrain.peer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", required=True, choices=("bootstrap", "server", "client"))
    parser.add_argument("--stage", type=int, help="pipeline stage of this server or client, from 0")
    parser.add_argument("--server-role", choices=("fs", "bs"), help="frontal or backward server (servers only)")
    parser.add_argument("--compute", action="store_true", help="a server that also computes its stage's layers")
    parser.add_argument("--layers", help="layers START:END of this stage (default: an even split)")
    live = parser.add_argument_group("live planning (a server or client started without --stage)")
    live.add_argument("--planner-key", type=Path,
                      help="the planner's public key (KEY.pub of `python -m p2ptrain.plan --planner-identity KEY`); "
                           "without --stage, this peer announces its measurements and takes its place from the "
                           "plan signed by that key")
    live.add_argument("--plan-timeout", type=float, default=600.0, help="seconds to wait for a plan that places it")
    live.add_argument("--plan", action="store_true",
                      help="this server is also the planner: it plans the servers and clients that announce "
                           "themselves, publishes the plan signed with --planner-identity and keeps it alive while "
                           "it runs (peers get --planner-key KEY.pub)")
    live.add_argument("--planner-identity", type=Path, help="with --plan: the planner's private key (created if "
                                                            "missing; its public key goes to PATH.pub)")
    live.add_argument("--planner", choices=PLANNERS, default="refined", help="with --plan: the planner to run")
    live.add_argument("--plan-stages", type=int, help="with --plan: force this many stages")
    live.add_argument("--expect", type=int,
                      help="with --plan: servers to wait for, this one included (default: 2 per stage, at least 2)")
    net = parser.add_argument_group("network (as in hivemind)")
    net.add_argument("--run-id", default="p2ptrain", help="prefix of this swarm's DHT keys")
    net.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of peers already in the swarm")
    net.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], help="multiaddrs to listen on")
    net.add_argument("--announce-maddrs", nargs="*", default=None, help="multiaddrs others should dial")
    net.add_argument("--identity-path", help="file with this peer's private key (created if missing)")
    net.add_argument("--client-mode", action="store_true",
                     help="dial out only (behind NAT); in averaging it sends and receives but reduces no part")
    net.add_argument("--maddrs-file", help="write this peer's visible multiaddrs here once it is up")
    recipe = parser.add_argument_group("recipe (the same on every peer)")
    recipe.add_argument("--model", default="llama-tiny", choices=sorted(LLAMA_CONFIGS))
    recipe.add_argument("--num-stages", type=int, default=2)
    recipe.add_argument("--batch-rows", type=int, default=8, help="rows (sequences) per microbatch")
    recipe.add_argument("--microbatches", type=int, default=4, help="microbatches per global batch (epoch)")
    recipe.add_argument("--seq-len", type=int, default=64)
    recipe.add_argument("--seed", type=int, default=0)
    recipe.add_argument("--lr", type=float, default=3e-3)
    recipe.add_argument("--compression", choices=CODECS, default="none", help="codec for activations and gradients")
    recipe.add_argument("--data", help="a local text file to train on (default: the embedded corpus)")
    run = parser.add_argument_group("training")
    run.add_argument("--epochs", type=int, default=20, help="global batches the data source feeds")
    run.add_argument("--max-in-flight", type=int, default=4, help="microbatches in the pipeline at once")
    run.add_argument("--compute-power", type=float, default=None, help="this worker's FLOP/s (default: measured)")
    run.add_argument("--lease-timeout", type=float, default=30.0, help="seconds before a task goes back to the pool")
    run.add_argument("--averaging-timeout", type=float, default=30.0, help="seconds an all-reduce round may take")
    run.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    run.add_argument("--dump-grads", help="directory where workers save the averaged gradients of each epoch")
    run.add_argument("--fault", choices=FAULTS, default="none", help="for tests: send corrupted results")
    run.add_argument("--log-level", default="INFO")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    planned = args.role != "bootstrap" and args.stage is None
    if args.plan:
        if args.role != "server" or not planned:
            parser.error("--plan is for a server started without --stage (it places itself by its own plan)")
        if args.planner_identity is None:
            parser.error("--plan needs --planner-identity PATH: the plan is signed with the planner's key")
        if args.planner_key is not None:
            parser.error("--plan trusts its own key (--planner-identity); drop --planner-key")
        if args.plan_stages is not None and args.plan_stages < 1:
            parser.error(f"--plan-stages {args.plan_stages}: must be >= 1")
        if args.expect is not None and args.expect < 2:
            parser.error(f"--expect {args.expect}: a plan needs at least 2 servers (an FS and a BS)")
    elif any(value is not None for value in (args.planner_identity, args.plan_stages, args.expect)):
        parser.error("--planner-identity, --plan-stages and --expect go with --plan")
    if planned and args.planner_key is None and not args.plan:
        parser.error(f"--role {args.role} needs --stage K, or --planner-key PATH to take its stage from the plan")
    if planned and (args.server_role or args.layers):
        parser.error("without --stage the plan sets the stage, --server-role and --layers; give all or none")
    if not planned and args.planner_key is not None:
        parser.error("--planner-key is for a server or client started without --stage")
    if args.role == "server" and not planned and args.server_role is None:
        parser.error("--role server needs --server-role fs or --server-role bs")
    if args.role != "server" and (args.server_role or args.compute):
        parser.error("--server-role and --compute are for --role server only")
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    args.signer = None
    if args.plan:
        try:
            args.signer = load_or_create_identity(args.planner_identity)
        except (OSError, ValueError) as e:
            parser.error(f"--planner-identity {args.planner_identity}: {e}")
        args.planner_public_key = args.signer.local_public_key
    elif planned:
        try:
            args.planner_public_key = read_planner_key(args.planner_key)
        except (OSError, ValueError) as e:
            parser.error(f"--planner-key: {e}")
    try:
        args.config = RunConfig(
            run_id=args.run_id, model=args.model, num_stages=args.num_stages, rows_per_microbatch=args.batch_rows,
            microbatches=args.microbatches, seq_len=args.seq_len, seed=args.seed, lr=args.lr,
            compression=args.compression,
        )
        if args.stage is not None:
            args.layer_range = _layer_range(args, args.config)
    except ValueError as e:
        parser.error(str(e))
    return args


def _layer_range(args: argparse.Namespace, config: RunConfig) -> tuple[int, int]:
    if args.layers is None:
        return config.stage_layers(args.stage)
    try:
        start, end = (int(x) for x in args.layers.split(":"))
    except ValueError:
        raise ValueError(f"--layers {args.layers!r}: expected START:END, e.g. 0:2") from None
    if not 0 <= start < end <= config.llama.num_layers:
        raise ValueError(f"--layers {args.layers}: must lie within 0:{config.llama.num_layers}")
    return start, end


def make_dht(args: argparse.Namespace, *, client_mode: bool) -> hivemind.DHT:
    identity = args.identity_path
    if identity is not None and not os.path.exists(identity):
        Path(identity).parent.mkdir(parents=True, exist_ok=True)
    dht = hivemind.DHT(
        initial_peers=args.initial_peers, host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs,
        identity_path=identity, client_mode=client_mode, start=True,
        record_validators=make_validators(args.run_id, signer=args.signer),
    )
    if args.maddrs_file:
        addresses = [str(addr) for addr in dht.get_visible_maddrs()]
        Path(args.maddrs_file).write_text("\n".join(addresses) + "\n")
    return dht


async def run_peer(args: argparse.Namespace, stop: asyncio.Event) -> None:
    dht = make_dht(args, client_mode=args.client_mode)
    peer_id = dht.peer_id.to_base58()
    # records are signed with hivemind's process-wide key, as hivemind's own records are (a planning server's DHT
    # signs with the planner's key instead: a DHT keeps only its first signer)
    signer = args.signer or RSASignatureValidator()
    announcer = Announcer(dht=dht, run_id=args.run_id, peer_id=peer_id, owner_key=signer.local_public_key,
                          period_s=10.0, ttl_s=30.0)
    tasks: list[asyncio.Task] = []
    planner_stop = threading.Event()
    planner: asyncio.Task | None = None
    try:
        torch.set_num_threads(args.threads)  # before live planning measures this process's compute
        joined = None
        if args.plan:
            planner = asyncio.create_task(asyncio.to_thread(serve_plan, args, dht, signer, planner_stop))
        if args.role != "bootstrap" and args.stage is None:
            joined = await _join(args=args, dht=dht, announcer=announcer, peer_id=peer_id, planner=planner,
                                 stop=stop)
            if joined is None:  # stopped while waiting for the plan
                return
            apply_placement(args, joined.placement)
        if planner is not None:
            tasks.append(planner)
        config: RunConfig = args.config
        computes = args.role == "client" or args.compute
        announcer.set_peer_info(PeerInfo(
            peer_id=peer_id, role=args.role, stage=args.stage, server_role=args.server_role,
            reliable=args.role != "client", computes=computes,
            compute=float(args.compute_power or (joined.compute if joined else 0.0)),
            memory=joined.memory if joined else 0, links=joined.links if joined else {},
            maddrs=[str(a) for a in dht.get_visible_maddrs()], state="online", started=time.time()))
        if args.role == "bootstrap":
            logger.info(f"bootstrap peer {peer_id} at {' '.join(str(a) for a in dht.get_visible_maddrs())}")
            await stop.wait()
            return
        start, end = args.layer_range
        p2p = await dht.replicate_p2p()
        membership = MembershipCache(dht=dht, run_id=args.run_id, num_stages=config.num_stages)
        tasks.append(asyncio.create_task(membership.run(stop)))
        local: dict[str, object] = {}
        caller = Caller(p2p=p2p, local=local, codec=config.compression, timeout=60.0)
        server = None
        if args.role == "server":
            kind = FrontalServer if args.server_role == "fs" else BackwardServer
            server = kind(peer_id=peer_id, stage=args.stage, num_stages=config.num_stages, seq_len=config.seq_len,
                          hidden_size=config.llama.hidden_size, lease_timeout=args.lease_timeout,
                          codec=config.compression)
            server.caller = caller
            local[peer_id] = server
            await server.add_p2p_handlers(p2p)
            announcer.set_membership(args.stage, Membership(peer_id=peer_id, role=args.server_role,
                                                            compute=float(args.compute_power or 0.0)))
        worker = feeder = None
        if computes:
            model = LlamaStage(config.llama, start=start, end=end, seed=config.seed)
            averager = StageAllReduce(p2p=p2p, run_id=args.run_id, stage=args.stage, timeout=args.averaging_timeout)
            await averager.start()
            compute = args.compute_power or measure_compute(model, config)
            worker = Worker(worker_id=peer_id, stage=args.stage, num_stages=config.num_stages, model=model,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=config.lr), averager=averager,
                            caller=caller, servers=partial(membership.servers, args.stage), compute=compute,
                            seq_len=config.seq_len, client_mode=args.client_mode, fault=args.fault,
                            dump_dir=args.dump_grads)
            if args.role == "client":
                announcer.set_membership(args.stage, Membership(peer_id=peer_id, role="worker", compute=compute))
            tasks.append(asyncio.create_task(worker.run(stop)))
        if isinstance(server, FrontalServer) and args.stage == 0:
            source = TextSource(path=args.data, seq_len=config.seq_len, seed=config.seed)
            feeder = DataFeeder(server=server, source=source, layout=membership.layout, is_leader=membership.leads,
                                rows_per_microbatch=config.rows_per_microbatch, microbatches=config.microbatches,
                                epochs=args.epochs, max_in_flight=args.max_in_flight)
            tasks.append(asyncio.create_task(feeder.run(stop)))
        tasks.append(asyncio.create_task(publish_metrics(
            announcer=announcer, peer_id=peer_id, stage=args.stage, role=args.server_role or "worker",
            server=server, worker=worker, feeder=feeder, config=config, stop=stop)))
        logger.info(f"{args.role} {peer_id} up: stage {args.stage} layers [{start}, {end})"
                    + (f" as {args.server_role.upper()}" if server else ""))
        await _wait_any(stop, tasks)
    finally:
        stop.set()
        planner_stop.set()
        for task in tasks:
            if task is not planner:  # a thread cannot be cancelled: it ends on planner_stop, withdrawing the plan
                task.cancel()
        await asyncio.gather(*tasks, *([planner] if planner else []), return_exceptions=True)
        announcer.shutdown()
        dht.shutdown()


async def _join(*, args: argparse.Namespace, dht: hivemind.DHT, announcer: Announcer, peer_id: str,
                planner: asyncio.Task | None, stop: asyncio.Event) -> Joined | None:
    """Take a place from the plan; a planning server also watches its planner, which must not fail meanwhile."""
    joining = asyncio.create_task(join_by_plan(args=args, dht=dht, announcer=announcer, peer_id=peer_id,
                                               planner_key=args.planner_public_key, stop=stop))
    if planner is None:
        return await joining
    await asyncio.wait([joining, planner], return_when=asyncio.FIRST_COMPLETED)
    if not joining.done():
        joining.cancel()
        await asyncio.gather(joining, return_exceptions=True)
        planner.result()  # raises the planner's error
        return None
    return joining.result()


def serve_plan(args: argparse.Namespace, dht: hivemind.DHT, signer: RSASignatureValidator,
               stop: threading.Event) -> None:
    """The --plan server's planner thread: plan the announced peers, then publish and refresh the plan until
    stopped. Raises if the swarm cannot be planned, which ends the server with that error."""
    config: RunConfig = args.config
    stages = args.plan_stages
    expect = args.expect if args.expect is not None else 2 * (stages or 1)
    tokens = config.rows_per_epoch * config.seq_len
    plan = plan_swarm(dht, run_id=args.run_id, model=args.model, tokens=tokens, microbatches=config.microbatches,
                      planner=args.planner, stages=stages, seed=args.seed, expect=expect,
                      timeout_s=args.plan_timeout, stop=stop)
    if plan is None:
        if not stop.is_set():
            raise TimeoutError(f"--plan: {expect} servers did not announce their measurements within "
                               f"{args.plan_timeout:.0f} s")
        return
    logger.info("\n" + format_plan(plan, title=f"{args.planner} plan for run {args.run_id} ({args.model}, {tokens} "
                                                f"tokens in {config.microbatches} microbatches)"))
    publish(dht, signer=signer, run_id=args.run_id, plan=plan.to_json(), publish_for_s=None, stop=stop)


async def _wait_any(stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    """Until stopped, or until a task fails (which ends the peer loudly instead of leaving it half alive)."""
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_EXCEPTION)
    stopper.cancel()
    for task in done:
        if task is not stopper and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    if not stop.is_set():
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_peer(args, stop)


if __name__ == "__main__":
    main()
