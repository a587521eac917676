"""Slow links: how fast the swarm trains when every peer's uplink is capped, and what it sends.

    python benchmarks/wan.py [--quick] [--caps none,100,40,20,10,5] [--duration-s 240] [--variants fp32,int8]
                             [--model llama-small] [--clients 2] [--delay-ms 0] [--out benchmarks/results]

For each cap (Mbit/s; `none`: no namespace, no cap) and each variant (how the stages average: `fp32`, `fp16`,
`int8`, the recipe's `--averaging-codec`; `h8`, `int8-h8`: once every 8 epochs, `--average-every 8`, in fp32 or
int8; `overlap`: fp32 with no drain at the epoch boundary, `--overlap-epochs on`; `behind-on`: fp32 with each worker
taking its next task while its last result is on its way, `--push-behind on`), one run of the README's hand-started
swarm shape: 2 stages, an FS and a BS (with --keep-state) per stage, --clients clients per stage, on
`../shared/data/wikitext-2/valid.txt`. A capped run goes on in a network namespace of its own
(`python -m p2ptrain.links`), where every peer listens on its own loopback address with its own egress cap, as on
the internet; the status reader sits uncapped on 127.0.0.1. Each run trains for --duration-s seconds after its data
source starts (or until --epochs closed), and reports:

- epochs per minute, over the epochs that closed after the first (the first pays for the start);
- the longest wait between two epochs closing (a stall), and how long the first took;
- bytes per epoch by kind, from the peers' own counters (`p2ptrain.traffic`: activations, averaging, state, probes,
  control; message bytes) and on the wire (the links' counter per address: everything, headers and the DHT
  included; `other` is the wire's total less the messages');
- the bound the bytes allow: the cap over the busiest uplink's wire bytes per epoch, in epochs per minute, and
  the least of that and the uncapped run's rate (when it ran): what the swarm would reach if only the busiest link
  and the compute limited it;
- averaging bytes per epoch counted by epoch (`averaging_bytes` of the status: what every peer sent for the epoch's
  deposits and all-reduce, whenever it was sent), over the epochs that closed before the last one seen closed (with
  --average-every H, over whole intervals of H epochs only), and each variant's over fp32's at the same cap, where
  both ran;
- rows lost (rows of closed epochs not in their stage's averaged step), epochs not fully averaged, epochs
  abandoned, and the "gone" verdicts in the servers' logs (a worker judged gone).

Writes wan.md, wan.json and wan.png (epochs per minute against the cap, with the bound) under --out.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import ROOT, LocalSwarm, command_line, exit_on_sigterm, fmt, log, machine_info

from p2ptrain import links
from p2ptrain.config import RunConfig, RuntimeConfig

RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
CAPS = ("none", "100", "40", "20", "10", "5")


@dataclass(frozen=True)
class Variant:
    """How a variant's run differs from the base run."""

    recipe: dict[str, Any] = field(default_factory=dict)  # RunConfig fields that differ from the base recipe
    flags: tuple[str, ...] = ()  # the peers' flags that differ from their defaults


FP32 = {"averaging_codec": "fp32"}
VARIANTS: dict[str, Variant] = {"fp32": Variant(FP32), "fp16": Variant({"averaging_codec": "fp16"}),
                                "int8": Variant({"averaging_codec": "int8"}), "h8": Variant({**FP32, "average_every": 8}),
                                "int8-h8": Variant({"averaging_codec": "int8", "average_every": 8}),
                                "overlap": Variant({**FP32, "overlap_epochs": True}),
                                "behind-on": Variant(FP32, flags=("--push-behind", "on"))}
POLL_S = 2.0
# how a server's log says it judged a worker gone (p2ptrain/server/base.py, frontal.py)
GONE = re.compile(r"gone \(silent for|; gone$|gone with the parameter gradients", re.MULTILINE)


def run_inside(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process (inside the namespace when capped): the swarm, its epochs and bytes."""
    config = RunConfig(run_id=f"wan-{args.variant}-{args.cap}", model=args.model, num_stages=2,
                       rows_per_microbatch=args.batch_rows, microbatches=args.microbatches, seq_len=args.seq_len,
                       seed=args.seed, data=str(args.data), **VARIANTS[args.variant].recipe)
    workdir = Path(args.workdir)
    with LocalSwarm(workdir, config, epochs=args.epochs, node_flags=list(VARIANTS[args.variant].flags)) as swarm:
        swarm.start_bootstrap()
        for stage in range(config.num_stages):
            swarm.start_server(stage, "bs", extra=["--keep-state"])
        swarm.start_server(1, "fs")
        clients = [swarm.start_client(stage, name=f"s{stage}-client{i}")
                   for stage in range(config.num_stages) for i in range(args.clients)]
        swarm.connect()
        swarm.wait_for_workers(len(clients), timeout=args.start_timeout_s)
        swarm.start_server(0, "fs")  # the data source, once every client is up
        started = time.monotonic()
        closes: list[tuple[int, float]] = []  # (epoch, seconds since the source started) as each was seen closed
        first: dict[str, Any] | None = None  # bytes when the first epoch was seen closed...
        last: dict[str, Any] = {"app": {}, "wire": {}}  # ...and the last: what a round still running sent is no epoch's
        report: dict[str, Any] = {}
        while time.monotonic() - started < args.duration_s:
            failed = swarm.failed()
            if failed:
                raise RuntimeError(f"peers {failed} exited with an error; logs in {workdir}")
            try:
                report = swarm.status()
            except Exception as e:  # a slow DHT read on a slow link: read again
                log(f"  status read failed: {e!r}")
                continue
            now = time.monotonic() - started
            if report["epoch"] >= 0 and (not closes or report["epoch"] > closes[-1][0]):
                closes.append((report["epoch"], now))
                log(f"  {config.run_id}: epoch {report['epoch']} closed at {now:.0f} s")
                last = {"app": report["bytes_sent"], "wire": swarm.wire_bytes()}
                first = first or last
            if report["finished"]:
                break
            time.sleep(POLL_S)
        time.sleep(RuntimeConfig().metrics_period_s + POLL_S)  # the peers publish the bytes of the last rounds
        report = swarm.status()
        gone = sum(len(GONE.findall(swarm.log_path(name).read_text(errors="replace"))) for name in swarm.roles)
    return measure(closes=closes, first=first, last=last, report=report, gone=gone, clients=clients,
                   average_every=config.average_every)


def measure(*, closes: list[tuple[int, float]], first: dict | None, last: dict, report: dict, gone: int,
            clients: list[str], average_every: int = 1) -> dict[str, Any]:
    """A run's figures (module doc) from the closes seen and the byte counters at the first and the last close."""
    epochs = [e for e in report.get("epochs", []) if e["loss"] is not None and not e["abandoned"]]
    stages = [s for e in epochs for s in e["stages"]]
    result: dict[str, Any] = {
        "epochs_closed": len(closes) and closes[-1][0] + 1,
        "first_epoch_s": closes[0][1] if closes else None,
        "longest_wait_s": max((b - a for (_, a), (_, b) in zip(closes, closes[1:])), default=None),
        "rows_lost": sum(s["rows_in_batch"] - s["rows_averaged"] for s in stages),
        "epochs_not_fully_averaged": sum(any(s["rows_averaged"] != s["rows_in_batch"] for s in e["stages"])
                                         for e in epochs),
        "epochs_abandoned": sum(e["abandoned"] for e in report.get("epochs", [])),
        "workers_lost": sum(s["workers_lost"] for s in stages), "gone_verdicts": gone, "clients": len(clients),
        "epochs_per_min": None, "bytes_per_epoch": None, "wire_bytes_per_epoch": None, "busiest_uplink": None,
        "averaging_bytes_per_epoch": None,
    }
    # an epoch's round has ended everywhere once the next epoch closed (without --dpu a worker steps before it works on)
    # with --average-every H: whole intervals only, each with its one round
    whole = closes[-1][0] // average_every * average_every if closes else 0
    settled = [sum(s["averaging_bytes"] for s in e["stages"]) for e in epochs if e["epoch"] < whole]
    if settled:
        result["averaging_bytes_per_epoch"] = statistics.mean(settled)
    if first is None or len(closes) < 2:
        return result
    span = closes[-1][0] - closes[0][0]
    result["epochs_per_min"] = 60.0 * span / (closes[-1][1] - closes[0][1])
    app = {kind: (last["app"].get(kind, 0) - first["app"].get(kind, 0)) / span for kind in last["app"]}
    wire = {peer: (last["wire"].get(peer, 0) - first["wire"].get(peer, 0)) / span for peer in last["wire"]}
    if wire:
        app["other"] = max(0.0, sum(wire.values()) - sum(app.values()))
        result["busiest_uplink"] = max(wire, key=wire.get)
    result["bytes_per_epoch"] = app
    result["wire_bytes_per_epoch"] = wire
    return result


def one_run(args: argparse.Namespace, variant: str, cap: str, workdir: Path) -> dict[str, Any]:
    """A run in a child process: behind links of `cap` Mbit/s in a namespace of its own, or uncapped."""
    out = workdir / "result.json"
    inner = [sys.executable, str(Path(__file__).resolve()), "--inner", "--variant", variant, "--cap", cap,
             "--workdir", str(workdir), "--result", str(out), *args.passed]
    command = inner if cap == "none" else links.command(
        links.Links(uplink_mbit=float(cap), delay_ms=args.delay_ms), inner)
    timeout = args.duration_s + args.start_timeout_s + 120
    with subprocess.Popen(command) as run:
        try:
            returncode = run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout:.0f} s; logs in {workdir}"}
        finally:
            if run.poll() is None:  # timed out, or this benchmark was stopped: the run stops its peers first
                run.terminate()
                run.wait(timeout=60)
    if returncode != 0 or not out.exists():
        return {"error": f"exited with {returncode}; logs in {workdir}"}
    return json.loads(out.read_text())


def bound(result: dict[str, Any], cap: str, uncapped: float | None) -> None:
    """Adds the bound the bytes allow (module doc) and the run's share of it."""
    wire = result.get("wire_bytes_per_epoch")
    if cap == "none" or not wire:
        result["bytes_bound_per_min"] = None
        result["bound_per_min"] = uncapped if cap == "none" else None
    else:
        result["bytes_bound_per_min"] = 60.0 * float(cap) * 1e6 / 8 / max(wire.values())
        result["bound_per_min"] = min(result["bytes_bound_per_min"], uncapped or float("inf"))
    reached = result.get("epochs_per_min")
    result["share_of_bound"] = reached / result["bound_per_min"] if reached and result["bound_per_min"] else None


def against_fp32(results: list[dict[str, Any]]) -> None:
    """Adds each run's averaging bytes per epoch (counted by epoch) over the fp32 run's at the same cap, where both
    measured some."""
    fp32 = {r["cap"]: r["averaging_bytes_per_epoch"] for r in results
            if r["variant"] == "fp32" and r.get("averaging_bytes_per_epoch")}
    for r in results:
        mine = r.get("averaging_bytes_per_epoch")
        r["averaging_of_fp32"] = mine / fp32[r["cap"]] if mine and r["cap"] in fp32 else None


def markdown(command: str, info: dict, args: argparse.Namespace, results: list[dict]) -> str:
    kinds = ("activations", "averaging", "state", "probes", "control", "other")
    lines = [
        "# Slow links: the swarm behind capped uplinks", "",
        f"`{command}`", "",
        f"{info['date']}, {info['nproc']} cores ({info['cpu']}), commit {info.get('commit', '?')}. "
        f"{args.model}, 2 stages, an FS and a BS (--keep-state) and {args.clients} clients per stage, "
        f"{args.batch_rows} rows x {args.microbatches} microbatches x {args.seq_len} tokens per global batch; "
        f"{args.duration_s:.0f} s per run after the data source starts; every peer's uplink capped alike"
        + (f", {args.delay_ms:g} ms added per packet" if args.delay_ms else "") + ".", "",
        "| variant | cap Mbit/s | epochs | epochs/min | bound/min | reached | first epoch s | longest wait s "
        "| rows lost | not fully averaged | gone | MB/epoch | " + " | ".join(kinds) + " | averaging MB/epoch by epoch "
        "| averaging / fp32 | busiest uplink MB/epoch |",
        "|---" * (15 + len(kinds)) + "|",
    ]
    for r in results:
        per = r.get("bytes_per_epoch") or {}
        wire = r.get("wire_bytes_per_epoch") or {}
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['cap']} | {r['error']} |" + " |" * (12 + len(kinds)))
            continue
        lines.append(
            f"| {r['variant']} | {r['cap']} | {r['epochs_closed']} | {fmt(r['epochs_per_min'])} "
            f"| {fmt(r['bound_per_min'])} | {fmt(r['share_of_bound'], '.0%')} | {fmt(r['first_epoch_s'], '.0f')} "
            f"| {fmt(r['longest_wait_s'], '.0f')} | {r['rows_lost']} | {r['epochs_not_fully_averaged']} "
            f"| {r['gone_verdicts']} | {fmt(sum(per.values()) / 1e6 if per else None)} | "
            + " | ".join(fmt(per[k] / 1e6 if k in per else None) for k in kinds)
            + f" | {fmt(r['averaging_bytes_per_epoch'] / 1e6 if r.get('averaging_bytes_per_epoch') else None)}"
            + f" | {fmt(r.get('averaging_of_fp32'), '.3f')} | {fmt(max(wire.values()) / 1e6 if wire else None)} |")
    lines += ["", "MB/epoch and the kinds: messages' bytes by kind from the peers' counters, `other` the wire's "
              "bytes (all uplinks, headers and the DHT included) less the messages'; uncapped runs have no wire "
              "counter. bound/min: the cap over the busiest uplink's wire bytes per epoch, at most the uncapped "
              "run's rate; reached: epochs/min over the bound. The kinds' bytes are read between the first and the "
              "last epoch seen closed, so a round running at either end counts in part; averaging MB/epoch by "
              "epoch: what the peers sent for each epoch's averaging, whenever they sent it, over the epochs closed "
              "before the last; averaging / fp32: that, over the fp32 run's at the same cap."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in results):
        rows = [r for r in results if r["variant"] == variant and r["cap"] != "none" and r.get("epochs_per_min")]
        caps = [float(r["cap"]) for r in rows]
        ax.plot(caps, [r["epochs_per_min"] for r in rows], "o-", label=f"{variant}: reached")
        ax.plot(caps, [r["bound_per_min"] for r in rows], "x--", label=f"{variant}: bound")
    ax.set_xscale("log")
    caps = sorted({float(r["cap"]) for r in results if r["cap"] != "none"})
    ax.set_xticks(caps, [f"{cap:g}" for cap in caps])
    ax.minorticks_off()
    ax.set_xlabel("uplink cap per peer, Mbit/s")
    ax.set_ylabel("epochs per minute")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run: llama-tiny, caps none and 20, 60 s each")
    parser.add_argument("--caps", default=",".join(CAPS), help="Mbit/s per uplink; none: uncapped")
    parser.add_argument("--variants", default="fp32,int8", help=f"which of {','.join(VARIANTS)}")
    parser.add_argument("--duration-s", type=float, default=240.0, help="training seconds per run")
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="for the clients to come up")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every packet behind a cap")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep the peers' logs here (default: a temporary folder)")
    recipe = parser.add_argument_group("the recipe (passed on to each run)")
    recipe.add_argument("--model", default="llama-small")
    recipe.add_argument("--clients", type=int, default=2, help="clients per stage")
    recipe.add_argument("--epochs", type=int, default=1000, help="at most this many epochs per run")
    recipe.add_argument("--batch-rows", type=int, default=4)
    recipe.add_argument("--microbatches", type=int, default=4)
    recipe.add_argument("--seq-len", type=int, default=64)
    recipe.add_argument("--seed", type=int, default=0)
    recipe.add_argument("--data", type=Path, default=DATA)
    inner = parser.add_argument_group("one run (how the benchmark starts its own runs)")
    inner.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    inner.add_argument("--variant", help=argparse.SUPPRESS)
    inner.add_argument("--cap", help=argparse.SUPPRESS)
    inner.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


RECIPE_ARGS = ("model", "clients", "epochs", "batch_rows", "microbatches", "seq_len", "seed", "data", "duration_s",
               "start_timeout_s")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    if args.inner:
        result = run_inside(args)
        args.result.write_text(json.dumps(result))
        return
    if args.quick:
        args.model, args.caps, args.duration_s = "llama-tiny", "none,20", 60.0
    caps = [c.strip() for c in args.caps.split(",") if c.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    for cap in caps:
        if cap != "none" and not float(cap) > 0:
            raise SystemExit(f"--caps: {cap} is not a positive number of Mbit/s (or none)")
    if any(cap != "none" for cap in caps) and (reason := links.unavailable()):
        print(f"benchmarks/wan.py: {reason}; nothing measured", file=sys.stderr)
        return
    args.passed = [item for name in RECIPE_ARGS
                   for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    command = command_line(__file__, argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="wan-") as tmp:
        root = args.workdir or Path(tmp)
        for variant in variants:
            uncapped = None
            for cap in sorted(caps, key=lambda c: -float("inf") if c == "none" else -float(c)):
                log(f"run {variant}, cap {cap}")
                workdir = root / f"{variant}-{cap}"
                workdir.mkdir(parents=True, exist_ok=True)
                result = {"variant": variant, "cap": cap, **one_run(args, variant, cap, workdir)}
                if cap == "none":
                    uncapped = result.get("epochs_per_min")
                if "error" not in result:
                    bound(result, cap, uncapped)
                log(f"  {json.dumps({k: v for k, v in result.items() if 'bytes' not in k})}")
                results.append(result)
    against_fp32(results)
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(command, info, args, results)
    (args.out / "wan.md").write_text(text)
    (args.out / "wan.json").write_text(json.dumps({"command": command, "machine": info, "results": results},
                                                  indent=1))
    plot(results, args.out / "wan.png")
    print(text)


if __name__ == "__main__":
    main()
