"""GPU benchmark: one stage's training speed and model FLOP utilization at each precision, and a local 2-stage swarm
on one device against one process on the same device.

    python benchmarks/gpu.py [--device cuda|cuda:N|cpu] [--quick] [--model llama-small] [--batch-rows 8]
                             [--microbatches 4] [--seq-len 128] [--epochs 8] [--warmup 2] [--out DIR]

On a machine where torch sees no CUDA device it says so and exits 0, writing nothing (`--device cpu` runs the same
measurements on the host, for development).

1. One stage, the whole model (`build_stage` of all its layers), as a worker holds it (`client.device.place`: its
   weights in the precision, autocast, an fp32 master copy stepped by AdamW), at fp32, bf16 and fp16 (the loss
   unscaled: speed only): the median time of a
   microbatch's forward and backward over `--reps`, its tokens/s, and the model FLOP utilization (MFU): the model's
   training FLOPs per token (`planner.presets.config_spec`: 3 x the forward's, every layer) times tokens/s, over the
   dense matmul peak measured here at that precision (a square matmul of 8192 on a GPU, 1024 on the host).
2. A local swarm (`python -m p2ptrain.launch`: a bootstrap peer and an FS, a BS and a client per stage, all on the
   one device) against one process (the whole model, the same rows, microbatches and sequence length, one AdamW step
   per global batch): tokens/s over the epochs after `--warmup`, and their ratio.

Writes benchmarks/results/gpu-<device>.md (the command that made it on top) and .json, or the same in --out DIR.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import ROOT, command_line, log, machine_info, write_device_report

from p2ptrain.client.device import DTYPES, autocast, place, resolve_device
from p2ptrain.config import ConfigError, RunConfig
from p2ptrain.models import build_stage
from p2ptrain.planner.presets import config_spec
from p2ptrain.state.params import StageParams

PRECISIONS = ("fp32", "bf16", "fp16")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, precision: str, *, size: int, reps: int) -> float:
    """FLOP/s of a square matmul of `size` in the precision's dtype: the denominator of MFU."""
    dtype = DTYPES[precision]
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    a @ b
    sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2.0 * size ** 3 * reps / (time.perf_counter() - started)


def one_stage(config: RunConfig, device: torch.device, *, reps: int, peak_size: int) -> dict[str, Any]:
    """Part 1 for the run's precision: a worker's forward, backward and AdamW step on the whole model."""
    model_config = config.model_config
    whole = build_stage(model_config, start=0, end=model_config.num_layers, seed=0)
    master = StageParams(model=whole, config=config, device=device)
    model = place(whole, device, config.precision)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, model_config.vocab_size, (config.rows_per_microbatch, config.seq_len + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    times = []
    for rep in range(reps + 2):  # two to warm up
        sync(device)
        started = time.perf_counter()
        with autocast(device, config.precision):
            loss = model(inputs, labels)
        grads = torch.autograd.grad(loss, params)
        sync(device)
        if rep >= 2:
            times.append(time.perf_counter() - started)
    master.step([g.float() for g in grads], epoch=0)
    tokens = config.rows_per_microbatch * config.seq_len
    spec = config_spec(model_config, precision=config.precision)
    per_token = spec.flops_per_token_per_layer * spec.layers
    median = statistics.median(times)
    peak = matmul_peak(device, config.precision, size=peak_size, reps=5)
    return {"precision": config.precision, "microbatch_ms": 1e3 * median, "tokens_per_s": tokens / median,
            "model_flops_per_token": per_token, "matmul_peak_flops": peak,
            "mfu": per_token * tokens / median / peak}


def one_process(config: RunConfig, device: torch.device, *, epochs: int, warmup: int) -> float:
    """Part 2's reference: tokens/s of one process training the whole model on the swarm's batches' shapes."""
    model_config = config.model_config
    whole = build_stage(model_config, start=0, end=model_config.num_layers, seed=0)
    master = StageParams(model=whole, config=config, device=device)
    model = place(whole, device, config.precision)
    params = [p for p in model.parameters() if p.requires_grad]
    rows, seconds = config.rows_per_microbatch, []
    for epoch in range(epochs):
        sync(device)
        started = time.perf_counter()
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for _ in range(config.microbatches):
            ids = torch.randint(0, model_config.vocab_size, (rows, config.seq_len + 1), device=device)
            with autocast(device, config.precision):
                loss = model(ids[:, :-1], ids[:, 1:])
            for acc, grad in zip(total, torch.autograd.grad(loss, params)):
                acc.add_(grad)
        master.step([acc / config.tokens_per_epoch for acc in total], epoch=epoch)
        master.copy_to(model)
        sync(device)
        if epoch >= warmup:
            seconds.append(time.perf_counter() - started)
    return config.tokens_per_epoch * len(seconds) / sum(seconds)


def swarm(config: RunConfig, device: str, *, epochs: int, warmup: int, workdir: Path, timeout: float) -> float:
    """Part 2: tokens/s of a local 2-stage swarm on the device, over the epochs after `warmup` (the data source's)."""
    report = workdir / "swarm.json"
    command = [sys.executable, "-m", "p2ptrain.launch", "--model", config.model, "--stages", "2",
               "--epochs", str(epochs), "--batch-rows", str(config.rows_per_microbatch),
               "--microbatches", str(config.microbatches), "--seq-len", str(config.seq_len),
               "--precision", config.precision, "--device", device, "--run-id", "gpu-bench",
               "--workdir", str(workdir / "swarm"), "--report", str(report)]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the swarm failed (exit {out.returncode}): {out.stderr[-2000:]}")
    epochs_seen = [e for e in json.loads(report.read_text())["epochs"] if e["epoch"] >= warmup and e["seconds"]]
    return config.tokens_per_epoch * len(epochs_seen) / sum(e["seconds"] for e in epochs_seen)


def report_md(result: dict[str, Any]) -> str:
    info = result["machine"]
    lines = [f"# GPU benchmark: {result['device_name']}", "", f"    {result['command']}", "",
             f"{info['date']}, commit {info.get('commit', '?')}, torch {info['torch']}, model {result['model']}, "
             f"{result['rows']} rows x {result['seq_len']} tokens per microbatch.", "",
             "## One stage (the whole model, as a worker holds it)", "",
             "| precision | microbatch ms | tokens/s | matmul peak TFLOP/s | MFU |", "|---|---|---|---|---|"]
    for s in result["stage"]:
        lines.append(f"| {s['precision']} | {s['microbatch_ms']:.1f} | {s['tokens_per_s']:.0f} | "
                     f"{s['matmul_peak_flops'] / 1e12:.2f} | {s['mfu']:.3f} |")
    sw = result["swarm"]
    lines += ["", f"## A 2-stage local swarm on the one device against one process ({sw['precision']}, "
              f"{sw['epochs']} epochs, the first {sw['warmup']} left out)", "",
              "| one process tokens/s | swarm tokens/s | swarm / one process |", "|---|---|---|",
              f"| {sw['one_process_tokens_per_s']:.0f} | {sw['swarm_tokens_per_s']:.0f} | {sw['ratio']:.3f} |", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (development)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and epochs, for development")
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--batch-rows", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--swarm-precision", choices=PRECISIONS, default="bf16")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: torch sees none on this machine, so there is nothing to measure; run this on a GPU "
              "machine (or with --device cpu to try it on the host)")
        return 0
    try:
        device = resolve_device(args.device)
    except ConfigError as e:
        parser.error(f"--device {args.device}: {e.problem}")
    epochs = args.epochs or (4 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if not 0 <= warmup < epochs:
        parser.error("--warmup must be smaller than --epochs")
    if device.type == "cpu":  # the swarm's peers compute on one thread each: so does the reference
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"host CPU ({machine_info()['cpu']})"
    base = dict(model=args.model, num_stages=2, rows_per_microbatch=args.batch_rows, microbatches=args.microbatches,
                seq_len=args.seq_len)
    log(f"[1/2] one stage on {name}")
    stage = []
    for precision in PRECISIONS:
        result = one_stage(RunConfig(**base, precision=precision), device, reps=3 if args.quick else 10,
                           peak_size=8192 if device.type == "cuda" else 1024)
        log(f"  {precision}: {result['tokens_per_s']:.0f} tokens/s, MFU {result['mfu']:.3f}")
        stage.append(result)
    log(f"[2/2] a 2-stage swarm against one process, {args.swarm_precision}")
    config = RunConfig(**base, precision=args.swarm_precision)
    alone = one_process(config, device, epochs=epochs, warmup=warmup)
    with tempfile.TemporaryDirectory(prefix="p2ptrain-gpu-") as workdir:
        together = swarm(config, args.device, epochs=epochs, warmup=warmup, workdir=Path(workdir),
                         timeout=300.0 if args.quick else 600.0)
    log(f"  one process {alone:.0f} tokens/s, swarm {together:.0f} tokens/s, ratio {together / alone:.3f}")
    result = {"command": command_line(__file__, argv), "machine": machine_info(), "device": str(device),
              "device_name": name, "model": args.model, "rows": args.batch_rows, "seq_len": args.seq_len,
              "stage": stage,
              "swarm": {"precision": args.swarm_precision, "epochs": epochs, "warmup": warmup,
                        "one_process_tokens_per_s": alone, "swarm_tokens_per_s": together, "ratio": together / alone}}
    write_device_report(args.out, "gpu", name, result, report_md(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
