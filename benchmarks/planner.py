"""Planner benchmark: PT and efficiency of every planner on every ``peers/`` file and on generated geo-distributed
swarms of 64, 256 and 1,024 devices, the planners' wall time; the refined plan with its default budget against the
best plan long runs find (generated swarms of 32 to 1,024 devices, seeds 500-502 or those of --gap-swarms, and the
paper files), with its gap to the bound; and the §4.4 stage-count comparison.

    python benchmarks/planner.py [--quick] [--parts planners,gap,sec44] [--gap-factor 10] [--gap-seeds 3]
                                 [--gap-sizes 32,64,256,1024] [--gap-swarm-seeds 500,501,502] [--no-gap-files]
                                 [--gap-swarms SIZE:SEED,... ...] [--gap-planner-seeds 1] [--gap-known FILE,...]
                                 [--gap-long-jobs 1] [--gap-heats N] [--stem NAME]

writes ``benchmarks/results/planner.md`` (tables and the command), ``planner.json`` and ``planner.png``; with only
some --parts, ``planner-PARTS.*``; with --stem, ``NAME.*``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# the planner's matrices are small: BLAS threads only contend for the 2 cores (set before numpy loads)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2ptrain.cli import count  # noqa: E402
from p2ptrain.planner import PLANNERS, Plan, PlanningError, Swarm, make_plan, model_spec  # noqa: E402
from p2ptrain.planner.anytime import default_budget_s  # noqa: E402
from p2ptrain.planner.cost import Workload, evaluate  # noqa: E402
from p2ptrain.planner.generate import GEO_BATCH, GEO_MODEL, geo_swarm  # noqa: E402
from p2ptrain.planner.portfolio import default_jobs  # noqa: E402
from p2ptrain.planner.swarmfile import load_swarm  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def run_planners(swarm: Swarm, name: str, model, tokens: int, microbatches: int, samples: int) -> dict:
    row: dict = {"swarm": name, "devices": len(swarm.devices), "reliable": int(swarm.reliable.sum()),
                 "model": model.name, "planners": {}}
    for planner in PLANNERS:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            plan = make_plan(swarm, model, batch_tokens=tokens, microbatches=microbatches, planner=planner,
                             random_samples=samples)
            result = {"pt": plan.predicted.batch_time_s, "efficiency": plan.predicted.efficiency,
                      "stages": len(plan.stages), "idle": len(plan.idle)}
            # the same for every planner: no plan is faster, so where 0.9 x random lies below it the target is out
            row["bound_s"] = plan.predicted.bound_s
        except PlanningError:
            result = {"pt": float("inf"), "efficiency": 0.0, "stages": 0, "idle": len(swarm.devices)}
        result["wall_s"] = time.perf_counter() - start
        result["cpu_s"] = time.process_time() - cpu
        row["planners"][planner] = result
        print(f"  {name:22s} {planner:8s} PT {result['pt']:10.4g} s  eff {result['efficiency']:.3f}  "
              f"K {result['stages']:2d}  {result['wall_s']:6.2f} s wall {result['cpu_s']:6.2f} s cpu", flush=True)
    p = row["planners"]
    row["target_reachable"] = bool(0.9 * p["random"]["pt"] >= row["bound_s"])
    row["refined_vs_bound"] = p["refined"]["pt"] / row["bound_s"]
    row["refined_vs_random"] = p["refined"]["pt"] / p["random"]["pt"]
    row["refined_vs_dtfm"] = p["refined"]["pt"] / p["dtfm"]["pt"]
    row["must_show_1"] = bool(row["refined_vs_random"] <= 0.9 and p["refined"]["pt"] <= p["dtfm"]["pt"])
    return row


def known_bests(paths: list[Path]) -> dict[str, tuple[float, str]]:
    """The best PT each swarm reached in earlier runs of this benchmark (their JSON files), with the file it is from:
    references a later run (another default budget, another planner) is measured against without repeating the long
    runs. A file planned for another model or batch than this one's generated swarms is refused."""
    known: dict[str, tuple[float, str]] = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"--gap-known {path}: {error}; name JSON files this benchmark wrote") from None
        if not isinstance(data, dict) or (data.get("geo_model"), data.get("geo_batch")) != (GEO_MODEL, GEO_BATCH):
            raise SystemExit(f"--gap-known {path}: not this benchmark's results for {GEO_MODEL} and {GEO_BATCH}; "
                             "its plans are no reference here")
        for row in data.get("gap", []):
            if row["swarm"] not in known or row["best_pt"] < known[row["swarm"]][0]:
                known[row["swarm"]] = (row["best_pt"], path.name)
    return known


def plan_shape(plan: Plan) -> dict:
    """What tells two plans' basins apart at a glance: per stage, its layers, servers and clients; the idle count."""
    return {"stages": len(plan.stages), "layers": [stop - start for start, stop in (s.layers for s in plan.stages)],
            "servers": [len(s.fs) + len(s.bs) for s in plan.stages], "clients": [len(s.clients) for s in plan.stages],
            "idle": len(plan.idle)}


def long_run(swarm: Swarm, model, seed: int, budget_s: float, kwargs: dict) -> dict:
    """One long run of the refined search: one job, the planner's ``seed``, never stopping before ``budget_s``."""
    start = time.perf_counter()
    long = make_plan(swarm, model, seed=seed, budget_s=budget_s, clock=time.monotonic, patience=1_000_000, heats=1,
                     **kwargs)
    return {"seed": seed, "pt": long.predicted.batch_time_s, "wall_s": time.perf_counter() - start,
            "rounds": long.search.rounds if long.search else 0, "shape": plan_shape(long)}


def gap_row(swarm: Swarm, name: str, model, tokens: int, microbatches: int, *, factor: float, seeds: int,
            samples: int, planner_seeds: int = 1, known: tuple[float, str] | None = None, long_jobs: int = 1,
            heats: int | None = None) -> dict:
    """The refined plan with the CLI's default budget and jobs against the best plan found by long runs of the
    refined search (``factor`` times the budget, one job, seeds 1..``seeds``, never stopping early; ``long_jobs`` at
    once, each in its own process), and every other planner against that best; the gap to the bound; plan times. With
    ``planner_seeds`` N > 1, the same default-budget plan with planner seeds 1..N-1 too (`--seed`: which plan a user
    gets turns on it), their plans among those the best is taken from. ``known``: an earlier run's best PT of this
    swarm and its file (``known_bests``), which joins the best. ``heats``: the default-budget plans' (`--heats`;
    None: the CLI's default)."""
    kwargs = {"batch_tokens": tokens, "microbatches": microbatches}
    budget = default_budget_s(len(swarm.devices))
    start = time.perf_counter()
    default = make_plan(swarm, model, budget_s=budget, clock=time.monotonic, jobs=default_jobs(), heats=heats,
                        **kwargs)
    row: dict = {"swarm": name, "devices": len(swarm.devices), "budget_s": budget,
                 "default_pt": default.predicted.batch_time_s, "default_wall_s": time.perf_counter() - start,
                 "default_rounds": default.search.rounds if default.search else 0, "gap": default.predicted.gap,
                 # which job's search the plan came from: the planner's seed or another the portfolio drew from it
                 "default_seed": default.search.seed if default.search else None,
                 "default_heats": default.search.heats if default.search else None,
                 "default_shape": plan_shape(default)}
    row["seeds"] = []
    for seed in range(1, planner_seeds):
        start = time.perf_counter()
        other = make_plan(swarm, model, seed=seed, budget_s=budget, clock=time.monotonic, jobs=default_jobs(),
                          heats=heats, **kwargs)
        row["seeds"].append({"seed": seed, "pt": other.predicted.batch_time_s, "wall_s": time.perf_counter() - start,
                             "rounds": other.search.rounds if other.search else 0})
    if long_jobs > 1:
        with ProcessPoolExecutor(long_jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = [pool.submit(long_run, swarm, model, seed, factor * budget, kwargs) for seed in range(1, seeds + 1)]
            row["long"] = [run.result() for run in runs]
    else:
        row["long"] = [long_run(swarm, model, seed, factor * budget, kwargs) for seed in range(1, seeds + 1)]
    if known is not None:
        row["known_pt"], row["known_from"] = known
    best = min([row["default_pt"], *(r["pt"] for r in row["long"] + row["seeds"]),
                *([known[0]] if known is not None else [])])
    row["best_pt"] = best
    row["default_vs_best"] = row["default_pt"] / best
    row["seeds_vs_best"] = [row["default_vs_best"], *(r["pt"] / best for r in row["seeds"])]
    row["others_vs_best"] = {}
    for planner in ("paper", "swarm", "dtfm", "random"):
        try:
            pt = make_plan(swarm, model, planner=planner, random_samples=samples, **kwargs).predicted.batch_time_s
        except PlanningError:
            pt = float("inf")
        row["others_vs_best"][planner] = pt / best
    row["never_worse"] = all(row["default_pt"] <= pt * best * (1 + 1e-9) for pt in row["others_vs_best"].values())
    print(f"  {name:22s} default {row['default_pt']:10.4g} s ({row['default_wall_s']:.1f} s, "
          f"{row['default_rounds']} rounds)  best {best:10.4g} s  ratio {row['default_vs_best']:.3f}  "
          f"gap to bound {row['gap']:.2f}  " + "  ".join(f"{p} {v:.2f}" for p, v in row["others_vs_best"].items())
          + (f"  planner seeds 0-{planner_seeds - 1}: worst {max(row['seeds_vs_best']):.3f}"
             if planner_seeds > 1 else ""), flush=True)
    return row


def integers(text: str) -> list[int]:
    """``--gap-sizes``' and ``--gap-swarm-seeds``' comma-separated integers; empty for none."""
    try:
        return [int(item) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes integers separated by commas (e.g. 32,64), not {text!r}") from None


def swarms_by_size(text: str) -> tuple[int, list[int]]:
    """``--gap-swarms``' ``SIZE:SEED,SEED``: a size and the seeds of its generated swarms."""
    size, _, seeds = text.partition(":")
    try:
        return int(size), [int(seed) for seed in seeds.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes SIZE:SEED,SEED,... (e.g. 32:900,901), not {text!r}") from None


def stage_counts(row: dict) -> str:
    """The default's and each long run's stage count and idle devices (rows of before ``plan_shape`` have none)."""
    def one(shape: dict | None) -> str:
        return "-" if shape is None else f"{shape['stages']} ({shape['idle']})"
    return one(row.get("default_shape")) + "; " + ", ".join(one(r.get("shape")) for r in row["long"])


def long_ratios(row: dict) -> str:
    """Each long run's PT over the best: how far apart runs of 10x the budget from other seeds end, the spread of
    the reference the default's ratio is taken against."""
    return ", ".join(f"{r['pt'] / row['best_pt']:.3f}" for r in row["long"]) or "-"


def gap_markdown(rows: list[dict], factor: float, seeds: int, long_jobs: int = 1) -> list[str]:
    at_once = f"{long_jobs} at once, " if long_jobs > 1 else ""
    out = ["", "## The refined plan against the best plan found", "",
           f"default: `python -m p2ptrain.plan`'s refined plan with its default budget (`--budget-s`, "
           f"`planner.anytime.default_budget_s`) and jobs (`--jobs`: {default_jobs()} here, `planner.portfolio`); "
           + (f"best: the best of it and of {seeds} long runs of the refined search ({factor:g} x the budget each, "
              f"one job, seeds 1-{seeds}, {at_once}no early stop)" if seeds
              else "best: the best of it and of earlier runs' plans (`--gap-known`; no long runs here)")
           + "; ratio = default PT / best PT (must-show "
           "1: at most 1.05); gap = default PT over the bound, less 1; the other planners' PT over the best PT "
           "(must-show 3: none below the default's ratio)."
           + (" Where an earlier run (`--gap-known`) found a better plan of a swarm, its PT is the best; which rows "
              "take it is listed below the table." if any("known_pt" in r for r in rows) else ""), "",
           "| swarm | devices | budget s | default PT s | plan wall s | rounds | best PT s | ratio | gap to bound | "
           "long runs / best | paper | swarm | dtfm | random | never worse | stages (idle): default; long runs |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = r["others_vs_best"]
        out.append(f"| {r['swarm']} | {r['devices']} | {r['budget_s']:.1f} | {r['default_pt']:.5g} | "
                   f"{r['default_wall_s']:.1f} | {r['default_rounds']} | {r['best_pt']:.5g} | "
                   f"{r['default_vs_best']:.3f} | {r['gap']:.2f} | {long_ratios(r)} | {o['paper']:.3f} | "
                   f"{o['swarm']:.3f} | {o['dtfm']:.3f} | {o['random']:.3f} | {'yes' if r['never_worse'] else 'NO'} | "
                   + stage_counts(r) + " |")
    worst = max(rows, key=lambda r: r["default_vs_best"]) if rows else None
    if worst is not None:
        out += ["", f"Worst ratio: {worst['default_vs_best']:.3f} ({worst['swarm']}); within 5% on "
                    f"{sum(r['default_vs_best'] <= 1.05 for r in rows)} of {len(rows)}."]
    apart = [r for r in rows if len(r["long"]) > 1]
    if apart:
        spreads = {r["swarm"]: max(x["pt"] for x in r["long"]) / min(x["pt"] for x in r["long"]) for r in apart}
        medians = {r["swarm"]: r["default_pt"] / float(np.median([x["pt"] for x in r["long"]])) for r in apart}
        widest, farthest = max(spreads, key=spreads.get), max(medians, key=medians.get)
        out += ["", f"The long runs apart: a swarm's worst long run over its best, up to {spreads[widest]:.3f} "
                    f"({widest}); the default within 5% of the median long run on "
                    f"{sum(v <= 1.05 for v in medians.values())} of {len(medians)} (worst "
                    f"{medians[farthest]:.3f}, {farthest})."]
    known = [r for r in rows if "known_pt" in r]
    if known:
        out += ["", "Earlier runs' bests: " + "; ".join(
            f"{r['swarm']} {r['known_pt']:.5g} s ({r['known_from']}"
            + (", the best" if r["known_pt"] <= r["best_pt"] else ", beaten here") + ")" for r in known) + "."]
    seeded = [r for r in rows if len(r.get("seeds_vs_best", [])) > 1]
    if seeded:
        count = len(seeded[0]["seeds_vs_best"])
        out += ["", f"The same default-budget plan with planner seeds 0-{count - 1} (`--seed`; seed 0 is the "
                    "default's), each against the swarm's best (which their plans join):", "",
                "| swarm | " + " | ".join(f"seed {i}" for i in range(count)) + " | mean | worst |",
                "|---|" + "---|" * (count + 2)]
        for r in seeded:
            ratios = r["seeds_vs_best"]
            out.append(f"| {r['swarm']} | " + " | ".join(f"{v:.3f}" for v in ratios)
                       + f" | {np.mean(ratios):.3f} | {max(ratios):.3f} |")
        every = [v for r in seeded for v in r["seeds_vs_best"]]
        out += ["", f"Over all {len(every)} plans: within 5% on {sum(v <= 1.05 for v in every)}, mean ratio "
                    f"{np.mean(every):.3f}, worst {max(every):.3f}."]
    return out


def stage_comparison(path: Path, tokens: int) -> list[dict]:
    """§4.4: the planner's own choice beside plans forced to 2, 3 and 4 stages, with the terms that set PT."""
    swarm = load_swarm(path)
    assert swarm.model is not None and swarm.microbatches
    wl = Workload(model=swarm.model, batch_tokens=tokens, microbatches=swarm.microbatches)
    net = swarm.network()
    rows = []
    for planner, stages in (("refined", None), ("paper", None), ("refined", 2), ("refined", 3), ("refined", 4),
                            ("paper", 2), ("paper", 3), ("paper", 4)):
        plan = make_plan(swarm, swarm.model, batch_tokens=tokens, microbatches=swarm.microbatches,
                         planner=planner, stages=stages)
        ev = evaluate(net, wl, plan.layouts(swarm.ids))
        d = wl.microbatches
        compute = [d * wl.microbatch_tokens * (s.layers[1] - s.layers[0]) * wl.model.flops_per_token_per_layer /
                   sum(net.flops[swarm.index(w)] for w in s.workers) for s in plan.stages]
        rows.append({
            "tokens": tokens, "planner": planner, "forced": stages, "stages": len(plan.stages), "pt": ev.batch_time_s,
            "efficiency": ev.efficiency, "max_stage": max(ev.stage_times_s), "max_averaging": max(ev.averaging_s),
            "max_compute": max(compute), "layers": [s.layers[1] - s.layers[0] for s in plan.stages],
            "members": [f"{len(s.fs)}+{len(s.bs)}+{len(s.clients)}" for s in plan.stages], "idle": len(plan.idle),
        })
    return rows


def markdown(rows: list[dict], comparison: list[dict], command: str, samples: int) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    out = ["# Planner benchmark", "", f"Command: `{command}`", "",
           f"Commit: {commit.stdout.strip() or '?'}{' (with uncommitted changes)' if dirty else ''}"]
    if rows:
        out += planners_markdown(rows, samples)
    if comparison:
        out += sec44_markdown(comparison)
    return "\n".join(out) + "\n"


def planners_markdown(rows: list[dict], samples: int) -> list[str]:
    out = ["", "PT: predicted time per global batch (docs/design.md §3 cost model), seconds; eff = LB/PT. random = "
           f"best of {samples} random valid plans. ok = refined PT <= 0.9 x random and <= DT-FM.", "",
           "bound: the largest of LB, the memory-aware lower bound (`cost.memory_lower_bound`: devices that no "
           "stage of a valid plan has room for, and the two reliable servers every stage needs, are counted) and the "
           "link-aware one (`cost.link_lower_bound`: each device's least latency and inverse bandwidth to a server, "
           "the cheapest transfer between stages, and the layers a stage can average within the batch time); "
           "no plan has a lower PT. reachable = 0.9 x random >= bound: where it is 'no', no planner can meet the 0.9 "
           "target, and refined/bound says how far from the best possible the refined plan is.", "",
           "| swarm | devices (reliable) | " + " | ".join(f"{p} PT (eff)" for p in PLANNERS) +
           " | bound | refined/random | refined/dtfm | refined/bound | reachable | ok |",
           "|---|---|" + "---|" * (len(PLANNERS) + 6)]
    for r in rows:
        cells = [f"{r['planners'][p]['pt']:.4g} ({r['planners'][p]['efficiency']:.2f})" for p in PLANNERS]
        out.append(f"| {r['swarm']} | {r['devices']} ({r['reliable']}) | " + " | ".join(cells) +
                   f" | {r['bound_s']:.4g} | {r['refined_vs_random']:.2f} | {r['refined_vs_dtfm']:.2f} | "
                   f"{r['refined_vs_bound']:.3f} | {'yes' if r['target_reachable'] else 'no'} | "
                   f"{'yes' if r['must_show_1'] else 'NO'} |")
    out += ["", "## Planner wall time (s)", "",
            "Wall / CPU seconds (the machine has 2 cores and may be shared; CPU time is the steadier figure).", "",
            "| swarm | devices | " + " | ".join(PLANNERS) + " |", "|---|---|" + "---|" * len(PLANNERS)]
    for r in rows:
        out.append(f"| {r['swarm']} | {r['devices']} | " +
                   " | ".join(f"{r['planners'][p]['wall_s']:.2f} / {r['planners'][p]['cpu_s']:.2f}"
                              for p in PLANNERS) + " |")
    return out


def sec44_markdown(comparison: list[dict]) -> list[str]:
    out = ["", "## §4.4 real-world testbed: stage count", "",
            "Batch tokens: the file's 524,288, then smaller batches, where averaging (which does not shrink with "
            "the batch) starts to bind.", "",
            "| batch tokens | planner | stages forced | K | PT s | eff | max d·(C+C+DT) s | max AR s | "
            "max compute s | layers | FS+BS+clients | idle |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparison:
        out.append(f"| {c['tokens']} | {c['planner']} | {c['forced'] or '-'} | {c['stages']} | {c['pt']:.5g} | "
                   f"{c['efficiency']:.3f}"
                   f" | {c['max_stage']:.5g} | {c['max_averaging']:.5g} | {c['max_compute']:.5g} | "
                   f"{c['layers']} | {' '.join(c['members'])} | {c['idle']} |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    x = np.arange(len(rows))
    width = 0.8 / len(PLANNERS)
    for i, p in enumerate(PLANNERS):
        ratio = [r["planners"][p]["pt"] / r["planners"]["random"]["pt"] for r in rows]
        left.bar(x + i * width, ratio, width, label=p)
    left.axhline(0.9, color="black", linestyle="--", linewidth=0.8)
    left.set_yscale("log")
    left.set_xticks(x + width * (len(PLANNERS) - 1) / 2, [r["swarm"] for r in rows], rotation=60, ha="right",
                    fontsize=7)
    left.set_ylabel("PT / best-of-random PT (log)")
    left.legend(fontsize=8)
    for p in PLANNERS:
        right.scatter([r["devices"] for r in rows], [r["planners"][p]["wall_s"] for r in rows], label=p, s=14)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("devices")
    right.set_ylabel("planner wall time (s)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 random samples, no 1,024-device swarm; the gap "
                                                              "section on 3 small swarms with 2x budgets, one seed")
    parser.add_argument("--parts", default="planners,gap,sec44",
                        help="which sections: planners (every planner on every swarm, the quick refined search), "
                             "gap (the default refined plan against long runs), sec44 (the stage-count comparison)")
    parser.add_argument("--gap-factor", type=float, default=10.0, help="a long run's budget over the default")
    parser.add_argument("--gap-seeds", type=int, default=3, help="long runs per swarm")
    parser.add_argument("--gap-long-jobs", type=count, default=1,
                        help="long runs at once, each in its own process: a long run is one job, so on 2 idle cores "
                             "2 halve their wall time (default 1)")
    parser.add_argument("--gap-heats", type=count,
                        help="the default-budget plans' heats (`python -m p2ptrain.plan --heats`; default: the CLI's "
                             "default); the long runs search one seed each")
    parser.add_argument("--gap-planner-seeds", type=int, default=1,
                        help="also make the default-budget plan with planner seeds 1..N-1 and report each one's "
                             "ratio (default 1: seed 0's alone, the CLI's default)")
    parser.add_argument("--gap-sizes", type=integers, default="32,64,256,1024",
                        help="device counts of the gap section's generated swarms; empty for none (the paper files "
                             "alone)")
    parser.add_argument("--gap-swarm-seeds", type=integers, default="500,501,502",
                        help="the seeds of the generated swarms of each size (one at a time: a 1,024-device swarm's "
                             "long runs take about 25 minutes)")
    parser.add_argument("--gap-swarms", nargs="+", type=swarms_by_size, metavar="SIZE:SEED,...",
                        help="generated swarms by size, each with its own seeds (`32:900,901 256:700`), in place of "
                             "--gap-sizes and --gap-swarm-seeds")
    parser.add_argument("--gap-files", action=argparse.BooleanOptionalAction, default=True,
                        help="whether the gap section also takes the paper's swarm files")
    parser.add_argument("--gap-known", default="",
                        help="JSON files of earlier gap runs (comma-separated): each swarm's best PT there joins its "
                             "best here (so --gap-seeds 0 measures a new default against earlier long runs)")
    parser.add_argument("--stem", help="name of the result files (default: planner, or planner-PARTS with --parts)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    samples = 200 if args.quick else 2000
    files = [(path.stem, load_swarm(path)) for path in sorted((ROOT / "peers").glob("*.toml"))]
    model = model_spec(GEO_MODEL["preset"], precision=GEO_MODEL["precision"], offload=GEO_MODEL["offload"])
    rows = []
    if "planners" in parts:
        for name, swarm in files:
            assert swarm.model is not None and swarm.batch_tokens and swarm.microbatches, name
            rows.append(run_planners(swarm, name, swarm.model, swarm.batch_tokens, swarm.microbatches, samples))
        sizes = [(64, 0), (64, 1), (64, 2), (256, 0), (256, 1)] + ([] if args.quick else [(1024, 0)])
        for n, seed in sizes:
            rows.append(run_planners(geo_swarm(n, seed), f"geo-{n}-seed{seed}", model, GEO_BATCH["tokens"],
                                     GEO_BATCH["microbatches"], samples))
    gaps = []
    if "gap" in parts:
        factor, seeds = (2.0, 1) if args.quick else (args.gap_factor, args.gap_seeds)
        if args.quick:
            generated = [(32, 500), (32, 501), (64, 500)]
        elif args.gap_swarms:
            generated = [(n, seed) for n, swarm_seeds in args.gap_swarms for seed in swarm_seeds]
        else:
            generated = [(n, seed) for n in args.gap_sizes for seed in args.gap_swarm_seeds]
        cases = [(f"geo-{n}-seed{seed}", geo_swarm(n, seed), model, GEO_BATCH["tokens"], GEO_BATCH["microbatches"])
                 for n, seed in generated]
        if not args.quick and args.gap_files:
            cases += [(name, swarm, swarm.model, swarm.batch_tokens, swarm.microbatches) for name, swarm in files
                      if name.startswith("paper-")]
        known = known_bests([Path(p) for p in args.gap_known.split(",") if p])
        for name, swarm, spec, tokens, microbatches in cases:
            gaps.append(gap_row(swarm, name, spec, tokens, microbatches, factor=factor, seeds=seeds,
                                samples=samples, planner_seeds=args.gap_planner_seeds, known=known.get(name),
                                long_jobs=args.gap_long_jobs, heats=args.gap_heats))
    comparison = [] if "sec44" not in parts else [
        c for tokens in (524288, 262144, 131072) for c in stage_comparison(ROOT / "peers" / "paper-sec44.toml", tokens)]
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/planner.py", *sys.argv[1:]])
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, comparison, command, samples)
    if gaps:
        text += "\n".join(gap_markdown(gaps, factor, seeds, args.gap_long_jobs)) + "\n"
    stem = args.stem or ("planner" if parts == {"planners", "gap", "sec44"} else "planner-" + "-".join(sorted(parts)))
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"command": command, "geo_model": GEO_MODEL,
                                                      "geo_batch": GEO_BATCH, "rows": rows, "gap": gaps,
                                                      "sec44": comparison}, indent=1) + "\n")
    if rows:
        plot(rows, RESULTS / f"{stem}.png")
    print(text)


if __name__ == "__main__":
    main()
