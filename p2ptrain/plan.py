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
from pathlib import Path

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from p2ptrain.live.identity import load_or_create_identity, public_key_path
from p2ptrain.live.publisher import join_as_planner, plan_swarm, publish
from p2ptrain.models.llama import LLAMA_CONFIGS
from p2ptrain.planner import PLANNERS, Plan, PlanningError, make_plan
from p2ptrain.planner.presets import PRESETS, model_spec
from p2ptrain.planner.swarmfile import SwarmFileError, load_swarm


def format_plan(plan: Plan, *, title: str) -> str:
    p = plan.predicted
    rows = [("stage", "layers", "FS", "BS", "clients", "batch time s", "averaging s")]
    for k, (s, t, a) in enumerate(zip(plan.stages, p.stage_times_s, p.averaging_s)):
        rows.append((str(k), f"[{s.layers[0]}, {s.layers[1]})", " ".join(s.fs), " ".join(s.bs),
                     " ".join(s.clients) or "-", f"{t:.4g}", f"{a:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"idle: {' '.join(plan.idle) or '-'}")
    lines.append(f"predicted batch time {p.batch_time_s:.4g} s, lower bound {p.lower_bound_s:.4g} s, "
                 f"efficiency {p.efficiency:.3f}")
    if p.memory_lower_bound_s is not None and p.memory_lower_bound_s > p.lower_bound_s * (1 + 1e-9):
        lines.append(f"with memory and 2 servers per stage counted, no plan beats {p.memory_lower_bound_s:.4g} s "
                     f"({p.memory_lower_bound_s / p.batch_time_s:.3f} of this plan's time)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.plan", description=__doc__.splitlines()[0],
                                     epilog=LIVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("swarm", nargs="?", help="swarm file (peers/*.toml); omit it with --initial-peers")
    parser.add_argument("--model", choices=PRESETS, help="model preset (default: the file's [model])")
    parser.add_argument("--batch-tokens", type=int, help="tokens per global batch (default: the file's [batch])")
    parser.add_argument("--microbatches", type=int, help="microbatches per global batch (default: the file's)")
    parser.add_argument("--planner", choices=PLANNERS, default="refined")
    parser.add_argument("--stages", type=int, help="force this many stages (paper and refined planners)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the plan as JSON to this file")
    live = parser.add_argument_group("live planning (plan what the peers of a running swarm announced)")
    live.add_argument("--initial-peers", nargs="+", help="multiaddrs of peers of the swarm, instead of a swarm file")
    live.add_argument("--publish", action="store_true", help="store the plan in the DHT, signed, and keep it alive")
    live.add_argument("--planner-identity", type=Path,
                      help="the planner's private key (created if missing); its public key goes to PATH.pub")
    live.add_argument("--expect", type=int, help="servers to wait for (default: 2 per stage, at least 2)")
    live.add_argument("--expect-timeout", type=float, help="seconds to wait for them (default: 600)")
    live.add_argument("--publish-for", type=float, help="seconds to keep the plan alive (default: until stopped)")
    live.add_argument("--run-id", help=f"the swarm's DHT prefix (default: {_peer_default('run_id')})")
    live.add_argument("--batch-rows", type=int, help=f"rows per microbatch (default: {_peer_default('batch_rows')})")
    live.add_argument("--seq-len", type=int, help=f"tokens per row (default: {_peer_default('seq_len')})")
    return parser


LIVE_HELP = """live planning:
  python -m p2ptrain.plan --planner-identity planner.key     # only creates the key and planner.key.pub
  python -m p2ptrain.plan --initial-peers ADDR --publish --planner-identity planner.key --expect 4 --stages 2
Servers and clients started with --planner-key planner.key.pub and no --stage take their place from the plan.
The recipe flags (--model, --batch-rows, --microbatches, --seq-len, --run-id) must match the peers'."""

_LIVE_ONLY = ("publish", "expect", "expect_timeout", "publish_for", "run_id", "batch_rows", "seq_len")


def _peer_default(name: str) -> object:
    """The peers' default for a recipe flag, so that a live plan without flags fits peers started without them."""
    from p2ptrain.peer import build_parser as peer_parser  # the peer CLI pulls in torch; only live planning needs it

    return peer_parser().get_default(name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.swarm is None and args.initial_peers is None:
        if args.planner_identity is None:
            parser.error("give a swarm file (offline planning) or --initial-peers ADDR (live planning)")
        if any(getattr(args, name) not in (None, False) for name in _LIVE_ONLY):
            parser.error("live planning needs --initial-peers ADDR")
        load_or_create_identity(args.planner_identity)
        print(f"planner key {args.planner_identity}; give peers --planner-key {public_key_path(args.planner_identity)}")
        return 0
    if args.swarm is not None and args.initial_peers is not None:
        parser.error("give either a swarm file or --initial-peers, not both")
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
    model = model_spec(args.model, precision=swarm.precision, offload=swarm.offload) if args.model else swarm.model
    if model is None:
        parser.error(f"{args.swarm}: [model]: the file names no model; fix: pass --model or add a [model] section")
    tokens = args.batch_tokens or swarm.batch_tokens
    microbatches = args.microbatches or swarm.microbatches
    if tokens is None or microbatches is None:
        parser.error(f"{args.swarm}: [batch]: no batch size; fix: pass --batch-tokens and --microbatches or add "
                     f"a [batch] section")
    if tokens < 1 or microbatches < 1 or microbatches > tokens:
        parser.error(f"need 1 <= --microbatches ({microbatches}) <= --batch-tokens ({tokens})")
    stages = args.stages if args.stages is not None else (swarm.stages if args.planner in ("paper", "refined")
                                                           else None)
    if stages is not None and args.planner not in ("paper", "refined"):
        parser.error(f"--stages applies to the paper and refined planners, not {args.planner}")
    reliable = int(swarm.reliable.sum())
    if stages is not None and not 1 <= stages <= min(reliable // 2, model.layers):
        parser.error(f"--stages {stages}: {args.swarm} has {reliable} reliable devices (2 per stage) and the model "
                     f"{model.layers} layers; fix: use --stages between 1 and {min(reliable // 2, model.layers)}")
    try:
        plan = make_plan(swarm, model, batch_tokens=tokens, microbatches=microbatches, planner=args.planner,
                         stages=stages, seed=args.seed)
    except PlanningError as error:
        print(f"{args.swarm}: {error}", file=sys.stderr)
        return 1
    print(format_plan(plan, title=f"{args.planner} plan for {args.swarm} ({model.name}, {tokens} tokens in "
                                  f"{microbatches} microbatches)"))
    if args.json is not None:
        args.json.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return 0


def live_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Plan the peers that announced themselves in the swarm at --initial-peers; with --publish, publish it."""
    if args.publish and args.planner_identity is None:
        parser.error("--publish needs --planner-identity PATH: the plan is signed with the planner's key")
    if not args.publish and (args.planner_identity is not None or args.publish_for is not None):
        parser.error("--planner-identity and --publish-for go with --publish")
    if args.batch_tokens is not None:
        parser.error("--batch-tokens is for swarm files; a live swarm trains --batch-rows x --microbatches x "
                     "--seq-len tokens per batch")
    model = args.model or _peer_default("model")
    if model not in LLAMA_CONFIGS:
        parser.error(f"--model {model}: peers train Llama presets only ({', '.join(LLAMA_CONFIGS)})")
    recipe = {name: getattr(args, name) if getattr(args, name) is not None else _peer_default(name)
              for name in ("batch_rows", "microbatches", "seq_len")}
    if min(recipe.values()) < 1:
        parser.error("--batch-rows, --microbatches and --seq-len must be >= 1")
    microbatches = recipe["microbatches"]
    tokens = recipe["batch_rows"] * microbatches * recipe["seq_len"]
    if args.stages is not None and args.planner not in ("paper", "refined"):
        parser.error(f"--stages applies to the paper and refined planners, not {args.planner}")
    expect = args.expect if args.expect is not None else 2 * (args.stages or 1)
    if expect < 2:
        parser.error(f"--expect {expect}: a plan needs at least 2 servers (an FS and a BS)")
    run_id = args.run_id or _peer_default("run_id")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        signer = load_or_create_identity(args.planner_identity) if args.publish else RSASignatureValidator()
        dht = join_as_planner(initial_peers=args.initial_peers, signer=signer, run_id=run_id)
        try:
            return _plan_live(args, dht=dht, signer=signer, run_id=run_id, model=model, tokens=tokens,
                              microbatches=microbatches, expect=expect, stop=stop)
        finally:
            dht.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _plan_live(args: argparse.Namespace, *, dht: hivemind.DHT, signer: RSASignatureValidator, run_id: str, model: str,
               tokens: int, microbatches: int, expect: int, stop: threading.Event) -> int:
    timeout_s = 600.0 if args.expect_timeout is None else args.expect_timeout
    try:
        plan = plan_swarm(dht, run_id=run_id, model=model, tokens=tokens, microbatches=microbatches,
                          planner=args.planner, stages=args.stages, seed=args.seed, expect=expect,
                          timeout_s=timeout_s, stop=stop)
    except (SwarmFileError, PlanningError) as error:
        print(f"run {run_id}: {error}", file=sys.stderr)
        return 1
    if plan is None:
        return 1
    print(format_plan(plan, title=f"{args.planner} plan for the peers of run {run_id} ({model}, "
                                  f"{tokens} tokens in {microbatches} microbatches)"), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    if args.publish:
        publish(dht, signer=signer, run_id=run_id, plan=plan.to_json(), publish_for_s=args.publish_for, stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
