"""Data-plane benchmark: a real 2-stage swarm against one process training the same model on the same batches,
the RPC round trip and throughput of one hop, and the activation codecs, all in one run on the same cores.

    python benchmarks/dataplane.py [--quick] [--model llama-small] [--batch-rows 4] [--microbatches 8]
                                   [--seq-len 64] [--epochs 20] [--warmup 2] [--keep-streams on] [--push-behind off]
                                   [--dpu off,on] [--averaging-codec int8]
                                   [--keep-freed-memory off,on] [--overlap-epochs off,on] [--max-in-flight 4]
                                   [--interleave-every 4] [--interleave-epochs 2]

1. Swarm vs one process. The swarm is a bootstrap peer plus, for each of 2 stages, an FS, a BS and one client,
   each a real `python -m p2ptrain.peer` process on 127.0.0.1 (started and stopped with `harness.LocalSwarm`),
   all with `--threads 1` and the same recipe flags (`--compression none`). Its speed is the data source's
   per-epoch `seconds` / `tokens_per_s` from `p2ptrain.status.collect`, over the epochs after `--warmup`. The swarm
   runs once for each combination of `--keep-streams`, `--push-behind`, `--dpu`, `--averaging-codec`,
   `--keep-freed-memory`, `--overlap-epochs` and `--max-in-flight` settings
   (`--overlap-epochs on`, no drain at the epoch boundary, with --dpu on only), one after the other.
   The reference is a plain loop in this process (torch.set_num_threads(1)): the whole model (`build_stage` of
   all its layers) with the optimizer the workers build (`configure_optimizer`: AdamW, nanoGPT-style groups), the
   same `TextSource` microbatches, summed loss / tokens, one step per global batch; where any swarm keeps freed
   memory (`node.malloc`), so does this process, for the whole run. Half of its
   epochs run before the swarms and half after (the loss columns); and every `--interleave-every` epochs each swarm
   stands still (SIGSTOP) while a second model of it trains `--interleave-epochs` epochs, which the ratio compares
   with the swarm's epochs no pause touched, so both see the machine's load of the same minute. While the swarm
   trains, the CPU time of every process on the machine is read from /proc, so the report says where the two
   cores went (the clients' compute, the servers, hivemind's DHT and averager processes, the p2pd daemons,
   and processes that are not part of this benchmark) and how long each stage waited at the epoch boundary
   (from the peers' logs: "stage K FS: epoch E closed" -> "stage K stepped epoch E").
2. RPC: a second process hosts a hivemind P2P with a tiny servicer (sink and echo) that reads and answers
   with `p2ptrain.transport` packing; this process calls it with `p2ptrain.transport.Caller.exchange`, the
   runtime's own client path. Reported: the round trip of a header-only message and its CPU (both processes and
   their daemons), on a new stream per call and on kept streams, and the time and MB/s of one
   hop (push: the tensor goes one way, a small reply comes back) and of an echo (the tensor both ways) per codec
   and size; and the CPU per MB of a push at an activation's size and at 8 MiB, by the sender, the receiver and
   their two daemons, over about 100 MB.
3. Codecs none/fp16/int8 on a real activation and a real output gradient of the benchmark model's boundary
   shape (rows, seq, hidden): bytes, ratio to fp32, encode/decode MB/s (of fp32 input), max abs error.
A control (part "dht"): the CPU of 7 bare hivemind DHTs idling, to compare with the swarm's DHT processes.
A profile (part "profile", with py-spy): the shown swarm again, its FS/BS processes' CPU split by cause
(`cpu_causes.py`), and the whole non-compute CPU split by plane (`planes`): the data path (the activations and
gradients the paper routes through the servers, the daemons charged for their bytes at part 2's cost per MB), the
control plane (task pool, data source, probes, metrics, the DHT processes), and what serves either.
Everything listens on 127.0.0.1; every wait is bounded; every process started here is stopped before the end.

Writes benchmarks/results/dataplane.md (the command that made it on top) and benchmarks/results/dataplane.json,
or the same two files in --out DIR.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, AsyncIterator  # typing's: hivemind registers rpc_* handlers as streaming only by it

import hivemind
import torch
from cpu_causes import CAUSES, CONTROL, DATA, OTHER, PLANES, UNKNOWN, WAITING, Profiler
from harness import (
    OWN,
    ROOT,
    LocalSwarm,
    Sampler,
    command_line,
    consumer_cores,
    cpu_window,
    cpu_windows,
    fmt,
    load,
    log,
    machine_info,
    mean,
    peer_name,
    proc_table,
    snapshot,
)
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from p2ptrain.cli import LOOPBACK, flag_value, positive
from p2ptrain.compression import deserialize, encoded_nbytes, serialize
from p2ptrain.config import AVERAGING_CODECS, CODECS, RunConfig, RuntimeConfig
from p2ptrain.data import TextSource
from p2ptrain.dht import make_validators
from p2ptrain.models import TRAINABLE, build_stage
from p2ptrain.node.malloc import keep_freed_memory
from p2ptrain.node.options import NodeOptions
from p2ptrain.transport import LINGER_S, Caller, Envelope, KeptCall, Service, pack, unpack

RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
RUN_ID = "dataplane-bench"


# ---------------------------------------------------------------------------------------------------------------
# model timing and the single-process reference


def stage_timings(config: RunConfig, reps: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Forward+backward of one microbatch on each stage, as the workers compute it (1 torch thread), and the real
    boundary tensors it produced: stage 0's output activation and stage 1's gradient of its input."""
    source = TextSource(seq_len=config.seq_len, seed=config.seed)
    ids, labels = source.microbatch(0, 0, config.rows_per_microbatch)
    out: dict[str, Any] = {"stages": []}
    tensors: dict[str, torch.Tensor] = {}
    for stage in range(config.num_stages):
        start, end = config.stage_layers(stage)
        model = build_stage(config.model_config, start=start, end=end, seed=config.seed)
        params = list(model.parameters())
        times = []
        for _ in range(reps + 2):
            begin = time.perf_counter()
            if model.is_first:
                outputs = model(ids)
                grads = torch.autograd.grad(outputs, params, grad_outputs=torch.ones_like(outputs) * 1e-3)
            else:
                inputs = tensors["activation"].clone().requires_grad_(True)
                loss = model(inputs, labels) if model.is_last else model(inputs).float().sum()
                grads = torch.autograd.grad(loss, params + [inputs])
                tensors.setdefault("gradient", grads[-1].detach())
            times.append(time.perf_counter() - begin)
            if model.is_first:
                tensors.setdefault("activation", outputs.detach())
        times = times[2:]
        out["stages"].append({"stage": stage, "layers": [start, end], "median_ms": 1e3 * statistics.median(times),
                              "min_ms": 1e3 * min(times), "reps": reps})
        del grads
    return out, tensors


def single_process(config: RunConfig, epochs: range, state: dict | None) -> tuple[list[dict], dict]:
    """The reference: one process, the whole model and the workers' optimizer, one step per global batch of
    summed loss / tokens. `state` (model, optimizer, data source) carries training on from an earlier call."""
    torch.set_num_threads(1)
    if state is None:
        model = build_stage(config.model_config, start=0, end=config.model_config.num_layers, seed=config.seed)
        # exactly as the workers build theirs, or the loss columns of swarm and one process part
        optimizer = model.configure_optimizer(lr=config.lr, weight_decay=config.weight_decay)
        state = {"model": model, "optimizer": optimizer, "source": TextSource(seq_len=config.seq_len, seed=config.seed)}
    model, optimizer, source = state["model"], state["optimizer"], state["source"]
    tokens = config.tokens_per_epoch
    records = []
    for epoch in epochs:
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for index in range(config.microbatches):
            ids, labels = source.microbatch(epoch, index, config.rows_per_microbatch)
            loss = model(ids, labels)
            (loss / tokens).backward()
            loss_sum += float(loss.detach())
        optimizer.step()
        seconds = time.perf_counter() - wall
        records.append({"epoch": epoch, "seconds": seconds, "cpu_s": time.process_time() - cpu,
                        "tokens_per_s": tokens / seconds, "loss": loss_sum / tokens, "load": load()})
        log(f"  single process epoch {epoch}: {seconds:.2f} s, {tokens / seconds:.0f} tokens/s, "
            f"loss {loss_sum / tokens:.4f}")
    return records, state


# ---------------------------------------------------------------------------------------------------------------
# the swarm


LOG_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"


def _parse_time(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def epoch_boundaries(swarm: LocalSwarm) -> dict:
    """From the peers' logs: when each stage's FS closed an epoch and when its client stepped past it."""
    closed: dict[int, dict[int, float]] = defaultdict(dict)
    stepped: dict[int, dict[int, float]] = defaultdict(dict)
    for stage in range(swarm.config.num_stages):
        fs_log = swarm.log_path(peer_name(stage, "fs"))
        client_log = swarm.log_path(peer_name(stage, "client"))
        for line in fs_log.read_text(errors="replace").splitlines() if fs_log.exists() else []:
            m = re.match(LOG_TIME + rf".*stage {stage} FS: epoch (\d+) closed", line)
            if m:
                closed[stage][int(m.group(2))] = _parse_time(m.group(1))
        for line in client_log.read_text(errors="replace").splitlines() if client_log.exists() else []:
            m = re.match(LOG_TIME + rf".*stage {stage} stepped epoch (\d+)", line)
            if m:
                stepped[stage][int(m.group(2))] = _parse_time(m.group(1))
    return {"closed": closed, "stepped": stepped}


def call_rates(first: tuple[float, dict[str, dict[str, int]]], last: tuple[float, dict[str, dict[str, int]]]
               ) -> dict[str, dict[str, float]]:
    """Requests served per second between two `LocalSwarm.served_calls`, by kind of peer (its name without the
    stage: fs, bs, client, bootstrap) and method."""
    seconds = last[0] - first[0]
    rates: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, counts in last[1].items():
        before = first[1].get(name, {})
        for method, count in counts.items():
            rates[re.sub(r"^s\d+-", "", name)][method] += (count - before.get(method, 0)) / seconds
    return {kind: dict(methods) for kind, methods in rates.items()}


def outside(start: float, end: float, pauses: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of [start, end] that no pause covers."""
    segments, at = [], start
    for began, ended in sorted(pauses):
        if began > at:
            segments.append((at, min(began, end)))
        at = max(at, ended)
    if at < end:
        segments.append((at, end))
    return [(a, b) for a, b in segments if b > a]


def disturbed(epochs: list[dict], closed_at: dict[int, float], pauses: list[tuple[float, float]]) -> set[int]:
    """The epochs a pause of the swarm touched: those running while it stood still, and the first one after each
    pause (it starts with the queues the pause left)."""
    hit = set()
    for began, ended in pauses:
        after = []
        for e in epochs:
            if e["epoch"] not in closed_at or not e["seconds"]:
                continue
            end = closed_at[e["epoch"]]
            start = end - e["seconds"]
            if start < ended and end > began:
                hit.add(e["epoch"])
            elif start >= ended:
                after.append(e["epoch"])
        if after:
            hit.add(min(after))
    return hit


def shown_swarm(runs: list[dict]) -> dict:
    """The swarm whose tables the report shows and the profile runs again: the one with the settings p2ptrain ships
    with (its peers' defaults), where the run has it; else the last."""
    ships = RunConfig()
    shipped = {"keep_streams": flag_value(RuntimeConfig.keep_streams), "push_behind": flag_value(RuntimeConfig.push_behind),
               "dpu": flag_value(ships.dpu), "averaging_codec": ships.averaging_codec,
               "keep_freed_memory": flag_value(NodeOptions.keep_freed_memory),
               "overlap_epochs": flag_value(ships.overlap_epochs), "max_in_flight": NodeOptions.max_in_flight}
    return next((run for run in reversed(runs) if all(run[key] == value for key, value in shipped.items())), runs[-1])


def swarm_config(config: RunConfig, *, dpu: str, overlap: str, codec: str | None = None) -> RunConfig:
    """The benchmark's recipe with the swarm's --dpu, --overlap-epochs and --averaging-codec settings."""
    return dataclasses.replace(config, dpu=dpu == "on", overlap_epochs=overlap == "on",
                               averaging_codec=codec or config.averaging_codec)


def run_swarm(args: argparse.Namespace, config: RunConfig, workdir: Path, *, keep_streams: str, push_behind: str,
              keep_freed_memory: str, max_in_flight: int = NodeOptions.max_in_flight, epochs: int | None = None,
              profile_s: float = 0.0,
              reference: Callable[[int, int], list[dict]] | None = None) -> dict:
    """Train the swarm for `epochs` epochs (default `args.epochs`), reading every process's CPU time meanwhile,
    then the idle swarm's; with `profile_s`, py-spy records its FS/BS processes for that long from the first steady
    epoch on (`profile`: samples per cause of each, and every process's CPU over the recording). With `reference`,
    every `args.interleave_every` epochs after the warm-up the swarm stands still (`LocalSwarm.paused`) while
    `reference(args.interleave_epochs, warm)` trains the one process, after `warm` epochs it does not time
    (`paired`: its epochs; `pauses`: when), so both are timed under the machine's load of the same minute; the CPU
    window leaves the pauses out. A failure is reported (`error`) with what the logs show, not raised."""
    node_flags = ["--keep-streams", keep_streams, "--push-behind", push_behind, "--keep-freed-memory", keep_freed_memory,
                  "--max-in-flight", str(max_in_flight)]
    if args.metrics_period is not None:
        node_flags += ["--metrics-period", str(args.metrics_period)]
    swarm = LocalSwarm(workdir, config, epochs=epochs or args.epochs, node_flags=node_flags)
    result: dict[str, Any] = {"workdir": str(workdir), "timed_out": False, "recipe_flags": swarm.flags,
                              "roles": swarm.roles}
    try:
        with swarm:
            swarm.start_bootstrap()
            for stage in range(config.num_stages):
                swarm.start_server(stage, "fs")
                swarm.start_server(stage, "bs")
                swarm.start_client(stage)
            log(f"  swarm of {len(swarm.roles)} processes, logs in {workdir}")
            swarm.connect()
            roots = swarm.roots()
            # requests each peer served, as the status first shows the warm-up's last epoch closed and as it first
            # shows the last one closed: both read as late after the event, so the window spans the steady epochs (not
            # the wait for the finished flag after them, nor the profiler's wind-down)
            served: dict[str, tuple[float, dict]] = {}
            last_epoch = (epochs or args.epochs) - 1
            profiler = Profiler(workdir, duration_s=profile_s) if profile_s > 0 else None
            profiled_from: list[float] = []
            paired: list[dict] = []
            next_pause = [args.warmup - 1]

            def at_close(closed: int) -> None:
                if closed >= args.warmup - 1 and "start" not in served:  # a quick epoch may close between reads
                    served["start"] = (time.monotonic(), swarm.served_calls())
                elif closed >= last_epoch and "start" in served and "end" not in served:
                    served["end"] = (time.monotonic(), swarm.served_calls())
                if profiler is not None and closed >= args.warmup - 1 and not profiled_from:
                    profiled_from.append(time.time())
                    profiler.start({name: pid for name, pid in roots.items() if swarm.roles.get(name) == "server"})
                # not in the last epochs, which would have no undisturbed epoch after the pause
                if reference is not None and next_pause[0] <= closed < last_epoch - 2:
                    with swarm.paused():
                        # the first pause's first epoch is not timed: after the swarm's start, the one process's first
                        # took 1.6x the next ones (its first microbatches and its step, at full CPU), later ones not
                        paired.extend(reference(args.interleave_epochs, 0 if swarm.pauses else 1))
                    next_pause[0] = closed + args.interleave_every

            with Sampler() as sampler:
                progress = swarm.follow(deadline=swarm.started + args.swarm_timeout, poll_s=args.poll_s,
                                        on_closed=at_close)
                if profiler is not None and profiled_from:
                    samples = profiler.collect()
                    pair = sampler.around(profiled_from[0], profiled_from[0] + profile_s)
                    result["profile"] = {"samples": samples, "seconds": profile_s, "rate": profiler.rate,
                                         "cpu": cpu_window(*pair, roots) if pair else None}
            result["paired"], result["pauses"] = paired, swarm.pauses
            if "start" in served:  # with no read between the two, until now
                result["calls_training"] = call_rates(served["start"],
                                                      served.get("end") or (time.monotonic(), swarm.served_calls()))
            report = progress.report
            result["timed_out"] = progress.timed_out
            result["report"] = report
            result["wall_s"] = time.monotonic() - swarm.started
            reads = progress.read_s
            result["status_read_s"] = {"median": statistics.median(reads) if reads else None,
                                       "max": max(reads) if reads else None, "reads": len(reads)}
            # the CPU window: from the start of the first steady epoch to the close of the last one, as the stage-0
            # FS logged them (the data source starts an epoch as soon as the previous one closed there)
            closed_at = epoch_boundaries(swarm)["closed"].get(0, {})
            epochs = {e["epoch"]: e for e in (report or {}).get("epochs", []) if e["seconds"]}
            steady = [e for e in sorted(closed_at) if e >= args.warmup and e in epochs]
            if steady:
                start = closed_at[steady[0]] - epochs[steady[0]]["seconds"]
                segments = outside(start, closed_at[steady[-1]], swarm.pauses)
                pairs = ([sampler.within(*segment) for segment in segments] if swarm.pauses
                         else [sampler.around(start, closed_at[steady[-1]])])
                window = cpu_windows([pair for pair in pairs if pair is not None], roots)
                if window is not None:
                    result["cpu"] = window
                    result["cpu"]["epochs"] = [steady[0], steady[-1]]
                    result["cpu"]["window_wanted_s"] = sum(end - begin for begin, end in segments)
            if not progress.timed_out and args.idle_s > 0 and not profile_s:  # the runs compared say it
                # the same swarm with nothing to train and nobody reading its status: its background cost, once the
                # records and closures of the last epoch are stored and read
                time.sleep(args.idle_settle_s)
                calls_first = (time.monotonic(), swarm.served_calls())
                idle_first = snapshot()
                time.sleep(args.idle_s)
                result["cpu_idle"] = cpu_window(idle_first, snapshot(), roots)
                result["calls_idle"] = call_rates(calls_first, (time.monotonic(), swarm.served_calls()))
    except Exception as e:  # report what was measured, and why the swarm part is missing
        log(f"  swarm failed: {e!r}")
        result = {"error": repr(e), "workdir": str(workdir), "report": None}
    result["boundaries"] = epoch_boundaries(swarm)
    return result


# ---------------------------------------------------------------------------------------------------------------
# RPC: a sink/echo servicer in a second process, called with the runtime's Caller


class DataplaneBench(Service):
    """Registered as "DataplaneBench.rpc_sink" and "DataplaneBench.rpc_echo", the names `Caller.exchange` calls, and
    "DataplaneBench.rpc_calls" for calls over kept streams. Like the runtime's servicers (`transport.Service.serve`),
    a handler keeps a stream of its own open after its reply until the caller closes it: a handler that returns at
    once may close the stream before its reply leaves (calls failed with "the peer sent an empty stream" or a broken
    pipe)."""

    service = "DataplaneBench"

    async def rpc_sink(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        envelope = await unpack(requests)
        reply = Envelope({"ok": True, "tensors": len(envelope.tensors)})
        for response in pack(reply, codec="none", proto=runtime_pb2.ExpertResponse):
            yield response
        await self._linger(context)

    async def rpc_echo(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        envelope = await unpack(requests)
        for response in pack(envelope, codec=envelope.header.get("codec", "none"), proto=runtime_pb2.ExpertResponse):
            yield response
        await self._linger(context)

    @staticmethod
    async def _linger(context: P2PContext | KeptCall) -> None:
        if isinstance(context, KeptCall):  # its request was read whole; the stream carries the next call
            context.whole = True
        else:
            await asyncio.sleep(LINGER_S)


SERVICE = DataplaneBench.service


async def _serve(address_file: Path, max_lifetime_s: float) -> None:
    parent = os.getppid()
    p2p = await P2P.create(host_maddrs=[LOOPBACK])
    try:
        await DataplaneBench(peer_id=p2p.peer_id.to_base58(), name="dataplane bench", codec="none"
                             ).add_p2p_handlers(p2p)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        tmp = address_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs, "pid": os.getpid()}))
        tmp.rename(address_file)
        deadline = time.monotonic() + max_lifetime_s
        while os.getppid() == parent and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await p2p.shutdown()


def rpc_server_main(address_file: str) -> None:
    torch.set_num_threads(1)
    stop = asyncio.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        serve = asyncio.create_task(_serve(Path(address_file), max_lifetime_s=900.0))
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([serve, waiter], return_when=asyncio.FIRST_COMPLETED)
        serve.cancel()
        await asyncio.gather(serve, return_exceptions=True)

    asyncio.run(main())


def _cpu_s(roots: list[int]) -> float:
    """CPU seconds of the processes `roots` and their children (their p2p daemons)."""
    table = proc_table()
    return sum(cpu for pid, (_, ppid, cpu) in table.items() if pid in roots or ppid in roots)


def _cpu_by_part(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each process of `pids` (name -> pid) and, as "NAME p2pd", of its p2p daemon."""
    table = proc_table()
    out = {}
    for name, pid in pids.items():
        out[name] = table[pid][2] if pid in table else 0.0
        out[f"{name} p2pd"] = sum(cpu for comm, ppid, cpu in table.values() if ppid == pid and comm == "p2pd")
    return out


async def _call_cpu(caller: Caller, peer: str, envelope: Envelope, parts: dict[str, int], *, calls: int
                    ) -> dict[str, float]:
    """CPU seconds the caller, the callee and their two daemons spent on `calls` sink calls of `envelope`: enough calls
    for /proc's 10 ms ticks, too coarse for the few timed ones."""
    before = _cpu_by_part(parts)
    for _ in range(calls):
        await caller.exchange(peer, SERVICE, "rpc_sink", envelope)
    used = {part: seconds - before[part] for part, seconds in _cpu_by_part(parts).items()}
    return {"caller": used["caller"], "callee": used["callee"], "daemons": used["caller p2pd"] + used["callee p2pd"]}


async def _push_cpu(caller: Caller, peer: str, tensor: torch.Tensor, parts: dict[str, int], *, mb: float
                    ) -> dict[str, float]:
    """CPU ms per MB pushed (uncompressed) by the sender, the receiver and their two daemons, over pushes of `tensor`
    that move about `mb` MB in all."""
    count = max(1, math.ceil(mb * 1e6 / tensor.nbytes))
    used = await _call_cpu(caller, peer, Envelope({"codec": "none"}, {"x": tensor}), parts, calls=count)
    moved_mb = count * tensor.nbytes / 1e6
    return {"sender": 1e3 * used["caller"] / moved_mb, "receiver": 1e3 * used["callee"] / moved_mb,
            "daemons": 1e3 * used["daemons"] / moved_mb, "mb": moved_mb}


async def _rpc_client(address: dict, sizes: list[tuple[str, int]], reps: dict[str, int], small_reps: int,
                      cpu_sizes: set[str], cpu_mb: float) -> dict:
    p2p = await P2P.create(initial_peers=[f"{m}" for m in address["maddrs"]], host_maddrs=[LOOPBACK])
    peer = address["peer_id"]
    out: dict = {"small": {}, "transfers": []}
    try:
        callers = {codec: Caller(p2p=p2p, peer_id=p2p.peer_id.to_base58(), codec=codec, timeout=120.0)
                   for codec in CODECS}
        small = Envelope({"worker": "12D3KooW" + "x" * 44, "compute": 1.0e9, "epoch": 3, "wait_s": 0.0})
        roots = [os.getpid(), address["pid"]]
        parts = {"caller": os.getpid(), "callee": address["pid"]}
        for streams, keep in (("new", False), ("kept", True)):  # a stream per call, or kept open between calls
            caller = Caller(p2p=p2p, peer_id=p2p.peer_id.to_base58(), codec="none", timeout=120.0, keep_streams=keep)
            for _ in range(10):
                await caller.exchange(peer, SERVICE, "rpc_sink", small)
            times, cpu = [], _cpu_s(roots)
            for _ in range(small_reps):
                begin = time.perf_counter()
                await caller.exchange(peer, SERVICE, "rpc_sink", small)
                times.append(time.perf_counter() - begin)
            cpu = _cpu_s(roots) - cpu
            by_part = None
            if keep:
                used = await _call_cpu(caller, peer, small, parts, calls=10 * small_reps)
                by_part = {part: 1e3 * seconds / (10 * small_reps) for part, seconds in used.items()}
                by_part["calls"] = 10 * small_reps
            caller.close()
            out["small" if keep else "small_new_streams"] = {
                "streams": streams, "reps": small_reps, "median_ms": 1e3 * statistics.median(times),
                "p90_ms": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))], "min_ms": 1e3 * min(times),
                "cpu_ms_per_call": 1e3 * cpu / small_reps, "cpu_ms_per_call_by_part": by_part}
            log(f"  rpc: small message round trip, {streams} streams: median {1e3 * statistics.median(times):.2f} ms, "
                f"{1e3 * cpu / small_reps:.2f} ms CPU a call (both processes and their daemons)")
        for label, nbytes in sizes:
            tensor = torch.randn(nbytes // 4)
            for codec in CODECS:
                wire = encoded_nbytes(serialize(tensor, codec))
                row = {"size": label, "fp32_bytes": nbytes, "codec": codec, "wire_bytes": wire}
                for method in ("rpc_sink", "rpc_echo"):
                    envelope = Envelope({"codec": codec}, {"x": tensor})
                    for _ in range(2 if nbytes <= MIB else 1):  # warm-up
                        await callers[codec].exchange(peer, SERVICE, method, envelope)
                    times = []
                    for _ in range(reps[label]):
                        begin = time.perf_counter()
                        reply = await callers[codec].exchange(peer, SERVICE, method, envelope)
                        times.append(time.perf_counter() - begin)
                    if method == "rpc_echo" and reply.tensors["x"].shape != tensor.shape:
                        raise RuntimeError("echo returned a different tensor")
                    seconds = statistics.median(times)
                    key = "push" if method == "rpc_sink" else "echo"
                    ways = 1 if key == "push" else 2
                    row[f"{key}_ms"] = 1e3 * seconds
                    row[f"{key}_fp32_MBps"] = ways * nbytes / seconds / 1e6
                    row[f"{key}_wire_MBps"] = ways * wire / seconds / 1e6
                row["reps"] = reps[label]
                if codec == "none" and label in cpu_sizes:
                    row["push_cpu_ms_per_mb"] = await _push_cpu(callers[codec], peer, tensor, parts, mb=cpu_mb)
                out["transfers"].append(row)
                log(f"  rpc: {label:>9} {codec:4s} push {row['push_ms']:8.2f} ms ({row['push_fp32_MBps']:6.0f} MB/s "
                    f"fp32), echo {row['echo_ms']:8.2f} ms")
    finally:
        await p2p.shutdown()
    return out


def run_rpc(args: argparse.Namespace, activation_bytes: int, workdir: Path) -> dict:
    address_file = workdir / "rpc-server.json"
    server_log = open(workdir / "rpc-server.log", "w")
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--rpc-server", str(address_file)],
                              stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120.0  # imports alone take 15 s on a loaded 2-core machine
        while not address_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the RPC server did not come up; see {workdir / 'rpc-server.log'}")
            time.sleep(0.1)
        address = json.loads(address_file.read_text())
        sizes = [(f"act {activation_bytes / 1024:.0f} KiB", activation_bytes), ("1 MiB", MIB), ("8 MiB", 8 * MIB)]
        if not args.quick:
            sizes.append(("32 MiB", 32 * MIB))
        reps = {sizes[0][0]: 10 if args.quick else 30, "1 MiB": 5 if args.quick else 10,
                "8 MiB": 3 if args.quick else 5, "32 MiB": 2}
        torch.set_num_threads(1)
        # the swarm's two sizes of data: an activation, and (in size) a stage's gradient deposit
        cpu_sizes = {sizes[0][0], "8 MiB"}
        return asyncio.run(asyncio.wait_for(_rpc_client(address, sizes, reps, 30 if args.quick else 100, cpu_sizes,
                                                        16.0 if args.quick else 96.0), 300.0))
    finally:
        if server.poll() is None:
            server.terminate()
        try:
            server.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(server.pid, signal.SIGKILL)  # and its p2pd, whatever is left
        except ProcessLookupError:
            pass
        server.wait()
        server_log.close()


def dht_control(peers: int, seconds: float) -> dict:
    """CPU of `peers` bare hivemind DHTs (p2ptrain's validators, no records, no readers) idling on loopback: what the
    swarm's DHT processes would cost without p2ptrain's periodic records and reads."""
    dhts = []
    try:
        boot = hivemind.DHT(host_maddrs=[LOOPBACK], start=True, record_validators=make_validators(RUN_ID))
        dhts.append(boot)
        initial = [str(a) for a in boot.get_visible_maddrs()]
        for _ in range(peers - 1):
            dhts.append(hivemind.DHT(initial_peers=initial, host_maddrs=[LOOPBACK], start=True,
                                     record_validators=make_validators(RUN_ID)))
        time.sleep(2.0)
        first = snapshot()
        time.sleep(seconds)
        window = cpu_window(first, snapshot(), {OWN: os.getpid()})
    finally:
        for dht in dhts:
            dht.shutdown()
    cores = window["cores"]
    return {"peers": peers, "seconds": window["wall_s"], "dht_cores": cores.get(f"{OWN}/dht", 0.0),
            "p2pd_cores": cores.get(f"{OWN}/p2pd", 0.0)}


# ---------------------------------------------------------------------------------------------------------------
# codecs


def run_codecs(tensors: dict[str, torch.Tensor], reps: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for what, tensor in tensors.items():
        tensor = tensor.contiguous()
        fp32 = tensor.numel() * 4
        absmax = float(tensor.abs().max())
        for codec in CODECS:
            enc, dec = [], []
            for _ in range(reps + 1):
                begin = time.perf_counter()
                parts = serialize(tensor, codec)
                enc.append(time.perf_counter() - begin)
                begin = time.perf_counter()
                decoded = deserialize(parts)
                dec.append(time.perf_counter() - begin)
            nbytes = encoded_nbytes(parts)
            error = float((decoded.float() - tensor).abs().max())
            rows.append({"tensor": what, "shape": list(tensor.shape), "codec": codec, "bytes": nbytes,
                         "ratio": nbytes / fp32, "encode_MBps": fp32 / statistics.median(enc[1:]) / 1e6,
                         "decode_MBps": fp32 / statistics.median(dec[1:]) / 1e6, "max_abs_err": error,
                         "max_abs_err_rel_absmax": error / absmax if absmax else 0.0, "absmax": absmax})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# report


CPU_GROUPS = {
    "client": "client processes of stages 0 and 1 (the compute)",
    "server": "FS/BS server processes (4)",
    "bootstrap": "bootstrap peer process",
    "dht": "hivemind DHT processes of the 7 peers",
    "p2pd": "p2pd daemons of the 7 peers",
    "averager": "hivemind averager processes of the clients",
    OWN: "this benchmark (status reader: main, its DHT and p2pd)",
    "other": "torch_shm_manager",
    "outside": "processes outside this benchmark (other work on the machine)",
    "idle": "idle",
}  # what each group of harness.consumer_cores is in this swarm


def control_cores(groups: dict[str, float]) -> float:
    """The swarm's control plane among `harness.consumer_cores` groups: everything but the clients' compute."""
    return sum(groups[group] for group in ("server", "bootstrap", "dht", "p2pd", "averager"))


def profile_causes(profile: dict, roles: dict[str, str]) -> dict:
    """The FS/BS processes' cores by cause over a `run_swarm` profile: each cause's share of their py-spy samples
    times their measured cores over the recording; and the cores of every group there (`consumer_cores`)."""
    totals: dict[str, int] = defaultdict(int)
    for samples in profile["samples"].values():
        for cause, count in samples.items():
            totals[cause] += count
    groups = consumer_cores(profile["cpu"], roles) if profile.get("cpu") else {}
    servers = groups.get("server", 0.0)
    waiting = totals.pop(WAITING, 0)  # a thread caught at its wait: no share of the work
    n = sum(totals.values())
    order = [cause for cause, _, _ in CAUSES] + [OTHER]
    return {"samples": n, "waiting_samples": waiting, "server_cores": servers, "groups": groups,
            "causes": [{"cause": cause, "plane": PLANES[cause], "samples": totals.get(cause, 0),
                        "share": totals.get(cause, 0) / n if n else 0.0,
                        "cores": servers * totals.get(cause, 0) / n if n else 0.0} for cause in order]}


# the calls the servers serve for the control plane: task polls (their replies' tensors are charged by bytes), results,
# the epochs' ends and questions, reports, leaving, probes; the rest carry the data path's tensors
CONTROL_CALLS = frozenset({"rpc_take_task", "rpc_task_result", "rpc_end_epoch", "rpc_ask_epoch", "rpc_report_norm",
                           "rpc_report_group", "rpc_leave", "rpc_echo"})


def planes(causes: dict, profiled: dict, rpc: dict | None, warmup: int) -> dict | None:
    """The profiled swarm's non-compute cores split by plane (`cpu_causes.PLANES`): the servers' by their samples'
    causes; the p2p daemons' by the bytes the swarm sent of each kind (activations at an activation's size, averaging
    and state at a deposit's, both uncompressed) times the daemons' CPU per MB measured on a bare push in part 2,
    the rest of their CPU (every call's overhead, the DHT's traffic, the load) counted as either; the DHT and bootstrap
    processes as control, hivemind's averager processes as data. And an estimate of the control plane's share of what
    serves either: the control calls the servers served a second (`CONTROL_CALLS`) at part 2's CPU of a small call on
    kept streams, both processes and both daemons (a call a client makes costs the client, outside this count: so
    the share errs high). None without part 2's figures or the swarm's bytes."""
    report = profiled.get("report") or {}
    epochs = [e for e in report.get("epochs", []) if e["epoch"] >= warmup and e["seconds"]]
    sent = report.get("bytes_sent")
    per_mb = {r["size"]: r["push_cpu_ms_per_mb"] for r in (rpc or {}).get("transfers", []) if "push_cpu_ms_per_mb" in r}
    activation = next((cpu["daemons"] for size, cpu in per_mb.items() if size.startswith("act")), None)
    deposit = per_mb.get("8 MiB", {}).get("daemons")
    if not (epochs and sent and activation is not None and deposit is not None):
        return None
    epoch_s = mean([e["seconds"] for e in epochs])
    all_epochs = report.get("epochs", [])
    mb_per_s = {kind: nbytes / len(all_epochs) / 1e6 / epoch_s for kind, nbytes in sent.items()}
    groups = causes["groups"]
    daemons = groups.get("p2pd", 0.0)
    daemons_data = min(daemons, (mb_per_s.get("activations", 0.0) * activation
                                 + (mb_per_s.get("averaging", 0.0) + mb_per_s.get("state", 0.0)) * deposit) / 1e3)
    servers = {plane: sum(row["cores"] for row in causes["causes"] if row["plane"] == plane)
               for plane in (DATA, CONTROL, UNKNOWN)}
    out = {"mb_per_s": mb_per_s, "daemon_ms_per_mb": {"activation": activation, "deposit": deposit},
           "servers": servers, "daemons": {DATA: daemons_data, UNKNOWN: daemons - daemons_data},
           "dht": groups.get("dht", 0.0), "bootstrap": groups.get("bootstrap", 0.0),
           "averager": groups.get("averager", 0.0)}
    out[DATA] = servers[DATA] + daemons_data + out["averager"]
    out[CONTROL] = servers[CONTROL] + out["dht"] + out["bootstrap"]
    out[UNKNOWN] = servers[UNKNOWN] + daemons - daemons_data
    call = (rpc or {}).get("small", {}).get("cpu_ms_per_call_by_part")
    calls = profiled.get("calls_training")
    if call and calls:
        out["control_calls_per_s"] = sum(rate for methods in calls.values() for method, rate in methods.items()
                                         if method in CONTROL_CALLS)
        out["control_call_ms"] = call["caller"] + call["callee"] + call["daemons"]
        out["control_calls_cores"] = min(out[UNKNOWN], out["control_calls_per_s"] * out["control_call_ms"] / 1e3)
        out["control_estimate"] = out[CONTROL] + out["control_calls_cores"]
    return out


def analyse(args: argparse.Namespace, config: RunConfig, timings: dict, single: list[dict], swarm: dict) -> dict:
    """The report's numbers: steady-epoch speeds and their ratio, the ideal pipeline, step stalls, CPU per group.

    The swarm's steady epochs are those after the warm-up that no pause touched (`disturbed`). Where the swarm
    paused for the one process (`paired`), the ratio compares those epochs with the one process's in the pauses;
    else with its epochs before and after the swarms (`ratio_apart`, given either way)."""
    tokens = config.tokens_per_epoch
    steady_single = [r for r in single if r["epoch"] >= args.warmup]
    paired = swarm.get("paired") or []
    reference = paired or steady_single
    epochs = swarm.get("report", {}).get("epochs", []) if swarm.get("report") else []
    after_warmup = [e for e in epochs if e["epoch"] >= args.warmup and e["seconds"]]
    hit = disturbed(after_warmup, swarm.get("boundaries", {}).get("closed", {}).get(0, {}), swarm.get("pauses") or [])
    steady = [e for e in after_warmup if e["epoch"] not in hit]
    single_s = mean([r["seconds"] for r in reference])
    swarm_s = mean([e["seconds"] for e in steady])
    out = {"tokens_per_epoch": tokens, "steady_epochs_single": [r["epoch"] for r in steady_single],
           "steady_epochs_swarm": [e["epoch"] for e in steady], "paused_epochs_swarm": sorted(hit),
           "paired_epochs_single": len(paired), "pauses": len(swarm.get("pauses") or [])}
    out["single_s_per_epoch"] = single_s
    out["single_tokens_per_s"] = tokens / single_s if single_s else None
    out["single_tokens_per_cpu_s"] = tokens / mean([r["cpu_s"] for r in reference]) if reference else None
    out["swarm_s_per_epoch"] = swarm_s
    out["swarm_tokens_per_s"] = tokens / swarm_s if swarm_s else None
    out["ratio"] = (out["swarm_tokens_per_s"] / out["single_tokens_per_s"]
                    if out["swarm_tokens_per_s"] and out["single_tokens_per_s"] else None)
    apart_s = mean([r["seconds"] for r in steady_single])
    out["single_apart_s_per_epoch"] = apart_s
    out["ratio_apart"] = apart_s / swarm_s if apart_s and swarm_s else None
    # the fastest steady epoch of each: the least disturbed by other work on the machine
    out["single_best_s"] = min((r["seconds"] for r in reference), default=None)
    out["swarm_best_s"] = min((e["seconds"] for e in steady), default=None)
    out["ratio_best"] = (out["single_best_s"] / out["swarm_best_s"]
                         if out["single_best_s"] and out["swarm_best_s"] else None)
    stage_ms = [min(s["min_ms"], s.get("min_ms_after", s["min_ms"])) for s in timings["stages"]]
    out["stage_ms_used"] = stage_ms
    d = config.microbatches
    out["compute_s_per_epoch"] = [d * ms / 1e3 for ms in stage_ms]
    out["ideal_pipeline_s"] = (d * max(stage_ms) + min(stage_ms)) / 1e3
    # the same compute on 1 core (both stages in turn) vs 2 free cores (1F1B pipeline); no transport, no step
    out["ideal_ratio"] = d * sum(stage_ms) / 1e3 / out["ideal_pipeline_s"]
    # epoch-boundary stalls: FS of stage k closed epoch E -> stage k's client stepped past E
    stalls: dict[int, list[float]] = {}
    b = swarm.get("boundaries", {"closed": {}, "stepped": {}})
    for stage in range(config.num_stages):
        closed, stepped = b["closed"].get(stage, {}), b["stepped"].get(stage, {})
        stalls[stage] = [stepped[e] - closed[e] for e in sorted(closed)
                         if e in stepped and e >= args.warmup and e in [x["epoch"] for x in steady]]
    out["step_stall_s"] = {stage: mean(v) for stage, v in stalls.items()}
    out["step_stall_per_epoch"] = {stage: v for stage, v in stalls.items()}
    cpu = swarm.get("cpu")
    if cpu and swarm_s:
        out["cpu_cores"] = consumer_cores(cpu, swarm["roles"])
        out["cpu_s_per_epoch"] = {k: v * swarm_s for k, v in out["cpu_cores"].items()}
        out["cpu_window_s"] = cpu["wall_s"]
        swarm_cores = cpu["ours_cores"] - out["cpu_cores"][OWN]
        out["swarm_tokens_per_cpu_s"] = tokens / (swarm_cores * swarm_s) if swarm_cores > 0 else None
        out["machine_cores_used"] = cpu["machine_cores"]
        g = out["cpu_cores"]
        control = control_cores(g)
        clients_cpu = g["client"] * swarm_s
        single_cpu = mean([r["cpu_s"] for r in reference])
        out["control_cores"] = control
        out["clients_cpu_s_per_epoch"] = clients_cpu
        out["single_cpu_s_per_epoch"] = single_cpu
        if clients_cpu and single_cpu:
            # the machine to itself: the clients get what the control plane leaves, one core each at most
            cores = min(float(config.num_stages), (os.cpu_count() or 1) - control)
            out["cpu_bound_ratio"] = min(out["ideal_ratio"], cores * single_cpu / clients_cpu)
    if swarm.get("cpu_idle"):
        out["cpu_cores_idle"] = g = consumer_cores(swarm["cpu_idle"], swarm["roles"])
        out["cpu_idle_window_s"] = swarm["cpu_idle"]["wall_s"]
        out["control_cores_idle"] = control_cores(g)
    out["last_loss"] = epochs[-1]["loss"] if epochs else None
    return out


def profile_markdown(profiled: dict | None, causes: dict | None, shown: dict, analysis: dict,
                     split: dict | None) -> list[str]:
    """The section on where the FS/BS processes' CPU goes, by cause (`causes`: `profile_causes` of `profiled`), with
    the other control-plane groups beside, and the whole split by plane (`split`: `planes`)."""
    if profiled is None:
        return ["### Where the control plane's CPU goes, by cause: not run (--parts, --profile-s, or no py-spy)", ""]
    if causes is None:
        return [f"### Where the control plane's CPU goes, by cause: the profiled swarm failed "
                f"({profiled.get('error', 'no profile recorded')}); logs in `{profiled.get('workdir')}`", ""]
    groups = causes["groups"]
    out = ["### Where the control plane's CPU goes, by cause", "",
           f"A separate swarm with the settings shown above, its {len(profiled['profile']['samples'])} FS/BS "
           f"processes recorded by py-spy ({profiled['profile']['rate']} samples a second of running threads, "
           f"without pausing them; `benchmarks/cpu_causes.py` says which frames make a cause) for "
           f"{profiled['profile']['seconds']:.0f} s from its first steady epoch; the recording itself takes CPU, so "
           "the cores are this run's, not the comparison's. A stack counts for the first cause it passes through, "
           "in this order; the servers' cores are split by their shares of the "
           f"{causes['samples']} samples at work ({causes['waiting_samples']} more caught a thread at its wait in "
           "the event loop's selector, which is not work):", "",
           "| cause | plane | share of the servers' samples | cores |", "|---|---|---|---|"]
    for row in causes["causes"]:
        out.append(f"| {row['cause']} | {row['plane']} | {100 * row['share']:.0f}% | {row['cores']:.3f} |")
    out.append(f"| FS/BS processes, all causes | | 100% | {causes['server_cores']:.3f} |")
    for group in ("p2pd", "dht", "bootstrap", "averager"):
        out.append(f"| {CPU_GROUPS[group]} (measured, not sampled) | | | {groups.get(group, 0.0):.3f} |")
    if split is not None:  # this swarm's bytes and daemons, as in the table
        which, mb_per_s, p2pd = "this swarm", sum(split["mb_per_s"].values()), groups.get("p2pd", 0.0)
    else:  # the shown swarm's (this one's bytes are known only with part 2's figures)
        sent = shown["report"].get("bytes_sent") if shown.get("report") else None
        epochs = shown["report"]["epochs"] if shown.get("report") else []
        epoch_s, p2pd = analysis.get("swarm_s_per_epoch"), analysis.get("cpu_cores", {}).get("p2pd")
        which = "the swarm shown"
        mb_per_s = sum(sent.values()) / len(epochs) / 1e6 / epoch_s if sent and epochs and epoch_s else None
    if mb_per_s and p2pd:
        out += ["", f"The p2p daemons carry every byte and call of the rows above: {which} sent "
                f"{mb_per_s:.1f} MB/s while its daemons used {p2pd:.2f} cores, {1e3 * p2pd / mb_per_s:.1f} ms of "
                "daemon CPU per MB sent (a byte passes the sender's daemon and the receiver's)."]
    if split is not None:
        servers, daemons, rates = split["servers"], split["daemons"], split["mb_per_s"]
        out += ["", "Split by plane: the data path is what moves and handles the activations and the gradients the "
                "paper routes through the servers (its relay, the deposits, the replicas' steps); the control plane "
                "is what decides, announces and watches (task pool, data source, probes, metrics, DHT); framing, "
                "hivemind's P2P client and the event loop serve both. The daemons' share of the data path is the "
                f"bytes the swarm sent ({rates.get('activations', 0.0):.1f} MB/s of activations, "
                f"{rates.get('averaging', 0.0) + rates.get('state', 0.0):.1f} MB/s of gradients and state) times the "
                "daemons' CPU per MB of a bare push in part 2 "
                f"({split['daemon_ms_per_mb']['activation']:.1f} ms at an activation's size, "
                f"{split['daemon_ms_per_mb']['deposit']:.1f} ms at 8 MiB); the rest of their CPU (every call's own "
                "cost, the DHT's traffic, the load of a busy machine) counts as either.", "",
                "| | data path | control plane | either |", "|---|---|---|---|",
                f"| FS/BS processes (by their samples) | {servers[DATA]:.3f} | {servers[CONTROL]:.3f} | "
                f"{servers[UNKNOWN]:.3f} |",
                f"| p2p daemons (by bytes) | {daemons[DATA]:.3f} | | {daemons[UNKNOWN]:.3f} |",
                f"| hivemind DHT and bootstrap processes | | {split['dht'] + split['bootstrap']:.3f} | |",
                f"| hivemind averager processes | {split['averager']:.3f} | | |",
                f"| **all** | **{split[DATA]:.3f}** | **{split[CONTROL]:.3f}** | **{split[UNKNOWN]:.3f}** |", "",
                f"The control plane alone takes between {split[CONTROL]:.3f} cores (what is surely its own) and "
                f"{split[CONTROL] + split[UNKNOWN]:.3f} (with all that serves either plane)."]
        if "control_estimate" in split:
            out.append(f"Of what serves either, the servers served {split['control_calls_per_s']:.1f} control calls a "
                       "second (task polls, results, the epochs' ends and questions, reports, probes); at a bare small "
                       f"call's {split['control_call_ms']:.2f} ms of CPU (both processes and both daemons, part 2) they "
                       f"take {split['control_calls_cores']:.3f} cores, and the rest serves the data path's bytes: "
                       f"**the control plane takes about {split['control_estimate']:.3f} cores while training**.")
    return [*out, ""]


def markdown(args: argparse.Namespace, command: str, info: dict, config: RunConfig, timings: dict,
             single: list[dict], swarm: dict, analysis: dict, rpc: dict | None, codecs: list[dict],
             control: dict | None, swarm_runs: dict[str, dict], profiled: dict | None,
             causes: dict | None, split: dict | None) -> str:
    model = config.model_config
    a = analysis
    out = ["# Data-plane benchmark", "", f"Command: `{command}`", "",
           f"Date: {info['date']}; machine: nproc {info['nproc']}, {info['cpu']}, Python {info['python']}, "
           f"torch {info['torch']}, hivemind {info['hivemind']}; every process 1 torch thread.",
           f"Code: commit {info.get('commit', '?')}"
           + (f" with uncommitted changes in {', '.join(info['uncommitted'])}" if info.get("uncommitted") else "")
           + " (the runtime measured is the working tree at that time).",
           f"Load average (1, 5, 15 min): {info['load_start']} at start, {info['load_end']} at the end "
           f"(other work on the machine shares these {info['nproc']} cores; see the CPU table).", ""]
    out += ["## 1. Swarm vs one process", "",
            f"Recipe: `{config.model}` ({model.num_layers} layers, hidden {model.hidden_size}, "
            f"{sum(p.numel() for p in build_stage(model, start=0, end=model.num_layers).parameters()) / 1e6:.2f} M "
            f"params), {config.num_stages} stages, {config.microbatches} microbatches x {config.rows_per_microbatch} "
            f"rows x {config.seq_len} tokens = {a['tokens_per_epoch']} tokens per epoch, {args.epochs} epochs, "
            f"first {args.warmup} skipped as warm-up; swarm: bootstrap + FS + BS + 1 client per stage "
            f"(7 peer processes), `{' '.join(swarm.get('recipe_flags', [])[2:])}` and the role flags "
            "(`--role`, `--stage`, `--server-role`, `--initial-peers`).", "",
            "Per-stage microbatch forward+backward in one process, 1 thread (the work of one task), measured at the "
            "start and again after the swarm; the ideal below uses the smallest time (the least disturbed by other "
            "work):", "",
            "| stage | layers | median ms (start) | min ms (start) | median ms (after) | min ms (after) |",
            "|---|---|---|---|---|---|"]
    for s in timings["stages"]:
        out.append(f"| {s['stage']} | {s['layers'][0]}..{s['layers'][1]} | {s['median_ms']:.1f} | {s['min_ms']:.1f} | "
                   f"{fmt(s.get('median_ms_after'), '.1f')} | {fmt(s.get('min_ms_after'), '.1f')} |")
    paired = a["paired_epochs_single"]
    where = (f"in the swarm's {a['pauses']} pauses ({paired} epochs)" if paired
             else "before and after the swarms")
    out += ["", "| | s / epoch (steady mean) | tokens/s | tokens per CPU-second |", "|---|---|---|---|",
            f"| one process, whole model, 1 thread, {where} | {fmt(a['single_s_per_epoch'])} | "
            f"{fmt(a['single_tokens_per_s'], '.0f')} | {fmt(a['single_tokens_per_cpu_s'], '.0f')} |",
            f"| swarm, 7 processes (status `seconds`, {len(a['steady_epochs_swarm'])} epochs no pause touched) | "
            f"{fmt(a['swarm_s_per_epoch'])} | "
            f"{fmt(a['swarm_tokens_per_s'], '.0f')} | {fmt(a.get('swarm_tokens_per_cpu_s'), '.0f')} "
            "(all swarm processes) |",
            f"| **ratio swarm / one process** (mean steady epochs) | | **{fmt(a['ratio'], '.3f')}** | |",
            *([f"| ratio to the one process's epochs before and after the swarms ({fmt(a['single_apart_s_per_epoch'])}"
               f" s) | | {fmt(a['ratio_apart'], '.3f')} | |"] if paired else []),
            f"| ratio of the fastest steady epochs (one process {fmt(a['single_best_s'])} s, swarm "
            f"{fmt(a['swarm_best_s'])} s) | | {fmt(a['ratio_best'], '.3f')} | |",
            f"| ideal 2-stage pipeline on 2 free cores (compute only: d x max stage + min stage) | "
            f"{fmt(a['ideal_pipeline_s'])} | {fmt(a['tokens_per_epoch'] / a['ideal_pipeline_s'], '.0f')} | "
            f"ratio {fmt(a['ideal_ratio'], '.2f')} vs the same compute on one core |", ""]
    if args.interleave_every:
        out += [f"Side by side: every {args.interleave_every} epochs after the warm-up, each swarm stood still (SIGSTOP "
                f"to every peer's process group, its daemon and DHT process with it) while the one process trained "
                f"{args.interleave_epochs} epochs, a model of its own, then went on (SIGCONT); so the two are timed "
                "under the machine's load of the same minute, which moved the ratio by 0.1 from run to run when "
                "the one process ran only before and after the swarms. The swarm's mean leaves out the epochs a pause "
                "touched (running across it, or the first after it): here "
                f"{', '.join(str(e) for e in a['paused_epochs_swarm']) or 'none'}. The CPU tables leave the pauses "
                "out.", ""]
    if len(swarm_runs) > 1:
        out += ["The swarm with each setting of `--keep-streams` (calls over streams kept open, or a new stream per "
                "call), of `--push-behind` (a worker pushes each result while it takes its next task), of "
                "`--averaging-codec` (how deposits and rounds send gradients), of delayed parameter updates (`--dpu`), of `--keep-freed-memory` (glibc keeps freed buffers "
                "for reuse, `node.malloc`), of `--overlap-epochs` (no drain at the epoch boundary) and of "
                "`--max-in-flight` (microbatches the data source keeps in the pipeline at once), one after the "
                "other in this run (the tables below are those of the swarm that runs as p2ptrain ships, where the run has "
                "it, else the last one's; control plane: the FS/BS, bootstrap, DHT, "
                "p2pd and averager processes):", "",
                "| --keep-streams | --push-behind | --averaging-codec | --dpu | --keep-freed-memory | --overlap-epochs | "
                "--max-in-flight | "
                "s / epoch | tokens/s | ratio to one process | ratio to its epochs before and after | control plane cores "
                "(training) | control plane cores (idle) | step stall s (stage 0 / 1) | last loss |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for run in swarm_runs.values():
            out.append(f"| {run['keep_streams']} | {run.get('push_behind', '-')} | {run.get('averaging_codec', '-')} | "
                       f"{run['dpu']} | {run['keep_freed_memory']} | {run['overlap_epochs']} | {run['max_in_flight']} | "
                       f"{fmt(run['swarm_s_per_epoch'])} | "
                       f"{fmt(run['swarm_tokens_per_s'], '.0f')} | {fmt(run['ratio'], '.3f')} | "
                       f"{fmt(run['ratio_apart'], '.3f')} | "
                       f"{fmt(run.get('control_cores'))} | {fmt(run.get('control_cores_idle'), '.3f')} | "
                       f"{' / '.join(fmt(v) for v in run['step_stall_s'].values())} | {fmt(run['last_loss'], '.4f')} |")
        out.append("")
    if swarm.get("error"):
        out += [f"**The swarm failed: {swarm['error']}** (logs: `{swarm.get('workdir')}`).", ""]
    if swarm.get("timed_out"):
        out += [f"The swarm did not finish its {args.epochs} epochs within --swarm-timeout "
                f"{args.swarm_timeout:.0f} s; the table uses the epochs that closed.", ""]
    out += ["Per epoch (swarm: the data source's `seconds`, the last stage's loss, rows averaged per stage; "
            "stall: FS closed the epoch -> the stage's client stepped past it, from the logs):", "",
            "| epoch | swarm s | swarm tok/s | swarm loss | one-process s | one-process loss | rows averaged | "
            "stall s0 | stall s1 |", "|---|---|---|---|---|---|---|---|---|"]
    single_by = {r["epoch"]: r for r in single}
    epochs = swarm["report"]["epochs"] if swarm.get("report") else []
    b = swarm.get("boundaries", {"closed": {}, "stepped": {}})
    for e in epochs:
        s = single_by.get(e["epoch"], {})
        stall = []
        for stage in range(config.num_stages):
            c, st = b["closed"].get(stage, {}), b["stepped"].get(stage, {})
            stall.append(fmt(st[e["epoch"]] - c[e["epoch"]]) if e["epoch"] in c and e["epoch"] in st else "-")
        note = (" (warm-up)" if e["epoch"] < args.warmup else " (paused)" if e["epoch"] in a["paused_epochs_swarm"]
                else "")
        out.append(f"| {e['epoch']}{note} | {fmt(e['seconds'])} | "
                   f"{fmt(e['tokens_per_s'], '.0f')} | {fmt(e['loss'], '.4f')} | {fmt(s.get('seconds'))} | "
                   f"{fmt(s.get('loss'), '.4f')} | {'/'.join(str(x['rows_averaged']) for x in e['stages'])} | "
                   f"{' | '.join(stall)} |")
    if "cpu_cores" in a:
        nproc = info["nproc"]
        idle = a.get("cpu_cores_idle")
        out += ["", f"Where the {nproc} cores went while the swarm ran its steady epochs (utime+stime from /proc over "
                f"{a['cpu_window_s']:.0f} s, every process on the machine; CPU-s per epoch = cores x the mean steady "
                f"epoch of {fmt(a['swarm_s_per_epoch'])} s)"
                + (f", and the same swarm idle after training, nobody reading its status "
                   f"({a['cpu_idle_window_s']:.0f} s)" if idle else "") + ":", "",
                "| consumer | cores (training) | CPU-s per epoch | share of the machine | cores (idle swarm) |",
                "|---|---|---|---|---|"]
        for group, cores in sorted(a["cpu_cores"].items(), key=lambda kv: -kv[1]):
            out.append(f"| {CPU_GROUPS[group]} | {cores:.2f} | {a['cpu_s_per_epoch'][group]:.2f} | "
                       f"{100 * cores / nproc:.0f}% | {fmt(idle.get(group) if idle else None)} |")
        per_peer = swarm["cpu"]["cores"]
        clients = ", ".join(f"stage {k} {per_peer.get(f's{k}-client/main', 0.0) * a['swarm_s_per_epoch']:.2f} CPU-s"
                            for k in range(config.num_stages))
        comp = a["compute_s_per_epoch"]
        out += ["", f"CPU the clients used per epoch: {clients}; compute an epoch needs at 1 thread (microbatches x "
                "smallest stage time measured above): " + ", ".join(f"stage {k} {v:.2f} s" for k, v in enumerate(comp))
                + f"; the one-process loop took {fmt(a['single_s_per_epoch'])} s per epoch.",
                "Step stall at the epoch boundary (FS closed the epoch -> the stage's client stepped; mean over "
                "steady epochs): " + ", ".join(f"stage {k} {fmt(v)} s" for k, v in a["step_stall_s"].items())
                + (f". Control: 7 bare hivemind DHTs (same validators, no records, nobody reading) idling on this "
                   f"machine use {control['dht_cores']:.3f} cores in their DHT processes and "
                   f"{control['p2pd_cores']:.3f} in their p2pd daemons" if control else "")
                + ". One status read (4 DHT gets with latest=True) took median "
                f"{fmt(swarm['status_read_s']['median'])} s, max {fmt(swarm['status_read_s']['max'])} s."]
    if "cpu_cores" in a and a["swarm_s_per_epoch"]:
        g, w = a["cpu_cores"], a["swarm_s_per_epoch"]
        stall0 = a["step_stall_s"].get(0) or 0.0
        out += ["", "Summary of the gap: on " f"{info['nproc']} cores with nothing else running, the two stages "
                f"could overlap for a ratio of about {a['ideal_ratio']:.2f} (compute only). Measured: "
                f"{fmt(a['ratio'], '.3f')}. CPU budget: the one-process loop spends "
                f"{fmt(a.get('single_cpu_s_per_epoch'))} CPU-s per epoch, the two clients "
                f"{fmt(a.get('clients_cpu_s_per_epoch'))} CPU-s (compute plus their RPC work), and the swarm's "
                f"control plane keeps {a['control_cores']:.2f} cores busy while it trains "
                f"({fmt(a.get('control_cores_idle'), '.3f')} idle); with the machine to itself the clients could get at most {info['nproc']} - {a['control_cores']:.2f} cores, which "
                f"bounds the ratio at about {fmt(a.get('cpu_bound_ratio'), '.2f')}. During the steady epochs the "
                f"two clients got {g['client']:.2f} cores between them, the swarm's control plane (hivemind DHT "
                f"processes, p2pd daemons, FS/BS and bootstrap processes, averagers) used {a['control_cores']:.2f} "
                f"cores (the DHT processes alone {g['dht']:.2f}), this benchmark's status reader {g[OWN]:.2f}, other "
                f"work on the machine {g['outside']:.2f}, and {g['idle']:.2f} stayed idle. At each epoch boundary "
                f"stage 0 waits {stall0:.2f} s "
                f"({100 * stall0 / w:.0f}% of a {w:.2f} s epoch) between its FS closing the epoch and its client "
                f"stepping{' (with --dpu on it steps in the background)' if config.dpu else ''}, and "
                + ("with --overlap-epochs on the data source feeds the next epoch's microbatches as soon as the last "
                   "ones of the epoch are out, and workers with nothing left of the epoch compute them, so the "
                   "pipeline does not drain at the boundary." if config.overlap_epochs else
                   "the data source feeds nothing of the next epoch until the last microbatch's backward is back at "
                   "stage 0, so the pipeline drains and refills once per epoch.")]
    if swarm.get("calls_training") or swarm.get("calls_idle"):
        training, idle = swarm.get("calls_training", {}), swarm.get("calls_idle", {})
        rows = sorted({(kind, method) for rates in (training, idle) for kind, methods in rates.items()
                       for method in methods},
                      key=lambda km: -(training.get(km[0], {}).get(km[1], 0.0) + idle.get(km[0], {}).get(km[1], 0.0)))
        out += ["", "Requests the swarm's processes served per second, by the kind of peer that served them and "
                "method (p2ptrain's RPCs, counted as each is decoded; the all-reduce's parts and the DHT's own "
                "traffic are hivemind's and not here), during the steady epochs and while the swarm idled:", "",
                "| served by | method | per s (training) | per s (idle) |", "|---|---|---|---|"]
        for kind, method in rows:
            t, i = training.get(kind, {}).get(method), idle.get(kind, {}).get(method)
            if (t or 0) >= 0.05 or (i or 0) >= 0.05:
                out.append(f"| {kind} | {method} | {fmt(t, '.1f')} | {fmt(i, '.1f')} |")
        out.append(f"| all | all | {fmt(sum(sum(m.values()) for m in training.values()), '.1f')} | "
                   f"{fmt(sum(sum(m.values()) for m in idle.values()), '.1f')} |")
    sent = swarm["report"].get("bytes_sent") if swarm.get("report") else None
    if sent and epochs:
        per_epoch = {kind: nbytes / len(epochs) / 1e6 for kind, nbytes in sent.items()}
        out += ["", f"Bytes the swarm's processes sent, by kind (`p2ptrain.traffic`, the status's `bytes_sent`: each "
                f"peer's last metrics record, so the last seconds may be missing), over the {len(epochs)} epochs "
                "trained, per epoch: " + ", ".join(f"{kind} {mb:.1f} MB" for kind, mb in sorted(per_epoch.items(),
                                                                                    key=lambda km: -km[1])) + "."]
    out += ["", f"Swarm logs: `{swarm.get('workdir')}` (a temporary directory).", ""]
    out += profile_markdown(profiled, causes, swarm, analysis, split)
    if rpc is None:
        out += ["## 2. RPC: not run (--parts)", ""]
    else:
        out += ["## 2. RPC over hivemind P2P (two processes on 127.0.0.1, `p2ptrain.transport` packing, streaming)",
                ""]
        for key in ("small_new_streams", "small"):
            small = rpc[key]
            out.append(f"Small message (header only, like `rpc_take_task`) round trip, {small['streams']} streams "
                       f"({'a stream opened for each call' if key != 'small' else 'kept open between calls'}): median "
                       f"{small['median_ms']:.2f} ms, p90 {small['p90_ms']:.2f} ms, min {small['min_ms']:.2f} ms over "
                       f"{small['reps']} calls; {small['cpu_ms_per_call']:.2f} ms of CPU a call (both processes and "
                       "their p2p daemons)"
                       + (f"; over {part['calls']} more calls, {part['caller']:.2f} ms the caller's, "
                          f"{part['callee']:.2f} ms the callee's and {part['daemons']:.2f} ms the two daemons'."
                          if (part := small.get("cpu_ms_per_call_by_part")) else "."))
        out += ["", "The transfers below go over kept streams (the runtime's default).",
                "", "push = one hop: the tensor goes to the peer, which decodes it and answers with a small reply; "
                "echo = the peer decodes and sends it back encoded with the same codec. Times include encode and "
                "decode; MB/s counts fp32 megabytes moved (10^6 bytes) and, for wire MB/s, the encoded bytes.", "",
                "| size (fp32) | codec | wire bytes | push ms | push MB/s (fp32) | push MB/s (wire) | echo ms | "
                "echo MB/s (fp32) | push CPU ms per MB: sender / receiver / both daemons (over MB pushed) | reps |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rpc["transfers"]:
            cpu = r.get("push_cpu_ms_per_mb")
            out.append(f"| {r['size']} | {r['codec']} | {r['wire_bytes']} | {r['push_ms']:.2f} | "
                       f"{r['push_fp32_MBps']:.0f} | {r['push_wire_MBps']:.0f} | {r['echo_ms']:.2f} | "
                       f"{r['echo_fp32_MBps']:.0f} | "
                       + (f"{cpu['sender']:.1f} / {cpu['receiver']:.1f} / {cpu['daemons']:.1f} ({cpu['mb']:.0f} MB) | "
                          if cpu else "- | ") + f"{r['reps']} |")
        act = [r for r in rpc["transfers"] if r["size"].startswith("act")]
        if act:
            out += ["", "A microbatch crosses 6 activation-sized hops in this 2-stage swarm (client0->BS0, BS0->FS1, "
                    "FS1->client1, client1->FS1 grads, FS1->BS0 grads, BS0->client0 grads) plus about 7 small ones "
                    "(token ids in, task results, the loss, reports) and the workers' task polls. At the measured "
                    "push time of one activation, 6 hops cost "
                    + ", ".join(f"{6 * r['push_ms']:.1f} ms ({r['codec']})" for r in act)
                    + f" per microbatch, against {sum(a['stage_ms_used']):.0f} ms of compute (both stages)."]
    # codecs
    out += ["", "## 3. Codecs on the benchmark model's boundary tensors", "",
            "| tensor | shape | codec | bytes | ratio vs fp32 | encode MB/s | decode MB/s | max abs err | "
            "err / absmax |", "|---|---|---|---|---|---|---|---|---|"]
    for r in codecs:
        out.append(f"| {r['tensor']} | {'x'.join(map(str, r['shape']))} | {r['codec']} | {r['bytes']} | "
                   f"{r['ratio']:.3f} | {r['encode_MBps']:.0f} | {r['decode_MBps']:.0f} | {r['max_abs_err']:.3g} | "
                   f"{r['max_abs_err_rel_absmax']:.2g} |")
    out.append("")
    return "\n".join(out)


def in_flight_list(text: str) -> list[int]:
    """`--max-in-flight`'s comma-separated settings: whole numbers of 1 or more, each once."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes whole numbers, comma-separated, not {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"takes numbers of 1 or more, each once, not {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-small", choices=sorted(k for k in TRAINABLE if k != "llama-33b"))
    parser.add_argument("--batch-rows", type=int, default=None, help="rows per microbatch (default 4)")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per epoch (default 8; quick 4)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=None,
                        help="global batches (default 20; 12 with --interleave-every 0, 10 of them steady, where 4 "
                             "swung the ratio by 0.1 from run to run; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="epochs skipped as warm-up (default 2; quick 1)")
    parser.add_argument("--swarm-timeout", type=float, default=None,
                        help="give the swarm at most this many seconds (default 210; quick 150)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between status reads of the swarm")
    parser.add_argument("--interleave-every", type=int, default=None,
                        help="every this many epochs after the warm-up, the swarm stands still (SIGSTOP) while the one "
                             "process trains --interleave-epochs epochs, and the ratio compares those with the "
                             "swarm's epochs that no pause touched (default 4; 0: the one process runs only before "
                             "and after the swarms, whose ratios then moved by 0.1 with the machine's load)")
    parser.add_argument("--interleave-epochs", type=int, default=2,
                        help="one-process epochs in each pause of the swarm")
    parser.add_argument("--idle-s", type=float, default=None,
                        help="after training, measure the idle swarm's CPU use for this long (0: skip; default 60, "
                             "quick 20): 60 s spans two of the peers' 30 s record periods, where a shorter window "
                             "catches their periodic stores and reads, or misses them, by chance")
    parser.add_argument("--idle-settle-s", type=float, default=10.0,
                        help="...starting this long after the last epoch closed (its records are stored meanwhile)")
    parser.add_argument("--quick", action="store_true", help="a short run: fewer epochs, sizes and repetitions")
    parser.add_argument("--parts", default="swarm,rpc,codecs,dht,profile",
                        help="comma-separated parts to run: swarm (with the one-process reference), rpc, codecs, "
                             "dht (CPU of 7 bare idle hivemind DHTs, a control for the swarm's DHT processes), "
                             "profile (the shown swarm again, where its servers' CPU goes by cause; needs swarm)")
    parser.add_argument("--profile-s", type=float, default=8.0,
                        help="seconds py-spy records the profiled swarm's FS/BS processes (0: skip)")
    parser.add_argument("--dpu", default="off,on", type=lambda text: text.split(","),
                        help="the swarm's --dpu settings, run one after the other (default off,on; the detailed "
                             "tables are the last swarm's)")
    parser.add_argument("--overlap-epochs", default="off,on", type=lambda text: text.split(","),
                        help="the swarm's --overlap-epochs settings, each run with every --dpu on setting (default "
                             "off,on; on needs --dpu on)")
    parser.add_argument("--keep-streams", default="on", type=lambda text: text.split(","),
                        help="the swarm's --keep-streams settings, each run with every --dpu setting (default on)")
    parser.add_argument("--push-behind", default=flag_value(RuntimeConfig.push_behind),
                        type=lambda text: text.split(","),
                        help="the swarm's --push-behind settings, each run with every other setting (default: the "
                             "peers' default)")
    parser.add_argument("--averaging-codec", default=RunConfig.averaging_codec, type=lambda text: text.split(","),
                        help="the swarms' --averaging-codec settings, each run with every other setting (default: the "
                             "recipe's)")
    parser.add_argument("--keep-freed-memory", default="off,on", type=lambda text: text.split(","),
                        help="the peers' --keep-freed-memory settings, each run with every other setting (default "
                             "off,on)")
    parser.add_argument("--max-in-flight", default=str(NodeOptions.max_in_flight), type=in_flight_list,
                        help="the data source's --max-in-flight settings (microbatches it keeps in the pipeline at "
                             "once), each run with every other setting (default: the peers' default)")
    parser.add_argument("--metrics-period", type=positive, default=None,
                        help="the peers' --metrics-period (default: theirs): how often each stores its metrics in "
                             "the DHT while they change, which is most of what the DHT processes do while training")
    parser.add_argument("--out", default=str(RESULTS), help="directory for dataplane.md and dataplane.json")
    parser.add_argument("--rpc-server", help=argparse.SUPPRESS)  # internal: the RPC benchmark's second process
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rpc_server:
        rpc_server_main(args.rpc_server)
        return
    args.batch_rows = args.batch_rows or 4
    args.microbatches = args.microbatches or (4 if args.quick else 8)
    args.interleave_every = args.interleave_every if args.interleave_every is not None else (0 if args.quick else 4)
    args.epochs = args.epochs or (3 if args.quick else 20 if args.interleave_every else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.swarm_timeout = args.swarm_timeout or (150.0 if args.quick else 210.0)
    args.idle_s = args.idle_s if args.idle_s is not None else (20.0 if args.quick else 60.0)
    if not 0 <= args.warmup < args.epochs:
        parser.error("--warmup must be smaller than --epochs")
    if args.interleave_every < 0 or args.interleave_epochs < 1:
        parser.error("--interleave-every takes 0 (off) or more epochs, --interleave-epochs 1 or more")
    for flag, values in (("--dpu", args.dpu), ("--keep-streams", args.keep_streams), ("--push-behind", args.push_behind),
                         ("--keep-freed-memory", args.keep_freed_memory), ("--overlap-epochs", args.overlap_epochs)):
        if not values or not set(values) <= {"off", "on"} or len(set(values)) != len(values):
            parser.error(f"{flag} takes off, on or both (comma-separated, each once), not {','.join(values)}")
    if not args.averaging_codec or not set(args.averaging_codec) <= set(AVERAGING_CODECS) or len(
            set(args.averaging_codec)) != len(args.averaging_codec):
        parser.error(f"--averaging-codec takes some of {', '.join(AVERAGING_CODECS)} (comma-separated, each once), not "
                     f"{','.join(args.averaging_codec)}")
    config = RunConfig(run_id=RUN_ID, model=args.model, num_stages=2, rows_per_microbatch=args.batch_rows,
                       microbatches=args.microbatches, seq_len=args.seq_len)
    command = command_line(__file__, argv)
    info = machine_info()
    torch.set_num_threads(1)
    if "on" in args.keep_freed_memory:
        keep_freed_memory()
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-dataplane-"))

    log(f"[1/5] per-stage microbatch time ({config.model}, {config.rows_per_microbatch} rows x {config.seq_len})")
    timings, tensors = stage_timings(config, reps=5 if args.quick else 10)
    for s in timings["stages"]:
        log(f"  stage {s['stage']} layers {s['layers']}: forward+backward median {s['median_ms']:.1f} ms, "
            f"min {s['min_ms']:.1f} ms")
    if min(s["median_ms"] for s in timings["stages"]) < 20.0:
        log("  warning: a stage's microbatch takes under 20 ms; choose a bigger model or batch")

    parts = set(args.parts.split(","))
    log("[2/5] codecs")
    codecs = run_codecs({"activation": tensors["activation"], "output gradient": tensors["gradient"]},
                        reps=10 if args.quick else 30) if "codecs" in parts else []
    for r in codecs:
        log(f"  {r['tensor']:15s} {r['codec']:4s} {r['bytes']:>8} B ratio {r['ratio']:.3f} enc {r['encode_MBps']:.0f} "
            f"MB/s dec {r['decode_MBps']:.0f} MB/s err {r['max_abs_err']:.3g}")

    log("[3/5] RPC round trip and throughput")
    activation_bytes = tensors["activation"].numel() * 4
    rpc = run_rpc(args, activation_bytes, workdir) if "rpc" in parts else None

    control = None
    if "dht" in parts:
        log("  control: 7 bare hivemind DHTs idling")
        control = dht_control(7, 4.0 if args.quick else 8.0)
        log(f"  control: DHT processes {control['dht_cores']:.3f} cores, p2pd {control['p2pd_cores']:.3f} cores")

    half = (args.epochs + 1) // 2
    single: list[dict] = []
    swarm: dict = {"error": "not run (--parts)", "workdir": str(workdir), "report": None,
                   "boundaries": {"closed": {}, "stepped": {}}}
    swarms: dict[str, dict] = {}  # "keep-KEEP-dpu-DPU" -> its swarm, run one after the other
    profiled: dict | None = None  # the shown swarm again, its servers recorded by py-spy
    if "swarm" in parts:
        log(f"[4/5] one process, epochs 0..{half - 1} (before the swarm)")
        single, state = single_process(config, range(0, half), None)
        # the one process trained in the swarms' pauses: a model of its own, its epochs numbered on from the last
        paced: dict[str, Any] = {"state": None, "next": args.epochs}

        def reference(count: int, warm: int) -> list[dict]:
            records, paced["state"] = single_process(config, range(paced["next"], paced["next"] + warm + count),
                                                     paced["state"])
            paced["next"] += warm + count
            return records[warm:]
        for keep, behind, codec, dpu, freed, overlap, in_flight in itertools.product(
                args.keep_streams, args.push_behind, args.averaging_codec, args.dpu, args.keep_freed_memory,
                args.overlap_epochs, args.max_in_flight):
            if dpu == "off" and overlap == "on":
                continue  # the next epoch may start early only with delayed updates
            log(f"[5/5] swarm with --keep-streams {keep} --push-behind {behind} --averaging-codec {codec} --dpu {dpu} "
                f"--keep-freed-memory {freed} --overlap-epochs {overlap} --max-in-flight {in_flight}: "
                f"{args.epochs} epochs")
            name = (f"keep-{keep}-behind-{behind}-codec-{codec}-dpu-{dpu}-freed-{freed}-overlap-{overlap}"
                    f"-in-flight-{in_flight}")
            (workdir / name).mkdir()
            swarms[name] = run_swarm(args, swarm_config(config, dpu=dpu, overlap=overlap, codec=codec),
                                     workdir / name, keep_streams=keep, push_behind=behind, keep_freed_memory=freed,
                                     max_in_flight=in_flight, reference=reference if args.interleave_every else None)
            swarms[name].update(keep_streams=keep, push_behind=behind, averaging_codec=codec, dpu=dpu,
                                keep_freed_memory=freed, overlap_epochs=overlap, max_in_flight=in_flight)
        swarm = shown_swarm(list(swarms.values()))
        if "profile" in parts and args.profile_s > 0 and Profiler.available():
            # long enough to cover the recording at the shown swarm's pace, slowed by the recording
            epoch_s = analyse(args, config, timings, single, swarm).get("swarm_s_per_epoch") or 1.0
            epochs = args.warmup + math.ceil(1.5 * args.profile_s / epoch_s) + 1
            log(f"  profile: the same swarm for {epochs} epochs, its FS/BS processes recorded by py-spy for "
                f"{args.profile_s:.0f} s")
            (workdir / "profile").mkdir()
            profiled = run_swarm(args, swarm_config(config, dpu=swarm["dpu"], overlap=swarm["overlap_epochs"],
                                                    codec=swarm["averaging_codec"]),
                                 workdir / "profile",
                                 keep_streams=swarm["keep_streams"], push_behind=swarm["push_behind"],
                                 keep_freed_memory=swarm["keep_freed_memory"], max_in_flight=swarm["max_in_flight"],
                                 epochs=epochs, profile_s=args.profile_s)
        elif "profile" in parts and args.profile_s > 0:
            log("  profile: skipped, py-spy is not installed (pip install -e '.[test]')")
        log(f"  one process, epochs {half}..{args.epochs - 1} (after the swarm)")
        more, state = single_process(config, range(half, args.epochs), state)
        single += more
        again, _ = stage_timings(config, reps=5 if args.quick else 10)
        for s, s2 in zip(timings["stages"], again["stages"]):
            s["median_ms_after"], s["min_ms_after"] = s2["median_ms"], s2["min_ms"]
            log(f"  stage {s['stage']} again: median {s2['median_ms']:.1f} ms, min {s2['min_ms']:.1f} ms")

    info["load_end"] = load()
    info["runtime_s"] = time.monotonic() - began
    analysis = analyse(args, config, timings, single, swarm)
    swarm_runs = {name: {**analyse(args, config, timings, single, run), "keep_streams": run["keep_streams"],
                         "push_behind": run["push_behind"], "averaging_codec": run["averaging_codec"],
                         "dpu": run["dpu"], "keep_freed_memory": run["keep_freed_memory"],
                         "overlap_epochs": run["overlap_epochs"], "max_in_flight": run["max_in_flight"]}
                  for name, run in swarms.items()}
    shown = swarm_config(config, dpu=swarm.get("dpu", args.dpu[-1]),  # the swarm whose tables are shown
                         overlap=swarm.get("overlap_epochs", "off"), codec=swarm.get("averaging_codec"))
    causes = profile_causes(profiled["profile"], profiled["roles"]) if profiled and profiled.get("profile") else None
    split = planes(causes, profiled, rpc, args.warmup) if causes else None
    text = markdown(args, command, info, shown, timings, single, swarm, analysis, rpc, codecs, control, swarm_runs,
                    profiled, causes, split)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "dataplane.md").write_text(text)
    swarm_json = {k: v for k, v in swarm.items() if k != "boundaries"}
    swarm_json["boundaries"] = {kind: {str(s): {str(e): t for e, t in v.items()} for s, v in per.items()}
                                for kind, per in swarm.get("boundaries", {}).items()}
    (out_dir / "dataplane.json").write_text(json.dumps({
        "command": command, "machine": info, "recipe": {"model": config.model, "num_stages": config.num_stages,
        "batch_rows": config.rows_per_microbatch, "microbatches": config.microbatches, "seq_len": config.seq_len,
        "epochs": args.epochs, "warmup": args.warmup, "lr": config.lr, "weight_decay": config.weight_decay},
        "stage_timings": timings, "single_process": single, "swarm": swarm_json, "analysis": analysis,
        "swarm_runs": {name: {"analysis": swarm_runs[name], "report": run.get("report"), "error": run.get("error"),
                              "calls_training": run.get("calls_training"), "calls_idle": run.get("calls_idle")}
                       for name, run in swarms.items()},
        "rpc": rpc, "codecs": codecs, "dht_control": control,
        "profile": None if profiled is None else {
            "error": profiled.get("error"), "workdir": profiled.get("workdir"), "raw": profiled.get("profile"),
            "by_cause": causes, "planes": split},
    }, indent=2, default=str))
    print(text)
    log(f"wrote {out_dir / 'dataplane.md'} and {out_dir / 'dataplane.json'} in {info['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
