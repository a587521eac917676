"""Faults benchmark: a local 2-stage swarm of real processes whose clients vanish (SIGKILL) and come back, at several
disconnection rates, against the same swarm without faults, under both fault policies, in one run on the same cores.

    python benchmarks/faults.py [--rates 0,0.25,0.5] [--policies taskpool,swarm] [--clients 2] [--unreliable 1.0]
                                [--epochs 10] [--warmup 2] [--worker-lost 10] [--seed 0] [--out DIR]

Each case is a fresh swarm (`harness.LocalSwarm`): a bootstrap peer, an FS and a BS per stage, and `--clients`
clients per stage, all `python -m p2ptrain.peer` on 127.0.0.1 with the same recipe. A share `--unreliable` of the
clients is unreliable. The disconnection rate is the paper's (§4.2): the share of the unreliable clients that
vanish during a global batch and return in the next. Each time an epoch closes, every unreliable client is picked
with that probability and SIGKILLed (with its p2p daemon) at a uniformly random moment within the last epoch's
duration, unless it is still coming back from its last disconnection, then started again with the same command at
once; it returns once it has started (imports, p2p daemon, DHT), downloaded its stage's state and polled.

The policies (`--fault-policy`): `taskpool` redoes the rows a vanished worker held at their stage, from the inputs
the FS keeps; `swarm` drops them, and the data source feeds their microbatches again from stage 0 in a later epoch,
as SWARM retrains what a departed peer processed. Each rate runs under every policy with the same kill draws.

Reported per case: throughput (tokens of fresh data per second between the closure of epoch `--warmup` and of the
last one, by this driver's clock: a microbatch fed again is not counted twice), its ratio to the same policy's
no-fault case and to the task pool's at the same rate, the kills, and the row accounting of every epoch from
`p2ptrain.status` (rows in the batch, rows averaged, tasks redone, rows recomputed, rows dropped, microbatches fed
again, workers lost). Writes benchmarks/results/faults.md, .json and .png (throughput against each policy's no-fault
case, per disconnection rate), or the same files in --out DIR.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib
from harness import ROOT, Chaos, LocalSwarm, command_line, fmt, log, machine_info

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from p2ptrain.config import FAULT_POLICIES, RunConfig

RESULTS = ROOT / "benchmarks" / "results"


def run_case(args: argparse.Namespace, policy: str, rate: float, workdir: Path) -> dict[str, Any]:
    config = RunConfig(run_id=f"faults-{policy}{int(rate * 100)}", model=args.model, num_stages=2,
                       rows_per_microbatch=args.rows, microbatches=args.microbatches, seq_len=args.seq_len,
                       fault_policy=policy)
    extra = ["--worker-lost", str(args.worker_lost)]
    rng = random.Random(args.seed)
    workdir.mkdir(parents=True)
    with LocalSwarm(workdir, config, epochs=args.epochs) as swarm:
        swarm.start_bootstrap()
        for stage in range(2):
            swarm.start_server(stage, "bs")
        swarm.start_server(1, "fs")
        names = {f"s{stage}-client{i}": stage for stage in range(2) for i in range(args.clients)}
        for name, stage in names.items():
            swarm.start_client(stage, name=name, extra=extra)
        unreliable = dict(list(names.items())[:round(args.unreliable * len(names))])
        swarm.connect()
        swarm.wait_for_workers(len(names), timeout=180)
        swarm.start_server(0, "fs")  # the data source starts once every client is up
        chaos = Chaos(swarm=swarm, clients=unreliable, rate=rate, extra=extra, rng=rng)
        closed_at: dict[int, float] = {}
        seen, last_close = -1, time.monotonic()
        deadline = time.monotonic() + args.timeout
        try:
            while True:
                report = swarm.status()
                now = time.monotonic()
                for epoch in range(seen + 1, report["epoch"] + 1):
                    closed_at[epoch] = now
                    log(f"  {policy}, rate {rate}: epoch {epoch} closed, {chaos.kills} kills so far")
                if report["epoch"] > seen:  # a draw per global batch, however many closed since the last look
                    for _ in range(report["epoch"] - seen):
                        chaos.epoch_closed((now - last_close) / (report["epoch"] - seen))
                    seen, last_close = report["epoch"], now
                if report["finished"] and report["epoch"] + 1 >= args.epochs:
                    break
                if now > deadline:
                    log(f"  {policy}, rate {rate}: deadline reached at epoch {seen}")
                    break
                time.sleep(0.5)
        finally:
            chaos.stop()
        report = swarm.status()
    first, last = args.warmup, max(closed_at, default=-1)
    again = {e["epoch"]: e["microbatches_retrained"] for e in report["epochs"]}
    tokens = sum(config.tokens_per_epoch - again.get(epoch, 0) * config.rows_per_microbatch * config.seq_len
                 for epoch in range(first + 1, last + 1))
    elapsed = closed_at[last] - closed_at[first] if last > first else None
    stages = [s for e in report["epochs"] for s in e["stages"]]
    return {
        "policy": policy, "rate": rate, "kills": chaos.kills, "epochs_closed": last + 1,
        "return_s_median": statistics.median(chaos.returns) if chaos.returns else None,
        "epoch_s_mean": None if elapsed is None else elapsed / (last - first),
        "tokens_per_s": tokens / elapsed if elapsed else None,
        "epochs_exact": sum(all(s["rows_averaged"] == s["rows_in_batch"] for s in e["stages"])
                            for e in report["epochs"]),
        "epochs_reported": len(report["epochs"]),
        "rows_in_batch": sum(s["rows_in_batch"] for s in stages),
        "rows_averaged": sum(s["rows_averaged"] for s in stages),
        "tasks_redone": sum(s["tasks_redone"] for s in stages),
        "rows_recomputed": sum(s["rows_recomputed"] for s in stages),
        "rows_dropped": sum(s["rows_dropped"] for s in stages),
        "microbatches_retrained": sum(again.values()),
        "workers_lost": sum(s["workers_lost"] for s in stages),
        "loss": report["loss"],
    }


def _base(cases: list[dict], policy: str, rate: float) -> float | None:
    return next((c["tokens_per_s"] for c in cases if c["policy"] == policy and c["rate"] == rate), None)


def markdown(args: argparse.Namespace, command: str, info: dict, cases: list[dict]) -> str:
    lines = [f"# Faults benchmark\n\n`{command}`\n", f"Machine: {info}\n",
             f"Recipe: {args.model}, 2 stages, {args.clients} clients per stage ({args.unreliable:.0%} unreliable), "
             f"{args.microbatches} microbatches of {args.rows} rows of {args.seq_len} tokens, {args.epochs} epochs "
             f"({args.warmup} of warm-up), --worker-lost {args.worker_lost}. 's to return': from a kill until the "
             "client started again is up (imports, p2p daemon, DHT), on this machine that all peers share.\n",
             "| policy | disconnection rate | kills | s to return (median) | s per epoch | tokens/s | vs no faults | "
             "task pool / this | epochs exact / reported | rows averaged / in batch | tasks redone | rows recomputed | "
             "rows dropped | microbatches fed again | workers lost | last loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        base, pool = _base(cases, c["policy"], 0.0), _base(cases, "taskpool", c["rate"])
        ratio = c["tokens_per_s"] / base if base and c["tokens_per_s"] else None
        versus = pool / c["tokens_per_s"] if pool and c["tokens_per_s"] else None
        lines.append(f"| {c['policy']} | {c['rate']:.2f} | {c['kills']} | {fmt(c['return_s_median'], '.1f')} | "
                     f"{fmt(c['epoch_s_mean'], '.1f')} | {fmt(c['tokens_per_s'], '.0f')} | "
                     f"{fmt(ratio)} | {fmt(versus)} | {c['epochs_exact']} / {c['epochs_reported']} | "
                     f"{c['rows_averaged']} / {c['rows_in_batch']} | {c['tasks_redone']} | {c['rows_recomputed']} | "
                     f"{c['rows_dropped']} | {c['microbatches_retrained']} | {c['workers_lost']} | "
                     f"{fmt(c['loss'], '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(cases: list[dict[str, Any]], path: Path) -> None:
    """Throughput relative to each policy's no-fault case against the disconnection rate, with each case's kills."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for policy in dict.fromkeys(c["policy"] for c in cases):
        mine = [c for c in cases if c["policy"] == policy and c["tokens_per_s"]]
        base = _base(cases, policy, 0.0)
        if not base:
            continue
        ratios = [c["tokens_per_s"] / base for c in mine]
        ax.plot([c["rate"] for c in mine], ratios, marker="o", label={"taskpool": "task pool"}.get(policy, policy))
        for case, ratio in zip(mine, ratios):
            ax.annotate(f"{case['kills']}", (case["rate"], ratio), textcoords="offset points", xytext=(4, 6))
    ax.set_xlabel("disconnection rate (labels: kills)")
    ax.set_ylabel("throughput / no-fault throughput")
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0,0.25,0.5", help="disconnection rates, comma-separated (0 included)")
    parser.add_argument("--policies", default=",".join(FAULT_POLICIES),
                        help=f"fault policies, comma-separated, of {', '.join(FAULT_POLICIES)}")
    parser.add_argument("--clients", type=int, default=2, help="clients per stage")
    parser.add_argument("--unreliable", type=float, default=1.0, help="share of the clients that may vanish")
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker-lost", type=float, default=10.0, help="the peers' --worker-lost")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one case may run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    rates = sorted({0.0, *(float(r) for r in args.rates.split(","))})
    policies = list(dict.fromkeys(args.policies.split(",")))
    if unknown := [p for p in policies if p not in FAULT_POLICIES]:
        parser.error(f"--policies: unknown policy {unknown[0]!r}; choose from {', '.join(FAULT_POLICIES)}")
    command, info = command_line(__file__, argv), machine_info()
    cases = []
    with tempfile.TemporaryDirectory(prefix="p2ptrain-faults-") as tmp:
        for rate in rates:
            for policy in policies:
                log(f"case: {policy}, disconnection rate {rate}")
                cases.append(run_case(args, policy, rate, Path(tmp) / f"{policy}-rate{rate}"))
                log(f"  {cases[-1]}")
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(args, command, info, cases)
    (args.out / "faults.md").write_text(text)
    (args.out / "faults.json").write_text(json.dumps({"command": command, "machine": info, "cases": cases}, indent=1))
    plot(cases, args.out / "faults.png")
    print(text)


if __name__ == "__main__":
    main()
