"""``python -m p2ptrain.plan peers/FILE.toml``: plan a swarm file, print the plan, optionally write its JSON.

The model and batch come from the file's [model] and [batch] sections unless given here; ``--model`` takes a
preset at the file's precision and offload. Bad flags and bad files exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.plan", description=__doc__.splitlines()[0])
    parser.add_argument("swarm", help="swarm file (peers/*.toml)")
    parser.add_argument("--model", choices=PRESETS, help="model preset (default: the file's [model])")
    parser.add_argument("--batch-tokens", type=int, help="tokens per global batch (default: the file's [batch])")
    parser.add_argument("--microbatches", type=int, help="microbatches per global batch (default: the file's)")
    parser.add_argument("--planner", choices=PLANNERS, default="refined")
    parser.add_argument("--stages", type=int, help="force this many stages (paper and refined planners)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the plan as JSON to this file")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
