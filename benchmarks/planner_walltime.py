"""Whole-process wall time of `python -m p2ptrain.plan` with its defaults (the refined planner and its default
anytime budget) on generated geo-distributed swarms written as swarm files (issue 11, Must show 2: under 10 s for
64 devices and under 60 s for 1,024 on this machine), measured on an otherwise idle machine.

    python benchmarks/planner_walltime.py [--sizes 64 1024] [--seed 0]

Prints a table and writes it to benchmarks/results/planner_walltime.md with the command that made it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2ptrain.planner.generate import GEO_BATCH, GEO_MODEL, geo_swarm_data, to_toml  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "planner_walltime.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = ["| devices | whole process wall s | predicted s/batch | gap to bound | anytime rounds | plans scored |",
            "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="planner-walltime-") as tmp:
        for size in args.sizes:
            path, out = Path(tmp) / f"geo-{size}.toml", Path(tmp) / f"geo-{size}.json"
            # the geo benchmark's model and batch (llama-33b, fp16, optimizer offloaded; see benchmarks/planner.py)
            data = {**geo_swarm_data(size, args.seed), "model": GEO_MODEL, "batch": GEO_BATCH}
            path.write_text(to_toml(data, f"# geo swarm of {size} devices, seed {args.seed}"))
            wall = time.perf_counter()
            subprocess.run([sys.executable, "-m", "p2ptrain.plan", str(path), "--json", str(out)], cwd=ROOT,
                           check=True, stdout=subprocess.DEVNULL, timeout=600)
            wall = time.perf_counter() - wall
            plan = json.loads(out.read_text())
            search = plan.get("search", {})
            rows.append(f"| {size} | {wall:.2f} | {plan['predicted']['batch_time_s']:.1f} | "
                        f"{plan['predicted']['gap']:.2f} | {search.get('rounds', 0)} | {search.get('scored', 0)} |")
            print(rows[-1], flush=True)
    command = "python benchmarks/planner_walltime.py " + " ".join(sys.argv[1:])
    RESULTS.write_text(f"# Planning time: the whole `python -m p2ptrain.plan` process, defaults\n\n"
                       f"Command: `{command.strip()}`\n\nLoad average at the end: {os.getloadavg()}\n\n"
                       + "\n".join(rows) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
