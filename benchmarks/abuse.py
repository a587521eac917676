"""Abuse benchmark: what one peer's flood of bad requests costs a server, per 1,000 requests.

    python benchmarks/abuse.py [--requests 1000] [--out DIR]

A real stage-0 FS (`python -m p2ptrain.peer`, beside a bootstrap peer, on 127.0.0.1), and in this process an
outsider with its own DHT node and p2p daemon, which sends the FS, one request after another:
- refused: --requests well-formed rows that the server reads, decodes and refuses (a microbatch past the run's: a
  plain refusal, which no honest peer's race can be told from, so it never counts towards a ban);
- malformed: --requests requests that do not decode; the first 32 are read and refused as offences, which bans the
  outsider (`p2ptrain/protocol/bans.py`); the rest are refused unread.
For each: wall time, and the CPU seconds of the server's processes (its main process, its DHT process and its p2p
daemon, from /proc), per 1,000 requests. Writes benchmarks/results/abuse.md and .json (or the same in --out DIR).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import LocalSwarm, command_line, cpu_window, log, machine_info, snapshot

from p2ptrain.config import RunConfig
from p2ptrain.dht import start_dht
from p2ptrain.protocol.bans import BanList
from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.messages import FRONTAL_SERVER, PushRows
from p2ptrain.protocol.rows import Rows
from p2ptrain.transport import REFUSED, Caller, Envelope

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = RunConfig(run_id="abuse", num_stages=2, rows_per_microbatch=4, microbatches=2, seq_len=32)


async def flood(caller: Caller, fs: str, *, requests: int, malformed: bool) -> tuple[int, int]:
    """Send `requests` requests to `fs` one after another; (refusals, of which "banned ...")."""
    rows = torch.zeros(CONFIG.rows_per_microbatch, CONFIG.seq_len, dtype=torch.int64)
    layout = Layout((StageServers(fs=(fs,), bs=(fs,)), StageServers(fs=(fs,), bs=(fs,))))
    refused = banned = 0
    for i in range(requests):
        if malformed:
            envelope = Envelope({"epoch": "not a number", "junk": i})
        else:
            request = PushRows(epoch=i, microbatch=CONFIG.microbatches, rows=Rows(0, CONFIG.rows_per_microbatch),
                               total_rows=CONFIG.rows_per_microbatch, layout=layout, inputs=rows, labels=rows)
            envelope = Envelope(request.to_header(), request.tensors())
        reply = await caller.exchange(fs, FRONTAL_SERVER, PushRows.method, envelope)
        reason = reply.header.get(REFUSED)
        refused += reason is not None
        banned += reason is not None and reason.startswith("banned")
    return refused, banned


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="requests per kind")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-abuse-"))
    phases = {}
    with LocalSwarm(workdir, CONFIG, epochs=1) as swarm:
        swarm.start_bootstrap()
        name = swarm.start_server(0, "fs")
        swarm.connect()
        deadline = time.monotonic() + 180
        while not (stages := swarm.status()["stages"]) or not stages[0]["fs"]:
            if time.monotonic() > deadline or swarm.failed():
                raise RuntimeError(f"the FS did not come up; see {workdir}")
            time.sleep(1.0)
        fs = stages[0]["fs"][0]
        dht = start_dht(CONFIG.run_id, initial_peers=swarm.initial_peers, client_mode=True)
        try:
            async def outsider() -> None:
                p2p = await dht.replicate_p2p()
                me = dht.peer_id.to_base58()
                try:
                    caller = Caller(p2p=p2p, peer_id=me, codec="none", timeout=30.0)
                    for kind in ("refused", "malformed"):
                        log(f"{args.requests} {kind} requests to {name}")
                        first, began = snapshot(), time.monotonic()
                        refused, banned = await flood(caller, fs, requests=args.requests, malformed=kind == "malformed")
                        wall, last = time.monotonic() - began, snapshot()
                        window = cpu_window(first, last, swarm.roots())
                        server_s = sum(cores for key, cores in window["cores"].items()
                                       if key.startswith(f"{name}/")) * window["wall_s"]
                        per = 1000 / args.requests
                        phases[kind] = {"requests": args.requests, "refused": refused, "refused_unread": banned,
                                        "wall_s_per_1000": wall * per, "server_cpu_s_per_1000": server_s * per,
                                        "server_cpu_by_process": {key.split("/")[1]: cores * window["wall_s"] * per
                                                                  for key, cores in window["cores"].items()
                                                                  if key.startswith(f"{name}/")}}
                        log(f"  {refused} refused ({banned} unread): {wall * per:.2f} s and {server_s * per:.2f} "
                            f"server CPU s per 1,000")
                finally:
                    await p2p.shutdown()

            asyncio.run(outsider())
        finally:
            dht.shutdown()
        if swarm.failed():
            raise RuntimeError(f"peers {swarm.failed()} exited during the flood; see {workdir}")
    shutil.rmtree(workdir, ignore_errors=True)
    result = {"command": command_line(__file__, argv), "machine": machine_info(), "ban_after": BanList().offences,
              "phases": phases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "abuse.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# What a flood costs a server\n", f"`{result['command']}`\n",
             "| requests | refused | refused unread (banned) | wall s per 1,000 | server CPU s per 1,000 |",
             "|---|---|---|---|---|"]
    for kind, phase in phases.items():
        lines.append(f"| {phase['requests']} {kind} | {phase['refused']} | {phase['refused_unread']} | "
                     f"{phase['wall_s_per_1000']:.2f} | {phase['server_cpu_s_per_1000']:.2f} |")
    (args.out / "abuse.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
