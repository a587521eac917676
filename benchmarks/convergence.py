"""Convergence benchmark: does the swarm train as one process does, on real text?

    python benchmarks/convergence.py [--quick] [--model llama-small] [--epochs 120] [--batch-rows 4]
                                     [--microbatches 4] [--seq-len 64] [--eval-every 20] [--clients 2]
                                     [--churn 0.25] [--runs one,swarm,dpu,int8,churn] [--stem convergence]

Runs, one after the other on the same cores, with the same seed, model, global batch, optimizer (AdamW, nanoGPT
weight-decay groups), learning-rate schedule (linear warm-up, cosine decay to --min-lr at the last epoch, keyed on
the epoch), global-norm clipping and number of steps, on `../shared/data/wikitext-2/valid.txt` (byte-level tokens):

- one: one process, the whole model, one step per global batch (summed loss / tokens), as
  `p2ptrain.protocol.optimization` and `StageModel.configure_optimizer` say every worker steps;
- swarm: a real 2-stage swarm (`harness.LocalSwarm`: a bootstrap peer, an FS, a BS and --clients clients per stage,
  each a `python -m p2ptrain.peer` process on 127.0.0.1) that steps before the next epoch computes (`--dpu off`);
  int8, churn and the averaging runs below do too;
- int8: the same swarm with int8 activations and gradients on the wire (`--compression int8`);
- int8-averaging, fp16-averaging (on request): the same swarm whose stages average in int8 or fp16
  (`--averaging-codec`; the other swarms without DPU average in fp32); dpu-fp32-averaging, dpu-int8-averaging,
  dpu-fp16-averaging: dpu's swarm (below) averaging so;
- churn: the same swarm whose clients are SIGKILLed and started again at disconnection rate --churn per global
  batch (`harness.Chaos`, the faults benchmark's model);
- dpu: the swarm as it ships, with delayed parameter updates (`--dpu on`, the default) and the default averaging
  codec (`--averaging-codec int8`), each worker computing the
  next epoch where a step on the mean of its stage's deposited gradients takes the stage (`--dpu-lookahead on`, DPU's
  default); dpu-lookahead (on request) is the same run under its earlier name;
- dpu-plain (on request): the same without the look-ahead (`--dpu-lookahead off`): the next epoch computes on the
  parameters before the step in flight;
- dpu-overlap (on request): dpu with no drain at the epoch boundary (`--overlap-epochs on`): the next epoch's first
  microbatches compute before the look-ahead on the stage's mean, where a step on the worker's own gradient so far
  takes the stage;
- one-late, one-late-from-N, one-predict-A (on request): one process that computes each epoch's gradient on the
  parameters from before the last step, as a worker with delayed updates does: from the start, from epoch N on, or
  with those parameters extrapolated by A times the last update (weight prediction); what staleness alone costs;
- average-every-8 (on request): the same swarm whose stages average once every 8 epochs (`--average-every 8`,
  DiLoCo: each worker steps on its own gradients between rounds, an outer SGD with Nesterov momentum at a round,
  --outer-lr and --outer-momentum, the recipe's defaults unless given); without clipping, which needs a global
  norm every epoch.

Train loss: per epoch, the mean token loss of the global batch (the swarm's status; the one process's own).
Held-out loss: the mean token loss on the first --eval-rows windows of `test.txt` (`TextSource.held_out`), after
every --eval-every steps; the swarm computes it itself, forward only through its stages' servers (`--eval-data`),
and reports it in its status as `eval_loss`. Writes benchmarks/results/convergence.md, .json and .png (train and
held-out loss against steps and against wall time), or the same in --out DIR, named --stem.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import ROOT, Chaos, LocalSwarm, command_line, fmt, log, machine_info

from p2ptrain.config import RunConfig
from p2ptrain.data import TextSource
from p2ptrain.models import build_stage
from p2ptrain.protocol.optimization import LRSchedule, clip_coefficient

RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
RUNS = ("one", "swarm", "int8", "churn", "dpu", "dpu-lookahead", "dpu-plain", "dpu-overlap", "int8-averaging",
        "fp16-averaging", "dpu-fp32-averaging", "dpu-int8-averaging", "dpu-fp16-averaging", "average-every-8")
DEFAULT_RUNS = ("one", "swarm", "dpu", "int8", "churn")
STALE_RUNS = ("one-late", "one-late-from-N", "one-predict-A")


def staleness(run: str) -> dict[str, Any] | None:
    """`one_process`'s staleness options of a one-process run named in STALE_RUNS (N an epoch, A a fraction), or
    None if `run` is none of them."""
    if run == "one-late":
        return {"stale_from": 0}
    for prefix, option in (("one-late-from-", "stale_from"), ("one-predict-", "predict")):
        value = run.removeprefix(prefix)
        if value != run:
            try:
                number = int(value) if option == "stale_from" else float(value)
            except ValueError:
                return None
            return {"stale_from": number} if option == "stale_from" else {"stale_from": 0, "predict": number}
    return None


def held_out(stages: list[torch.nn.Module], windows: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean token loss of the model (its stage modules in sequence) on the held-out windows."""
    total = tokens = 0.0
    with torch.no_grad():
        for ids, labels in windows:
            hidden = ids
            for stage in stages[:-1]:
                hidden = stage(hidden)
            total += float(stages[-1](hidden, labels))
            tokens += labels.numel()
    return total / tokens


def one_process(config: RunConfig, epochs: int, eval_every: int, windows: list, *, stale_from: int | None = None,
                predict: float = 0.0) -> dict[str, Any]:
    """One process stepping once per global batch. With `stale_from`, from that epoch on each epoch's gradient is
    computed on the parameters from before the last step, as a worker's with delayed parameter updates (the model
    takes the master's parameters one step late); `predict` > 0 then extrapolates them by that fraction of the last
    update (weight prediction) to guess the parameters the gradient will be applied to."""
    master = build_stage(config.model_config, start=0, end=config.model_config.num_layers, seed=config.seed)
    model = copy.deepcopy(master) if stale_from is not None else master
    optimizer = master.configure_optimizer(name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    schedule = LRSchedule(lr=config.lr, warmup_epochs=config.warmup_epochs, decay_epochs=config.decay_epochs,
                          min_lr=config.min_lr)
    source = TextSource(path=config.data, seq_len=config.seq_len, seed=config.seed)
    params = [p for p in master.parameters() if p.requires_grad]
    computing = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params] if predict else []  # the master before the last step
    train, evals, started = [], [], time.monotonic()
    for epoch in range(epochs):
        loss_sum = 0.0
        for index in range(config.microbatches):
            ids, labels = source.microbatch(epoch, index, config.rows_per_microbatch)
            loss = model(ids, labels)
            (loss / config.tokens_per_epoch).backward()
            loss_sum += float(loss.detach())
        stale = stale_from is not None and epoch >= stale_from
        if model is not master:
            with torch.no_grad():
                for index, (p, c) in enumerate(zip(params, computing)):
                    p.grad, c.grad = c.grad, None
                    if stale:  # the next epoch computes on the parameters from before this epoch's step
                        c.copy_(p)
                        if predict:
                            c.add_(p - before[index], alpha=predict)
                    if predict:
                        before[index].copy_(p)
        if config.clip_norm:
            norm = math.sqrt(math.fsum(p.grad.double().square().sum().item() for p in params))
            for p in params:
                p.grad.mul_(clip_coefficient(norm, config.clip_norm))
        for group in optimizer.param_groups:
            group["lr"] = schedule.at(epoch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if model is not master and not stale:
            with torch.no_grad():
                for p, c in zip(params, computing):
                    c.copy_(p)
        train.append({"epoch": epoch, "loss": loss_sum / config.tokens_per_epoch, "at_s": time.monotonic() - started})
        if (epoch + 1) % eval_every == 0:
            evals.append({"epoch": epoch + 1, "loss": held_out([master], windows), "at_s": time.monotonic() - started})
            log(f"  one process: epoch {epoch}, train loss {train[-1]['loss']:.4f}, held-out {evals[-1]['loss']:.4f}")
    return {"train": train, "evals": evals, "seconds": time.monotonic() - started}


def swarm_run(config: RunConfig, *, args: argparse.Namespace, churn: float, workdir: Path) -> dict[str, Any]:
    """A 2-stage swarm of real processes (module doc) trained for `args.epochs` epochs, its clients vanishing and
    coming back at disconnection rate `churn` (`harness.Chaos`); its train loss per epoch, its held-out loss
    (`eval_loss`, computed by the swarm itself through its stages' servers) and its row accounting, from its
    status."""
    workdir.mkdir(parents=True)
    with LocalSwarm(workdir, config, epochs=args.epochs) as swarm:
        swarm.start_bootstrap()
        for stage in range(config.num_stages):
            swarm.start_server(stage, "bs")
        swarm.start_server(1, "fs")
        clients = {f"s{stage}-client{i}": stage for stage in range(config.num_stages) for i in range(args.clients)}
        for name, stage in clients.items():
            swarm.start_client(stage, name=name)
        swarm.connect()
        swarm.wait_for_workers(len(clients), timeout=180)
        # the data source starts once every client is up, so that the first epochs have all their workers
        swarm.start_server(0, "fs", extra=["--eval-data", str(args.data_dir / "test.txt"), "--eval-every",
                                           str(args.eval_every), "--eval-rows", str(args.eval_rows)])
        chaos = Chaos(swarm=swarm, clients=clients, rate=churn, extra=[], rng=random.Random(args.seed))
        started = time.monotonic()
        deadline = started + args.timeout
        seen, last_close, report, done = -1, started, None, False
        try:
            while not done:
                failed = swarm.failed()
                if failed:
                    raise RuntimeError(f"peers {failed} exited with an error; logs in {workdir}")
                report = swarm.status()
                now = time.monotonic()
                if report["epoch"] > seen:
                    closed = report["epoch"] - seen
                    for _ in range(closed):  # a draw per global batch, however many closed since the last look
                        chaos.epoch_closed((now - last_close) / closed)
                    seen, last_close = report["epoch"], now
                    log(f"  {config.run_id}: epoch {seen} closed at {now - started:.0f} s, loss {report['loss']}, "
                        f"held-out {report['eval_loss']}, {chaos.kills} kills")
                final = [e for e in report["epochs"] if e["epoch"] == args.epochs - 1]
                done = report["finished"] and bool(final) and final[0]["eval_loss"] is not None
                if not done and now > deadline:
                    log(f"  {config.run_id}: deadline of {args.timeout:.0f} s reached at epoch {seen}")
                    break
                time.sleep(1.0)
        finally:
            chaos.stop()
        seconds = time.monotonic() - started
    epochs = [e for e in (report or {}).get("epochs", []) if e["loss"] is not None and not e["abandoned"]]
    train, evals, at = [], [], 0.0
    for e in epochs:
        at += e["seconds"] or 0.0
        train.append({"epoch": e["epoch"], "loss": e["loss"], "at_s": at})
        if e["eval_loss"] is not None:
            evals.append({"epoch": e["epoch"] + 1, "loss": e["eval_loss"], "at_s": at})
    stages = [s for e in (report or {}).get("epochs", []) for s in e["stages"]]
    return {"train": train, "evals": evals, "seconds": seconds, "finished": done, "kills": chaos.kills,
            "epochs_exact": sum(all(s["rows_averaged"] == s["rows_in_batch"] for s in e["stages"]) for e in epochs),
            "rows_recomputed": sum(s["rows_recomputed"] for s in stages),
            "rounds_failed": sum(s["rounds_failed"] for s in stages)}


def summarize(name: str, run: dict, epochs: int) -> dict[str, Any]:
    tail = [t["loss"] for t in run["train"][-5:]]
    steady = [b["at_s"] - a["at_s"] for a, b in zip(run["train"], run["train"][1:])][5:]
    final = run["evals"][-1] if run["evals"] else None
    return {"run": name, "epochs": len(run["train"]),
            "final_train_loss": statistics.mean(tail) if tail else None,
            "final_eval_loss": final["loss"] if final and final["epoch"] >= epochs else None,
            "s_per_epoch": statistics.median(steady) if steady else None,
            "kills": run.get("kills"), "epochs_exact": run.get("epochs_exact"),
            "rows_recomputed": run.get("rows_recomputed"), "rounds_failed": run.get("rounds_failed")}


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, run in runs.items():
        line, = axes[0].plot([t["epoch"] for t in run["train"]], [t["loss"] for t in run["train"]], alpha=0.45,
                             label=f"{name} train")
        for ax, x in ((axes[0], "epoch"), (axes[1], "at_s")):
            ax.plot([e[x] for e in run["evals"]], [e["loss"] for e in run["evals"]], "o-", color=line.get_color(),
                    label=f"{name} held-out")
        axes[1].plot([t["at_s"] for t in run["train"]], [t["loss"] for t in run["train"]], alpha=0.45,
                     color=line.get_color())
    axes[0].set(xlabel="epoch (global batch = step)", ylabel="mean token loss (nats)", title="loss against steps")
    axes[1].set(xlabel="seconds", title="loss against wall time")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(command: str, info: dict, config: RunConfig, args: argparse.Namespace, rows: list[dict]) -> str:
    reference = next((r for r in rows if r["run"] == "one"), None)
    lines = [f"# Convergence: the swarm against one process, on real text\n\nCommand: `{command}`\n",
             f"Date: {info['date']}; machine: nproc {info['nproc']}, {info['cpu']}, Python {info['python']}, torch "
             f"{info['torch']}, hivemind {info['hivemind']}; commit {info.get('commit', '?')}; every process 1 torch "
             f"thread; load average at start {info['load_start']}.\n",
             f"Model {config.model}, {config.num_stages} stages, global batch {config.rows_per_epoch} rows x "
             f"{config.seq_len} tokens ({config.microbatches} microbatches), {args.epochs} epochs (steps), AdamW lr "
             f"{config.lr} (warm-up {config.warmup_epochs}, cosine to {config.min_lr} at {config.decay_epochs}), "
             f"weight decay {config.weight_decay}, clip {config.clip_norm}, seed {config.seed}; train on "
             f"`wikitext-2/valid.txt`, held-out on the first {args.eval_rows} windows of `wikitext-2/test.txt`. "
             f"Swarms: {args.clients} clients per stage; churn at disconnection rate {args.churn} per global batch.\n",
             "| run | epochs | final train loss (mean of last 5) | final held-out loss | held-out / one process | "
             "s per epoch (median) | kills | epochs with every row averaged | rows recomputed | rounds failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = (row["final_eval_loss"] / reference["final_eval_loss"]
                 if reference and reference["final_eval_loss"] and row["final_eval_loss"] else None)
        lines.append(f"| {row['run']} | {row['epochs']} | {fmt(row['final_train_loss'], '.4f')} | "
                     f"{fmt(row['final_eval_loss'], '.4f')} | {fmt(ratio, '.4f')} | {fmt(row['s_per_epoch'])} | "
                     f"{_count(row['kills'])} | {_count(row['epochs_exact'])} | {_count(row['rows_recomputed'])} | "
                     f"{_count(row['rounds_failed'])} |")
    lines.append(f"\nPlot: `{args.stem}.png`. Runs: one = one process; one-late = one process whose every gradient is "
                 "computed on the parameters from before the last step (the staleness of delayed parameter updates); "
                 "one-late-from-N = the same from epoch N on; one-predict-A = one-late whose parameters are "
                 "extrapolated by A times the last update (weight prediction); swarm = the swarm stepping before the next epoch (--dpu off, averaging in "
                 "fp32; int8, churn and the averaging runs too); int8 = the swarm with int8 activations and gradients; "
                 "churn = the swarm with clients SIGKILLed and restarted; dpu, dpu-lookahead = the swarm as it ships, "
                 f"with delayed parameter updates and {RunConfig.averaging_codec} averaging, each worker computing the "
                 "next epoch where a step on the mean of its stage's deposited gradients takes the stage; dpu-plain = "
                 "the same without that look-ahead, on the parameters before the step in flight; dpu-overlap = dpu "
                 "with no drain at the epoch boundary (--overlap-epochs on); int8-averaging, fp16-averaging = the "
                 "swarm whose stages average in int8 or fp16, dpu-fp32-averaging, dpu-int8-averaging, "
                 "dpu-fp16-averaging the dpu swarm so (dpu-plain and dpu-overlap average as dpu does); average-every-8 = the swarm whose stages average once every 8 "
                 f"epochs (DiLoCo, outer lr {args.outer_lr:g}, Nesterov momentum {args.outer_momentum:g}), "
                 "unclipped.")
    return "\n".join(lines) + "\n"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run: llama-tiny, 20 epochs")
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--batch-rows", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-epochs", type=int, default=10)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--outer-lr", type=float, default=RunConfig.outer_lr,
                        help="the average-every-8 run's outer learning rate")
    parser.add_argument("--outer-momentum", type=float, default=RunConfig.outer_momentum,
                        help="the average-every-8 run's outer Nesterov momentum (0: plain parameter averaging with "
                             "--outer-lr 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-rows", type=int, default=64)
    parser.add_argument("--clients", type=int, default=2, help="clients per stage in the swarms")
    parser.add_argument("--churn", type=float, default=0.25, help="the churn run's disconnection rate")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"which of {','.join(RUNS)}")
    parser.add_argument("--data-dir", type=Path, default=DATA, help="holds valid.txt (train) and test.txt (held out)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per swarm run at most")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--stem", default="convergence", help="the results' file names: STEM.md, .json, .png")
    parser.add_argument("--workdir", type=Path, help="keep the peers' logs here (default: a temporary folder, "
                                                     "removed at the end)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.model, args.epochs, args.eval_every = "llama-tiny", 20, 10
    if args.epochs % args.eval_every:
        raise SystemExit("--epochs must be a multiple of --eval-every (the last held-out loss is of the last epoch)")
    runs = [r for r in args.runs.split(",") if r]
    unknown = {r for r in runs if r not in RUNS and staleness(r) is None}
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}, "
                         f"{', '.join(STALE_RUNS)}")
    command = command_line(__file__, argv)
    torch.set_num_threads(1)
    base = RunConfig(run_id="convergence", model=args.model, num_stages=2, rows_per_microbatch=args.batch_rows,
                     microbatches=args.microbatches, seq_len=args.seq_len, seed=args.seed, lr=args.lr,
                     warmup_epochs=args.warmup_epochs, decay_epochs=args.epochs, min_lr=args.min_lr,
                     clip_norm=args.clip_norm, data=str(args.data_dir / "valid.txt"))
    # the windows the swarm's data source evaluates on (`--eval-data`), built the way it builds them
    windows = TextSource(path=str(args.data_dir / "test.txt"), seq_len=args.seq_len, seed=args.seed).held_out(
        rows=args.eval_rows, per_call=args.batch_rows)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        tmp = args.workdir or tmp
        for name in runs:
            log(f"run {name}")
            if name == "one" or staleness(name) is not None:
                results[name] = one_process(base, args.epochs, args.eval_every, windows, **(staleness(name) or {}))
                continue
            config = RunConfig(**{**vars(base), "run_id": f"convergence-{name}",
                                  "dpu": name.startswith("dpu"), "dpu_lookahead": name != "dpu-plain",
                                  "overlap_epochs": name == "dpu-overlap",
                                  "compression": "int8" if name == "int8" else "none",
                                  # the DPU runs average as the swarm ships, the runs without DPU as they always did
                                  "averaging_codec": name.removeprefix("dpu-").removesuffix("-averaging")
                                  if name.endswith("-averaging") else
                                  RunConfig.averaging_codec if name.startswith("dpu") else "fp32",
                                  **({"average_every": 8, "clip_norm": 0.0, "outer_lr": args.outer_lr,
                                      "outer_momentum": args.outer_momentum} if name == "average-every-8" else {})})
            results[name] = swarm_run(config, args=args, churn=args.churn if name == "churn" else 0.0,
                                      workdir=Path(tmp) / name)
    rows = [summarize(name, run, args.epochs) for name, run in results.items()]
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(command, info, base, args, rows)
    (args.out / f"{args.stem}.md").write_text(text)
    (args.out / f"{args.stem}.json").write_text(json.dumps(
        {"command": command, "machine": info, "config": dict(vars(base)), "summary": rows, "runs": results},
        indent=1))
    plot(results, args.out / f"{args.stem}.png")
    print(text)


if __name__ == "__main__":
    main()
