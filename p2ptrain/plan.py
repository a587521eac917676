"""``python -m p2ptrain.plan peers/FILE.toml``: plan a swarm file, print the plan, optionally write its JSON.

The model and batch come from the file's [model] and [batch] sections unless given here; ``--model`` takes a
preset at the file's precision and offload. With ``--initial-peers`` instead of a file, it plans what the peers of
a running swarm announced, and ``--publish`` stores that plan in the DHT signed with the planner's key (live
planning). Bad flags and bad files exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.cli import check_maddrs, count, index, non_negative, positive, run_id, writable_file
from p2ptrain.config import AVERAGING_CODECS, OPTIMIZERS, RunConfig, RuntimeConfig
from p2ptrain.models.configs import ModelConfig
from p2ptrain.models.hf_config import CheckpointError, checkpoint_name, read_config
from p2ptrain.planner import PLANNERS, Donor, PlanningError, format_plan, make_plan
from p2ptrain.planner.anytime import default_budget_s
from p2ptrain.planner.portfolio import DEFAULT_JOBS, HEAT_ROUNDS, HEATS, default_jobs
from p2ptrain.planner.presets import OFFLOADS, PRECISIONS, PRESETS, ModelSpec, config_spec, model_spec
from p2ptrain.planner.refine import SEARCHES
from p2ptrain.planner.swarmfile import SwarmFileError, load_swarm

if TYPE_CHECKING:
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

PEER_DEFAULTS = RunConfig()  # a live plan without recipe flags fits peers started without them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.plan", description=__doc__.splitlines()[0],
                                     epilog=LIVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("swarm", nargs="?", help="swarm file (peers/*.toml); omit it with --initial-peers")
    parser.add_argument("--model", choices=PRESETS, help="model preset (default: the file's [model])")
    parser.add_argument("--model-config", metavar="PATH",
                        help="plan the model of a Hugging Face config.json (llama or albert), or of a checkpoint "
                             "folder holding one, instead of a preset")
    parser.add_argument("--batch-tokens", type=count, help="tokens per global batch (default: the file's [batch])")
    parser.add_argument("--microbatches", type=count, help="microbatches per global batch (default: the file's)")
    parser.add_argument("--averaging-codec", choices=tuple(AVERAGING_CODECS),
                        help="how the run's stages average (the peers' --averaging-codec): the bytes of a round "
                             "(default: the file's [model] averaging_codec, else the precision's own width; live: "
                             f"{PEER_DEFAULTS.averaging_codec})")
    parser.add_argument("--precision", choices=tuple(PRECISIONS),
                        help="the run's compute precision: the weights' bytes on a worker and what an average sends "
                             "without a codec (default: the file's [model] precision; live: the peers' default, "
                             f"{PEER_DEFAULTS.precision})")
    parser.add_argument("--optimizer", choices=OPTIMIZERS,
                        help="the run's optimizer (the peers' --optimizer): its state's bytes on a worker (default: "
                             f"the file's [model] optimizer, else {PEER_DEFAULTS.optimizer})")
    parser.add_argument("--offload", choices=OFFLOADS,
                        help="what workers keep in host memory: none, the optimizer (the peers' --offload-optimizer) "
                             "or all (planning only) (default: the file's [model] offload; live: none)")
    parser.add_argument("--average-every", type=count, default=PEER_DEFAULTS.average_every, metavar="H",
                        help="the run's stages average once every H global batches (the peers' --average-every): "
                             "a batch carries 1/H of a round's time")
    parser.add_argument("--planner", choices=PLANNERS, default="refined")
    parser.add_argument("--stages", type=count, help="force this many stages (paper and refined planners)")
    parser.add_argument("--seed", type=index, default=0)
    parser.add_argument("--budget-s", type=non_negative, metavar="SECONDS",
                        help="how long the refined planner keeps improving its plan (its anytime search; 0: none; "
                             "default: 6.5 s at 64 devices, 25 s at 128 and 44 s from 256 (fewer devices: "
                             "4 s plus 40 s per 1,024; more: growing with the log of their count); it stops sooner "
                             "once rounds stop finding better plans)")
    parser.add_argument("--rounds", type=index, metavar="N",
                        help="instead of a time budget, run N rounds of the anytime search (fewer if they stop "
                             "finding better plans): the plan a budget gave, again (its `search` says how many "
                             "rounds it ran), on a machine with the same numerics: another CPU's rounding may lead "
                             "the search elsewhere")
    parser.add_argument("--searches", type=count, metavar="N",
                        help="with --rounds: on a large swarm, start the anytime search from the best of N runs of "
                             "the refined search's first steps, as the plan a budget gave did (its `search` says "
                             f"how many; default {SEARCHES})")
    parser.add_argument("--donor", type=donor, metavar="SEED:ROUNDS:AT",
                        help="with --rounds: before round AT the search goes on from the best plan of seed SEED's "
                             "search after ROUNDS rounds, as a plan whose jobs shared their plans did (its `search` "
                             "says donor_seed, donor_rounds and adopted_at)")
    parser.add_argument("--jobs", type=count, metavar="N",
                        help="with a budget, the refined planner searches from N seeds at once, in as many "
                             "processes, and keeps the best plan, whose `search` records the seed that replays it "
                             f"(default: {DEFAULT_JOBS}, or the cores this process may use where fewer)")
    parser.add_argument("--heats", type=count, metavar="N",
                        help="with a budget, each job first searches N seeds in turn "
                             f"({HEAT_ROUNDS} rounds each, within half the budget), then the best seeds search again from the start for the rest (default: "
                             f"{HEATS} from 167 to 500 devices, where the search descends; 1 elsewhere)")
    parser.add_argument("--json", type=writable_file, help="write the plan as JSON to this file")
    live = parser.add_argument_group("live planning (plan what the peers of a running swarm announced)")
    live.add_argument("--initial-peers", nargs="+", help="multiaddrs of peers of the swarm, instead of a swarm file")
    live.add_argument("--publish", action="store_true", help="store the plan in the DHT, signed, and keep it alive")
    live.add_argument("--planner-identity", type=Path,
                      help="the planner's private key (created if missing); its public key goes to PATH.pub")
    live.add_argument("--expect", type=count, help="servers to wait for (default: 2 per stage, at least 2)")
    live.add_argument("--expect-timeout", type=positive,
                      help=f"seconds to wait for them (default: {RuntimeConfig.plan_timeout_s:g})")
    live.add_argument("--publish-for", type=positive, help="seconds to keep the plan alive (default: until stopped)")
    live.add_argument("--run-id", type=run_id, help=f"the swarm's DHT prefix (default: {PEER_DEFAULTS.run_id})")
    live.add_argument("--batch-rows", type=count,
                      help=f"rows per microbatch (default: {PEER_DEFAULTS.rows_per_microbatch})")
    live.add_argument("--seq-len", type=count, help=f"tokens per row (default: {PEER_DEFAULTS.seq_len})")
    return parser


def donor(text: str) -> Donor:
    """``--donor SEED:ROUNDS:AT``: three whole numbers of 0 or more."""
    parts = text.split(":")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give SEED:ROUNDS:AT, three whole numbers of 0 or more, as a "
                                         "plan's search line prints them")
    seed, rounds, at = (int(part) for part in parts)
    return Donor(seed=seed, rounds=rounds, at=at)


LIVE_HELP = """live planning:
  python -m p2ptrain.plan --planner-identity planner.key     # only creates the key and planner.key.pub
  python -m p2ptrain.plan --initial-peers ADDR --publish --planner-identity planner.key --expect 4 --stages 2
Servers and clients started with --planner-key planner.key.pub and no --stage take their place from the plan.
The recipe flags (--model, --batch-rows, --microbatches, --seq-len, --run-id) must match the peers'."""

_LIVE_ONLY = ("publish", "expect", "expect_timeout", "publish_for", "run_id", "batch_rows", "seq_len")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.swarm is None and args.initial_peers is None:
        if args.planner_identity is None:
            parser.error("give a swarm file (offline planning) or --initial-peers ADDR (live planning)")
        if any(getattr(args, name) not in (None, False) for name in _LIVE_ONLY):
            parser.error("live planning needs --initial-peers ADDR")
        from p2ptrain.live.identity import load_or_create_identity, public_key_path  # hivemind's keys

        load_or_create_identity(args.planner_identity)
        print(f"planner key {args.planner_identity}; give peers --planner-key {public_key_path(args.planner_identity)}")
        return 0
    if args.swarm is not None and args.initial_peers is not None:
        parser.error("give either a swarm file or --initial-peers, not both")
    if args.budget_s is not None and args.rounds is not None:
        parser.error("--budget-s and --rounds both bound the refined planner's search; give one")
    for flag in ("searches", "donor"):
        if getattr(args, flag) is not None and args.rounds is None:
            parser.error(f"--{flag} replays a plan's search with --rounds N; give --rounds too")
    for flag in ("jobs", "heats"):
        if getattr(args, flag) is not None and args.rounds is not None:
            parser.error(f"--rounds replays one search (give --seed the plan's `search.seed`); --{flag} applies to a "
                         "budget")
    searching = {"budget-s": args.budget_s, "rounds": args.rounds, "jobs": args.jobs, "heats": args.heats,
                 "donor": args.donor}
    if args.planner != "refined" and any(value is not None for value in searching.values()):
        flag = next(name for name, value in searching.items() if value is not None)
        parser.error(f"--{flag} applies to the refined planner, not {args.planner}")
    if args.initial_peers is not None:
        return live_main(parser, args)
    offline = [name for name in (*_LIVE_ONLY, "planner_identity") if getattr(args, name) not in (None, False)]
    if offline:
        parser.error(f"--{offline[0].replace('_', '-')} is for live planning; add --initial-peers ADDR "
                     f"instead of the swarm file")
    return offline_main(parser, args)


def offline_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        swarm = load_swarm(args.swarm)
    except SwarmFileError as error:
        parser.error(str(error))
    preset = args.model or (swarm.model.name if swarm.model is not None and swarm.model.name in PRESETS else None)
    if args.model_config is not None:
        preset = None
    elif args.averaging_codec is not None and preset is None:
        parser.error(f"--averaging-codec: {args.swarm}'s [model] is given by its numbers; fix: pass --model, or fold "
                     "the codec into its param_bytes_per_layer")
    if preset is None and args.model_config is None and (args.precision or args.offload or args.optimizer):
        parser.error(f"--precision, --offload and --optimizer: {args.swarm}'s [model] is given by its numbers; fix: "
                     "pass --model, or fold them into its memory_bytes_per_layer")
    states = {"precision": args.precision or swarm.precision, "optimizer": args.optimizer or swarm.optimizer,
              "offload": args.offload or swarm.offload, "averaging_codec": args.averaging_codec or swarm.averaging_codec}
    if args.model_config is not None:
        model = config_spec(hf_model_config(parser, args), **states, name=checkpoint_name(args.model_config))
    elif preset is None:
        model = swarm.model
    else:
        model = model_spec(preset, **states)
    if model is None:
        parser.error(f"{args.swarm}: [model]: the file names no model; fix: pass --model or add a [model] section")
    tokens = args.batch_tokens or swarm.batch_tokens
    microbatches = args.microbatches or swarm.microbatches
    if tokens is None or microbatches is None:
        parser.error(f"{args.swarm}: [batch]: no batch size; fix: pass --batch-tokens and --microbatches or add "
                     f"a [batch] section")
    if microbatches > tokens:
        parser.error(f"need --microbatches ({microbatches}) <= --batch-tokens ({tokens})")
    stages = args.stages if args.stages is not None else (swarm.stages if args.planner in ("paper", "refined")
                                                           else None)
    if stages is not None and args.planner not in ("paper", "refined"):
        parser.error(f"--stages applies to the paper and refined planners, not {args.planner}")
    reliable = int(swarm.reliable.sum())
    if stages is not None and not 1 <= stages <= min(reliable // 2, model.layers):
        parser.error(f"--stages {stages}: {args.swarm} has {reliable} reliable devices (2 per stage) and the model "
                     f"{model.layers} layers; fix: use --stages between 1 and {min(reliable // 2, model.layers)}")
    try:
        budget_s = default_budget_s(len(swarm.devices)) if args.budget_s is None else args.budget_s
        if args.rounds is not None:  # a replay: rounds alone bound it
            budget_s = 0.0
        plan = make_plan(swarm, model, batch_tokens=tokens, microbatches=microbatches, planner=args.planner,
                         stages=stages, seed=args.seed, average_every=args.average_every, budget_s=budget_s,
                         clock=time.monotonic, rounds=args.rounds, searches=args.searches, donor=args.donor,
                         jobs=args.jobs or default_jobs(), heats=args.heats)
    except PlanningError as error:
        print(f"{args.swarm}: {error}", file=sys.stderr)
        return 1
    print(format_plan(plan, title=f"{args.planner} plan for {args.swarm} ({model.name}, {tokens} tokens in "
                                  f"{microbatches} microbatches)"))
    if args.json is not None:
        args.json.write_text(json.dumps({**plan.to_json(), "model": model.to_json()}, indent=2) + "\n")
    return 0


def hf_model_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelConfig:
    """--model-config's model (and not beside --model)."""
    if args.model is not None:
        parser.error("--model-config and --model name the model both; give one")
    try:
        return read_config(args.model_config)
    except CheckpointError as e:
        parser.error(f"--model-config {args.model_config}: {e}")


def live_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Plan the peers that announced themselves in the swarm at --initial-peers; with --publish, publish it."""
    if args.publish and args.planner_identity is None:
        parser.error("--publish needs --planner-identity PATH: the plan is signed with the planner's key")
    if not args.publish and (args.planner_identity is not None or args.publish_for is not None):
        parser.error("--planner-identity and --publish-for go with --publish")
    if args.batch_tokens is not None:
        parser.error("--batch-tokens is for swarm files; a live swarm trains --batch-rows x --microbatches x "
                     "--seq-len tokens per batch")
    states = {"precision": args.precision or PEER_DEFAULTS.precision,
              "optimizer": args.optimizer or PEER_DEFAULTS.optimizer,
              "offload": args.offload or "none", "averaging_codec": args.averaging_codec or PEER_DEFAULTS.averaging_codec}
    if args.model_config is not None:
        model = config_spec(hf_model_config(parser, args), **states, name=checkpoint_name(args.model_config))
    else:
        model = model_spec(args.model or PEER_DEFAULTS.model, **states)
    microbatches = args.microbatches or PEER_DEFAULTS.microbatches
    tokens = ((args.batch_rows or PEER_DEFAULTS.rows_per_microbatch) * microbatches
              * (args.seq_len or PEER_DEFAULTS.seq_len))
    if args.stages is not None and args.planner not in ("paper", "refined"):
        parser.error(f"--stages applies to the paper and refined planners, not {args.planner}")
    expect = args.expect if args.expect is not None else 2 * (args.stages or 1)
    if expect < 2:
        parser.error(f"--expect {expect}: a plan needs at least 2 servers (an FS and a BS)")
    check_maddrs(parser, "--initial-peers", args.initial_peers)
    run = args.run_id or PEER_DEFAULTS.run_id
    from hivemind.dht.crypto import RSASignatureValidator

    from p2ptrain.dht import start_dht, stop_dht
    from p2ptrain.live.identity import load_or_create_identity

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signer = load_or_create_identity(args.planner_identity) if args.publish else RSASignatureValidator()
        # the planner's own key signs the plan: a DHT keeps only its first signer
        dht = start_dht(run, signer=signer, initial_peers=args.initial_peers, client_mode=True)
        try:
            return _plan_live(args, dht=dht, signer=signer, run_id=run, model=model, tokens=tokens,
                              microbatches=microbatches, expect=expect, stop=stop)
        finally:
            stop_dht(dht)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _plan_live(args: argparse.Namespace, *, dht: hivemind.DHT, signer: RSASignatureValidator, run_id: str,
               model: ModelSpec,
               tokens: int, microbatches: int, expect: int, stop: threading.Event) -> int:
    from p2ptrain.live.publisher import plan_swarm, publish

    settings = RuntimeConfig(plan_timeout_s=args.expect_timeout or RuntimeConfig.plan_timeout_s)
    try:
        plan = plan_swarm(dht, run_id=run_id, model=model, tokens=tokens, microbatches=microbatches,
                          planner=args.planner, stages=args.stages, seed=args.seed, expect=expect, settings=settings,
                          stop=stop, average_every=args.average_every, budget_s=args.budget_s, rounds=args.rounds,
                          searches=args.searches, donor=args.donor, jobs=args.jobs or default_jobs(),
                          heats=args.heats)
    except (SwarmFileError, PlanningError) as error:
        print(f"run {run_id}: {error}", file=sys.stderr)
        return 1
    if plan is None:
        return 1
    print(format_plan(plan, title=f"{args.planner} plan for the peers of run {run_id} ({model.name}, "
                                  f"{tokens} tokens in {microbatches} microbatches)"), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({**plan.to_json(), "model": model.to_json()}, indent=2) + "\n")
    if args.publish:
        publish(dht, signer=signer, run_id=run_id, plan=plan.to_json(), publish_for_s=args.publish_for,
                settings=settings, stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
