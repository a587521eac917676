"""Convergence benchmark: does the swarm train as one process does, on real text?

    python benchmarks/convergence.py [--quick] [--model llama-small] [--epochs 160] [--batch-rows 4]
                                     [--microbatches 4] [--seq-len 64] [--eval-every 20] [--runs one,dpu,nodpu,int8]

Four runs, one after the other on the same cores, with the same seed, model, global batch, optimizer (AdamW,
nanoGPT weight-decay groups), learning-rate schedule (linear warm-up, cosine decay to --min-lr keyed on the
epoch) and global-norm clipping, on `../shared/data/wikitext-2/valid.txt` (byte-level tokens):

- one: one process, the whole model, one step per global batch (summed loss / tokens), as `p2ptrain.protocol.
  optimization` and `StageModel.configure_optimizer` say every worker steps;
- dpu, nodpu, int8: a real 2-stage swarm (`harness.LocalSwarm`: a bootstrap peer, an FS, a BS and a client per
  stage, each a `python -m p2ptrain.peer` process on 127.0.0.1) with delayed parameter updates on, off, and on
  with int8 activations and gradients on the wire.

Train loss: per epoch, the last stage's mean token loss (the swarm's status; the one process's own). Held-out loss:
the mean token loss on fixed windows of `test.txt`, every --eval-every epochs, of the parameters after that many
steps. For the swarm it is computed here from the stage servers' checkpoints (`--checkpoint-dir`, saved every
--eval-every epochs by the servers that hold each stage's state): the stages' modules are loaded from them and run
in sequence, so the figure is of the swarm's own parameters. Writes benchmarks/results/convergence.md, .json and
.png (train and held-out loss against epochs and against wall time), or the same in --out DIR.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import ROOT, LocalSwarm, command_line, fmt, log, machine_info, peer_name

from p2ptrain.config import RunConfig
from p2ptrain.data import TextSource
from p2ptrain.models import build_stage
from p2ptrain.protocol.optimization import LRSchedule, clip_coefficient
from p2ptrain.state.checkpoint import MANIFEST
from p2ptrain.state.codec import decode_state

RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
RUNS = ("one", "dpu", "nodpu", "int8")


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


def one_process(config: RunConfig, epochs: int, eval_every: int, windows: list) -> dict[str, Any]:
    model = build_stage(config.model_config, start=0, end=config.model_config.num_layers, seed=config.seed)
    optimizer = model.configure_optimizer(name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    schedule = LRSchedule(lr=config.lr, warmup_epochs=config.warmup_epochs, decay_epochs=config.decay_epochs,
                          min_lr=config.min_lr)
    source = TextSource(path=config.data, seq_len=config.seq_len, seed=config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    train, evals, started = [], [], time.monotonic()
    for epoch in range(epochs):
        loss_sum = 0.0
        for index in range(config.microbatches):
            ids, labels = source.microbatch(epoch, index, config.rows_per_microbatch)
            loss = model(ids, labels)
            (loss / config.tokens_per_epoch).backward()
            loss_sum += float(loss.detach())
        if config.clip_norm:
            norm = math.sqrt(math.fsum(p.grad.double().square().sum().item() for p in params))
            for p in params:
                p.grad.mul_(clip_coefficient(norm, config.clip_norm))
        for group in optimizer.param_groups:
            group["lr"] = schedule.at(epoch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train.append({"epoch": epoch, "loss": loss_sum / config.tokens_per_epoch, "at_s": time.monotonic() - started})
        if (epoch + 1) % eval_every == 0:
            evals.append({"epoch": epoch + 1, "loss": held_out([model], windows), "at_s": time.monotonic() - started})
            log(f"  one process: epoch {epoch}, train loss {train[-1]['loss']:.4f}, held-out {evals[-1]['loss']:.4f}")
    return {"train": train, "evals": evals, "seconds": time.monotonic() - started}


def read_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict] | None:
    """The epoch and model state of a server's newest checkpoint, or None if there is none yet or it was being
    replaced while read (the next poll reads the new one)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        blob = torch.frombuffer(bytearray((folder / manifest["tensors"]).read_bytes()), dtype=torch.uint8)
    except (OSError, ValueError, KeyError):
        return None
    model_state, _ = decode_state(blob, model, optimizer)
    return manifest["epoch"], model_state


def swarm_run(config: RunConfig, epochs: int, eval_every: int, windows: list, workdir: Path,
              timeout_s: float) -> dict[str, Any]:
    stages = [build_stage(config.model_config, start=start, end=end, seed=config.seed)
              for start, end in (config.stage_layers(k) for k in range(config.num_stages))]
    optimizers = [s.configure_optimizer(name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
                  for s in stages]
    folders = [workdir / "ckpt" / f"stage{k}" for k in range(config.num_stages)]
    workdir.mkdir(parents=True)
    evals: list[dict] = []
    with LocalSwarm(workdir, config, epochs=epochs) as swarm:
        swarm.start_bootstrap()
        for k in range(config.num_stages):
            swarm._start(peer_name(k, "fs"), "server", ["--stage", str(k), "--server-role", "fs", "--checkpoint-dir",
                                                        str(folders[k]), "--checkpoint-every", str(eval_every)])
            swarm.start_server(k, "bs")
            swarm.start_client(k)
        swarm.connect()
        started = time.monotonic()
        deadline = started + timeout_s
        report, done = None, False
        while time.monotonic() < deadline and not done:
            failed = swarm.failed()
            if failed:
                raise RuntimeError(f"peers {failed} exited with an error; logs in {workdir}")
            read = [read_checkpoint(folder, stage, optimizer)
                    for folder, stage, optimizer in zip(folders, stages, optimizers)]
            if all(r is not None for r in read) and len({r[0] for r in read}) == 1:
                epoch = read[0][0]
                if epoch and (not evals or evals[-1]["epoch"] < epoch):
                    for stage, (_, state) in zip(stages, read):
                        stage.load_state_dict(state)
                    evals.append({"epoch": epoch, "loss": held_out(stages, windows),
                                  "at_s": time.monotonic() - started})
                    log(f"  swarm: held-out loss after {epoch} epochs {evals[-1]['loss']:.4f}")
            report = swarm.status()
            done = report["finished"] and report["epoch"] + 1 >= epochs and evals and evals[-1]["epoch"] >= epochs
            time.sleep(1.0)
        seconds = time.monotonic() - started
    epochs_seen = [e for e in (report or {}).get("epochs", []) if e["loss"] is not None and not e["abandoned"]]
    at, train = 0.0, []
    for e in epochs_seen:
        at += e["seconds"] or 0.0
        train.append({"epoch": e["epoch"], "loss": e["loss"], "at_s": at})
    return {"train": train, "evals": evals, "seconds": seconds, "finished": done}


def summarize(name: str, run: dict, epochs: int) -> dict[str, Any]:
    tail = [t["loss"] for t in run["train"][-5:]]
    steady = [b["at_s"] - a["at_s"] for a, b in zip(run["train"], run["train"][1:])][5:]
    final = run["evals"][-1] if run["evals"] else None
    return {"run": name, "epochs": len(run["train"]),
            "final_train_loss": statistics.mean(tail) if tail else None,
            "final_eval_loss": final["loss"] if final and final["epoch"] >= epochs else None,
            "s_per_epoch": statistics.median(steady) if steady else None}


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
    lines = [f"# Convergence: swarm against one process\n\nCommand: `{command}`\n",
             f"Date: {info['date']}; machine: nproc {info['nproc']}, {info['cpu']}, Python {info['python']}, torch "
             f"{info['torch']}, hivemind {info['hivemind']}; commit {info.get('commit', '?')}; every process 1 torch "
             f"thread; load average at start {info['load_start']}.\n",
             f"Model {config.model}, {config.num_stages} stages, global batch {config.rows_per_epoch} rows x "
             f"{config.seq_len} tokens ({config.microbatches} microbatches), {args.epochs} epochs (steps), AdamW lr "
             f"{config.lr} (warm-up {config.warmup_epochs}, cosine to {config.min_lr} at {config.decay_epochs}), "
             f"weight decay {config.weight_decay}, clip {config.clip_norm}, seed {config.seed}; train on "
             f"`wikitext-2/valid.txt`, held-out on {args.eval_windows} fixed windows of `wikitext-2/test.txt`.\n",
             "| run | epochs | final train loss (mean of last 5) | final held-out loss | held-out / one process | "
             "s per epoch (median) |", "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = (row["final_eval_loss"] / reference["final_eval_loss"]
                 if reference and reference["final_eval_loss"] and row["final_eval_loss"] else None)
        lines.append(f"| {row['run']} | {row['epochs']} | {fmt(row['final_train_loss'], '.4f')} | "
                     f"{fmt(row['final_eval_loss'], '.4f')} | {fmt(ratio, '.4f')} | {fmt(row['s_per_epoch'])} |")
    lines.append("\nPlot: `convergence.png`. Runs: one = one process; dpu / nodpu = the swarm with delayed parameter "
                 "updates on / off; int8 = the swarm with DPU and int8 activations and gradients.")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run: llama-tiny, 20 epochs")
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--epochs", type=int, default=160)
    parser.add_argument("--batch-rows", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-epochs", type=int, default=10)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--runs", default=",".join(RUNS), help="which of one,dpu,nodpu,int8")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per swarm run at most")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, help="keep the peers' logs and checkpoints here (default: a "
                                                     "temporary folder, removed at the end)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.model, args.epochs, args.eval_every = "llama-tiny", 20, 10
    if args.epochs % args.eval_every:
        raise SystemExit("--epochs must be a multiple of --eval-every (the last held-out loss is of the last epoch)")
    runs = [r for r in args.runs.split(",") if r]
    unknown = set(runs) - set(RUNS)
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
    command = command_line(__file__, argv)
    torch.set_num_threads(1)
    base = RunConfig(run_id="convergence", model=args.model, num_stages=2, rows_per_microbatch=args.batch_rows,
                     microbatches=args.microbatches, seq_len=args.seq_len, seed=args.seed, lr=args.lr,
                     warmup_epochs=args.warmup_epochs, decay_epochs=args.epochs, min_lr=args.min_lr,
                     clip_norm=args.clip_norm, data=str(DATA / "valid.txt"))
    held = TextSource(path=str(DATA / "test.txt"), seq_len=args.seq_len, seed=args.seed + 1)
    windows = [held.microbatch(0, i, 8) for i in range(math.ceil(args.eval_windows / 8))]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        tmp = args.workdir or tmp
        for name in runs:
            log(f"run {name}")
            if name == "one":
                results[name] = one_process(base, args.epochs, args.eval_every, windows)
                continue
            config = RunConfig(**{**vars(base), "run_id": f"convergence-{name}", "dpu": name != "nodpu",
                                  "compression": "int8" if name == "int8" else "none"})
            results[name] = swarm_run(config, args.epochs, args.eval_every, windows, Path(tmp) / name, args.timeout)
    rows = [summarize(name, run, args.epochs) for name, run in results.items()]
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(command, info, base, args, rows)
    (args.out / "convergence.md").write_text(text)
    (args.out / "convergence.json").write_text(json.dumps(
        {"command": command, "machine": info, "config": {k: v for k, v in vars(base).items()}, "summary": rows,
         "runs": results}, indent=1))
    plot(results, args.out / "convergence.png")
    print(text)


if __name__ == "__main__":
    main()
