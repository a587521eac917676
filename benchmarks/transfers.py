"""Host <-> GPU transfers of one microbatch's activations, as a worker makes them, against the ways it could make them:
what decides whether pinned staging buffers and copies overlapped with compute (CUDA streams) pay.

    python benchmarks/transfers.py [--device cuda|cuda:N] [--rows 8] [--seq-len 128] [--hidden 256,4096] [--reps 50]
                                   [--out DIR]

For each hidden size, a float32 tensor of rows x seq-len x hidden (what travels between stages), the median over
`--reps` of:
- host to device as `client.device.to_device` does it (pinned for the call, then a non-blocking copy);
- host to device from pageable memory (a plain `.to(device)`);
- host to device from a pinned buffer kept between calls (the tensor copied into it, then a non-blocking copy);
- device to host as `client.device.to_host` does it (`.cpu()`), and into a pinned buffer kept between calls.
Each timing ends with the device synchronized. Without a CUDA device it says so and exits 0.
Writes transfers-<device>.md and .json under benchmarks/results/ (or --out).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from harness import ROOT, command_line, log, machine_info, write_device_report

from p2ptrain.client.device import resolve_device, to_device, to_host
from p2ptrain.config import ConfigError


def median_ms(action: Callable[[], object], device: torch.device, reps: int) -> float:
    action()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        action()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def measure(shape: tuple[int, ...], device: torch.device, reps: int) -> dict[str, float]:
    host = torch.randn(shape)
    staged = torch.empty(shape).pin_memory()
    on_device = host.to(device)
    back = torch.empty(shape).pin_memory()

    def from_staging() -> torch.Tensor:
        staged.copy_(host)
        return staged.to(device, non_blocking=True)

    return {
        "mib": host.numel() * 4 / 2**20,
        "h2d_to_device_ms": median_ms(lambda: to_device(host, device), device, reps),
        "h2d_pageable_ms": median_ms(lambda: host.to(device), device, reps),
        "h2d_pinned_reused_ms": median_ms(from_staging, device, reps),
        "d2h_to_host_ms": median_ms(lambda: to_host(on_device), device, reps),
        "d2h_pinned_reused_ms": median_ms(lambda: back.copy_(on_device, non_blocking=True), device, reps),
    }


def report_md(result: dict) -> str:
    lines = [f"# Host <-> GPU transfers of a microbatch's activations: {result['device_name']}", "",
             f"    {result['command']}", "",
             f"{result['machine']['date']}, torch {result['machine']['torch']}, {result['rows']} rows x "
             f"{result['seq_len']} tokens, float32; median ms of {result['reps']}.", "",
             "| hidden | MiB | to_device (pinned per call) | pageable | pinned, reused | to_host | to pinned, reused |",
             "|---|---|---|---|---|---|---|"]
    for hidden, r in result["sizes"].items():
        lines.append(f"| {hidden} | {r['mib']:.0f} | {r['h2d_to_device_ms']:.3f} | {r['h2d_pageable_ms']:.3f} | "
                     f"{r['h2d_pinned_reused_ms']:.3f} | {r['d2h_to_host_ms']:.3f} | {r['d2h_pinned_reused_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", default="256,4096", help="hidden sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: torch sees none on this machine, so there are no transfers to measure")
        return 0
    try:
        device = resolve_device(args.device)
    except ConfigError as e:
        parser.error(f"--device {args.device}: {e.problem}")
    if device.type != "cuda":
        parser.error("--device must be a CUDA device: transfers between the host and itself cost nothing")
    name = torch.cuda.get_device_name(device)
    sizes = {}
    for hidden in (int(h) for h in args.hidden.split(",")):
        sizes[hidden] = measure((args.rows, args.seq_len, hidden), device, args.reps)
        log(f"hidden {hidden}: " + ", ".join(f"{k} {v:.3f}" for k, v in sizes[hidden].items()))
    result = {"command": command_line(__file__, argv), "machine": machine_info(), "device_name": name,
              "rows": args.rows, "seq_len": args.seq_len, "reps": args.reps, "sizes": sizes}
    write_device_report(args.out, "transfers", name, result, report_md(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
