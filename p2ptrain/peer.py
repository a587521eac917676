"""`python -m p2ptrain.peer`: one peer of a swarm, as a bootstrap node, a stage server (FS or BS) or a client.

    python -m p2ptrain.peer --role bootstrap --host-maddrs /ip4/127.0.0.1/tcp/31337
    python -m p2ptrain.peer --role server --stage 0 --server-role fs --initial-peers ADDR --epochs 20
    python -m p2ptrain.peer --role client --stage 1 --initial-peers ADDR
    python -m p2ptrain.peer --role client --initial-peers ADDR    # joins the stage it measures best (--stage-choice)
    python -m p2ptrain.peer --role server --planner-key planner.key.pub --initial-peers ADDR   # placed by the plan
    python -m p2ptrain.peer --role server --stage 0 --server-role fs --owner-key owner.key.pub \
        --identity-path fs0.id --initial-peers ADDR    # a server of an owned run: fs0.id.cert from p2ptrain.owner

Every option is checked before anything starts: a bad one exits with status 2 and a message naming the flag.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.cli import (
    DEADLINE_FLAGS,
    RECIPE_FLAGS,
    SWITCH,
    add_compute_flags,
    add_deadline_flags,
    add_recipe_flags,
    check_maddrs,
    count,
    deadlines_from,
    existing_file,
    fail,
    flag_value,
    given_recipe,
    non_negative,
    positive,
    recipe_from,
    refusing,
    writable_file,
)
from p2ptrain.config import ConfigError, RunConfig, RuntimeConfig
from p2ptrain.node.options import FAULTS, NetworkOptions, NodeOptions, PlannerOptions, PlanningOptions, RecipeOptions
from p2ptrain.planner import PLANNERS
from p2ptrain.planner.join import STAGE_CHOICES
from p2ptrain.protocol.layout import Placement
from p2ptrain.traffic import METER

if TYPE_CHECKING:
    from p2ptrain.live.authority import Owner, ServerCertificate
    from p2ptrain.node.peer import Peer

# NodeOptions and RuntimeConfig fields and the flags that set them
SERVED_LINE = "calls served (SIGUSR1): "  # then a JSON object {method: requests served since the start}
NODE_FLAGS = {"role": "--role", "epochs": "--epochs", "max_in_flight": "--max-in-flight", "threads": "--threads",
              "keep_freed_memory": "--keep-freed-memory",
              "device": "--device", "recompute": "--recompute",
              "compute_power": "--compute-power", "fault": "--fault", "plan_timeout_s": "--plan-timeout",
              "recipe_timeout_s": "--recipe-timeout", "keep_streams": "--keep-streams",
              "push_behind": "--push-behind",
              "metrics_period_s": "--metrics-period",
              **DEADLINE_FLAGS,
              "server_role": "--server-role", "computes": "--compute", "stage": "--stage",
              "stage_choice": "--stage-choice", "probe_delay_s": "--probe-delay", "checkpoint_dir": "--checkpoint-dir",
              "checkpoint_every": "--checkpoint-every", "eval_data": "--eval-data", "eval_every": "--eval-every",
              "eval_rows": "--eval-rows", "keep_state": "--keep-state", "export_to": "--export-to"}


@dataclass(frozen=True, kw_only=True)
class Command:
    """What the command line asks for: a peer's recipe, options and runtime settings."""

    config: RunConfig
    options: NodeOptions
    settings: RuntimeConfig
    log_level: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", required=True, choices=("bootstrap", "server", "client"))
    parser.add_argument("--stage", type=int, help="pipeline stage of this server or client, from 0")
    parser.add_argument("--server-role", choices=("fs", "bs"), help="frontal or backward server (servers only)")
    parser.add_argument("--compute", action="store_true", help="a server that also computes its stage's layers")
    parser.add_argument("--keep-state", action="store_true",
                        help="a BS that holds its stage's parameters and optimizer state, as every FS does: it "
                             "averages and steps with the workers, serves the state to joiners and saves it with "
                             "--checkpoint-dir")
    parser.add_argument("--layers", help="layers START:END of this stage (default: an even split)")
    live = parser.add_argument_group("live planning (a server or client started without --stage)")
    live.add_argument("--stage-choice", choices=STAGE_CHOICES, default=None,
                      help="a client started without --stage and with no plan up measures its links to the servers "
                           "of every stage and picks one: 'cost' (default) where it lowers the predicted batch time "
                           "most, 'paper' where the servers' average bandwidth is best")
    live.add_argument("--planner-key", type=existing_file,
                      help="the planner's public key (KEY.pub of `python -m p2ptrain.plan --planner-identity KEY`); "
                           "without --stage, this peer announces its measurements and takes its place from the "
                           "plan signed by that key (a client with no plan up joins by probing instead)")
    live.add_argument("--plan-timeout", type=positive, default=RuntimeConfig.plan_timeout_s,
                      help="seconds to wait for a plan that places it")
    parser.add_argument("--recipe-timeout", type=positive, default=RuntimeConfig.recipe_timeout_s,
                        help="seconds a peer given no recipe flags waits for the swarm's run and recipe")
    parser.add_argument("--metrics-period", type=positive, default=RuntimeConfig.metrics_period_s,
                        help="seconds between this peer's stores of its training metrics in the DHT while they "
                             "change (what `python -m p2ptrain.status` shows); each store is signed, replicated and "
                             "checked by several DHT peers, so where epochs take seconds a longer period quiets the "
                             "DHT at the cost of a later status (default %(default)s)")
    live.add_argument("--plan", action="store_true",
                      help="this server is also the planner: it plans the servers and clients that announce "
                           "themselves, publishes the plan signed with --planner-identity and keeps it alive while "
                           "it runs (peers get --planner-key KEY.pub)")
    live.add_argument("--planner-identity", type=Path, help="with --plan: the planner's private key (created if "
                                                            "missing; its public key goes to PATH.pub)")
    live.add_argument("--planner", choices=PLANNERS, default="refined", help="with --plan: the planner to run")
    live.add_argument("--plan-stages", type=count, help="with --plan: force this many stages")
    live.add_argument("--expect", type=count,
                      help="with --plan: servers to wait for, this one included (default: 2 per stage, at least 2)")
    trust = parser.add_argument_group("trust (a run with an owner)")
    trust.add_argument("--owner-key", type=existing_file,
                       help="the run owner's public key (KEY.pub of `python -m p2ptrain.owner authorize --owner-identity "
                            "KEY`): this peer trusts only the servers the owner authorized, and a server takes part "
                            "only with the owner's certificate for its place")
    trust.add_argument("--certificate", type=existing_file,
                       help="with --owner-key, a server: the owner's certificate for its place (default: "
                            "IDENTITY.cert beside --identity-path, where `p2ptrain.owner authorize` writes it)")
    net = parser.add_argument_group("network (as in hivemind)")
    net.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of peers already in the swarm")
    net.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], help="multiaddrs to listen on")
    net.add_argument("--announce-maddrs", nargs="*", default=None, help="multiaddrs others should dial")
    net.add_argument("--identity-path", type=Path, help="file with this peer's private key (created if missing)")
    net.add_argument("--client-mode", action="store_true",
                     help="dial out only (behind NAT); in averaging it sends and receives but reduces no part")
    net.add_argument("--maddrs-file", type=writable_file, help="write this peer's visible multiaddrs here once up")
    add_recipe_flags(parser)
    add_deadline_flags(parser)
    run = parser.add_argument_group("training")
    run.add_argument("--epochs", type=count, default=20, help="global batches the data source feeds")
    run.add_argument("--max-in-flight", type=count, default=4, help="microbatches in the pipeline at once")
    run.add_argument("--compute-power", type=positive, default=None, help="this worker's FLOP/s (default: measured)")
    run.add_argument("--checkpoint-dir", type=Path,
                     help="a server: save the stage's parameters, optimizer state, epoch and data position here, and "
                          "resume from them when started again")
    run.add_argument("--checkpoint-every", type=count, default=10, metavar="N",
                     help="with --checkpoint-dir: save every N epochs (and when stopped)")
    run.add_argument("--export-to", type=Path, metavar="PATH",
                     help="the data source (stage-0 FS): once its last epoch closed, write the model as every stage "
                          "then stands into this folder, as a Hugging Face checkpoint (config.json, safetensors) that "
                          "transformers loads")
    run.add_argument("--eval-data", type=existing_file,
                     help="the data source: a held-out text file; the swarm's parameters are evaluated on it through "
                          "the stages' servers (forward only) and the loss is shown as eval_loss")
    run.add_argument("--eval-every", type=count, default=10, metavar="N", help="with --eval-data: every N epochs")
    run.add_argument("--eval-rows", type=count, default=64, help="with --eval-data: windows of --seq-len tokens")
    run.add_argument("--threads", type=count, default=1, help="torch threads of this process")
    run.add_argument("--keep-freed-memory", choices=tuple(SWITCH), default=flag_value(NodeOptions.keep_freed_memory),
                     help="keep freed buffers of up to 64 MiB in this process for reuse (glibc's malloc), rather than "
                          "hand them back to the kernel and fault their pages in again")
    run.add_argument("--keep-streams", choices=tuple(SWITCH), default=flag_value(RuntimeConfig.keep_streams),
                     help="call other peers over streams kept open between calls, rather than a new stream per call")
    run.add_argument("--push-behind", choices=tuple(SWITCH), default=flag_value(RuntimeConfig.push_behind),
                     help="a worker pushes each result while it takes and computes its next task, rather than wait "
                          "for the server's acknowledgement first")
    add_compute_flags(run, whose="this peer")
    run.add_argument("--dump-grads", type=Path,
                     help="directory where workers save the averaged gradients of each epoch")
    run.add_argument("--fault", choices=FAULTS, default="none",
                     help="for tests: send corrupted results, or average slowly")
    run.add_argument("--probe-delay", type=non_negative, default=0.0, metavar="SECONDS",
                     help="for tests: answer link probes as if behind a slow link (latency about SECONDS/2, "
                          "bandwidth at most 1 MiB per SECONDS); training traffic is not slowed")
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def parse_args(argv: list[str] | None = None) -> Command:
    """The command line as typed options; exits 2 naming the flag at the first bad one."""
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
    elif any(value is not None for value in (args.planner_identity, args.plan_stages, args.expect)):
        parser.error("--planner-identity, --plan-stages and --expect go with --plan")
    if args.expect is not None and args.expect < 2:
        fail(parser, "--expect", args.expect, "a plan needs at least 2 servers (an FS and a BS)")
    if planned and args.role == "server" and args.planner_key is None and not args.plan:
        parser.error("--role server needs --stage K, or --planner-key PATH to take its stage from the plan")
    if args.stage_choice is not None and not (planned and args.role == "client"):
        parser.error("--stage-choice is for a client started without --stage")
    if planned and (args.server_role or args.layers):
        parser.error("without --stage the plan sets the stage, --server-role and --layers; give all or none")
    if not planned and args.planner_key is not None:
        parser.error("--planner-key is for a server or client started without --stage")
    if args.role == "server" and not planned and args.server_role is None:
        parser.error("--role server needs --server-role fs or --server-role bs")
    if args.role != "server" and args.keep_state:
        parser.error("--keep-state is for a server (a BS; an FS always holds its stage's state)")
    if args.role != "server" and (args.server_role or args.compute):
        parser.error("--server-role and --compute are for --role server only")
    for flag, folder in (("--dump-grads", args.dump_grads), ("--checkpoint-dir", args.checkpoint_dir),
                         ("--export-to", args.export_to)):
        if folder is not None and folder.exists() and not folder.is_dir():
            fail(parser, flag, folder, "is a file; give a folder")
    for flag, values in (("--initial-peers", args.initial_peers), ("--host-maddrs", args.host_maddrs),
                         ("--announce-maddrs", args.announce_maddrs)):
        check_maddrs(parser, flag, values)
    config = recipe_from(parser, args)
    owner, certificate = _authority(parser, args, config)
    planning = planner = None
    if args.plan:
        from p2ptrain.live.identity import load_or_create_identity  # hivemind's keys; loaded once the flags hold

        try:
            signer = load_or_create_identity(args.planner_identity)
        except (OSError, ValueError) as e:
            fail(parser, "--planner-identity", args.planner_identity, str(e))
        planner = PlannerOptions(signer=signer, planner=args.planner, stages=args.plan_stages, expect=args.expect)
        planning = PlanningOptions(planner_key=signer.local_public_key)
    elif planned and args.planner_key is not None:  # a client without it joins by probing
        from p2ptrain.live.identity import read_planner_key

        try:
            planning = PlanningOptions(planner_key=read_planner_key(args.planner_key))
        except (OSError, ValueError) as e:
            fail(parser, "--planner-key", args.planner_key, str(e))
    given = given_recipe(parser, args, config, argv) if args.role != "bootstrap" else {}
    with refusing(parser, NODE_FLAGS):
        placement = None if args.role == "bootstrap" or planned else _placement(parser, args, config, given)
        network = NetworkOptions(
            initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs),
            announce_maddrs=tuple(args.announce_maddrs) if args.announce_maddrs is not None else None,
            identity_path=args.identity_path, client_mode=args.client_mode, maddrs_file=args.maddrs_file)
        options = NodeOptions(
            role=args.role, placement=placement, computes=args.compute, keep_state=args.keep_state, network=network, planning=planning,
            planner=planner, epochs=args.epochs, max_in_flight=args.max_in_flight, compute_power=args.compute_power,
            threads=args.threads, keep_freed_memory=SWITCH[args.keep_freed_memory], device=args.device, recompute=args.recompute, dump_grads=args.dump_grads,
            fault=args.fault,
            stage_choice=args.stage_choice or STAGE_CHOICES[0], probe_delay_s=args.probe_delay,
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, export_to=args.export_to,
            eval_data=args.eval_data,
            eval_every=args.eval_every, eval_rows=args.eval_rows, owner=owner, certificate=certificate,
            recipe=None if args.role == "bootstrap" else RecipeOptions(given=given,
                                                                       layers_given=args.layers is not None))
        settings = RuntimeConfig(plan_timeout_s=args.plan_timeout, recipe_timeout_s=args.recipe_timeout,
                                 keep_streams=SWITCH[args.keep_streams], push_behind=SWITCH[args.push_behind],
                                 metrics_period_s=args.metrics_period,
                                 **deadlines_from(args))
    return Command(config=config, options=options, settings=settings, log_level=args.log_level)


def _authority(parser: argparse.ArgumentParser, args: argparse.Namespace,
               config: RunConfig) -> tuple[Owner | None, ServerCertificate | None]:
    """The owner (--owner-key) and, for a server, its certificate, checked against its identity and place."""
    if args.certificate is not None and (args.owner_key is None or args.role != "server"):
        parser.error("--certificate is a server's, with --owner-key")
    if args.owner_key is None:
        return None, None
    from p2ptrain.live.authority import CertificateError, Owner, ServerCertificate  # hivemind's keys

    try:
        owner = Owner.from_file(args.owner_key)
    except CertificateError as e:
        fail(parser, "--owner-key", args.owner_key, str(e))
    if args.role != "server":
        return owner, None
    if args.stage is None:
        parser.error("--owner-key: a server of an owned run is started with --stage and --server-role, the place "
                     "its certificate names (a planned server cannot have one yet)")
    if args.identity_path is None or not args.identity_path.is_file():
        parser.error("--owner-key: a server needs --identity-path, the identity its certificate names (`python -m "
                     "p2ptrain.owner authorize --identity-path PATH` creates both)")
    path = args.certificate or args.identity_path.with_name(args.identity_path.name + ".cert")
    if not path.is_file():
        fail(parser, "--certificate", path, "no such file: have the owner write it with python -m p2ptrain.owner "
                                            f"authorize --identity-path {args.identity_path} ...")
    from p2ptrain.live.authority import peer_id_of

    try:
        certificate = ServerCertificate.load(path)
        owner.check(certificate, run_id=config.run_id, peer_id=peer_id_of(args.identity_path), stage=args.stage,
                    role=args.server_role)
    except CertificateError as e:
        fail(parser, "--certificate", path, str(e))
    return owner, certificate


def _placement(parser: argparse.ArgumentParser, args: argparse.Namespace, config: RunConfig,
               given: dict[str, object]) -> Placement:
    """--stage, --server-role and --layers. Without --num-stages or --layers, the stages are the swarm's recipe's:
    a stage past the defaults' is placed provisionally, and checked once the recipe is taken (`Peer._take_recipe`)."""
    if "num_stages" not in given and args.layers is None and args.stage >= config.num_stages:
        return Placement(stage=args.stage, server_role=args.server_role, layers=(0, 1), num_stages=args.stage + 1)
    return Placement(stage=args.stage, server_role=args.server_role, layers=_layers(parser, args, config),
                     num_stages=config.num_stages)


def _layers(parser: argparse.ArgumentParser, args: argparse.Namespace, config: RunConfig) -> tuple[int, int]:
    if args.layers is None:
        with refusing(parser, NODE_FLAGS):
            return config.stage_layers(args.stage)
    layers = config.model_config.num_layers
    try:
        start, end = (int(x) for x in args.layers.split(":"))
    except ValueError:
        fail(parser, "--layers", args.layers, "expected START:END, e.g. 0:2")
    if not 0 <= start < end <= layers:
        fail(parser, "--layers", args.layers, f"must lie within 0:{layers}")
    if not 0 <= args.stage < config.num_stages:
        fail(parser, "--stage", args.stage, f"not in 0..{config.num_stages - 1} (the run has {config.num_stages} "
                                            "stages)")
    return start, end


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the event loop logs its tasks on it (`_log_tasks`)
    command = parse_args(argv)
    logging.basicConfig(level=command.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from p2ptrain.live.authority import CertificateError
    from p2ptrain.node.peer import Peer  # torch and hivemind: only once the command line holds
    from p2ptrain.state.checkpoint import CheckpointError

    peer = Peer(config=command.config, options=command.options, settings=command.settings)
    try:
        asyncio.run(_run(peer))
    except (CheckpointError, CertificateError) as e:  # refused before anything of it was loaded or announced
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ConfigError as e:  # the swarm's recipe refused a flag, or none came: before anything was announced
        build_parser().error(f"{RECIPE_FLAGS.get(e.field, NODE_FLAGS.get(e.field, e.field))} {e.value}: {e.problem}")
    # stopped: what is left is the interpreter's teardown, whose full collections over everything torch, hivemind and
    # the peer allocated took 2.5-7 s on 2 busy cores (py-spy: gc_collect_main), keeping whoever waits for the exit
    gc.freeze()


async def _run(peer: Peer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _log_tasks)
    await peer.run(stop)


def _log_tasks() -> None:
    """On SIGUSR1, log what each of this peer's asyncio tasks awaits (the chain of coroutines down to the awaited
    object): a peer that stands still with an idle event loop shows nothing in a thread dump. And the requests its
    process served so far, by method (`p2ptrain.traffic`), one JSON line that benchmarks read."""
    lines = []
    for task in asyncio.all_tasks():
        chain, awaited = [], task.get_coro()
        while awaited is not None and len(chain) < 20:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None) \
                or getattr(awaited, "gi_frame", None)
            if frame is None:
                chain.append(type(awaited).__name__)
                break
            chain.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None) \
                or getattr(awaited, "gi_yieldfrom", None)
        lines.append(f"  {task.get_name()}: " + " > ".join(chain))
    logger = logging.getLogger(__name__)
    logger.warning(f"{len(lines)} asyncio tasks (SIGUSR1):\n" + "\n".join(sorted(lines)))
    logger.warning(f"{SERVED_LINE}{json.dumps(METER.served_snapshot(), sort_keys=True)}")


if __name__ == "__main__":
    main()
