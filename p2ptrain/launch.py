"""`python -m p2ptrain.launch [peers/local.toml]`: the main job. Starts a whole swarm on this machine, one real
process per peer on 127.0.0.1 (a bootstrap node, then the FS and BS of every stage and the clients, placed by
the planner from the swarm file), shows training progress, and stops every process at the end or on Ctrl-C.

Every option is checked, and the swarm planned, before any process starts: a bad option exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from p2ptrain import links
from p2ptrain.cli import (
    LOOPBACK,
    RECIPE_FLAGS,
    add_compute_flags,
    add_deadline_flags,
    add_optimization_flags,
    compute_args,
    count,
    deadline_args,
    existing_file,
    model_name,
    optimization_from,
    positive,
    recipe_args,
    refusing,
    run_id,
)
from p2ptrain.config import CODECS, RunConfig
from p2ptrain.models import TRAINABLE
from p2ptrain.planner import PlanningError, make_plan
from p2ptrain.planner.presets import run_spec
from p2ptrain.planner.swarmfile import SwarmFileError, load_swarm

DEFAULT_PEERS = Path(__file__).resolve().parent.parent / "peers" / "local.toml"


@dataclass
class Swarm:
    """The processes of a local swarm; `stop` ends them all (SIGTERM, then SIGKILL after a grace period).

    Behind emulated links (`p2ptrain.links`) each peer listens on an address of its own, so it has an uplink of its
    own: its `--host-maddrs` on 127.0.0.1 is moved there (a peer started again under its name keeps its address)."""

    workdir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    initial_peers: list[str] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)  # peer name -> its own address, behind emulated links
    own_addresses: bool = field(default_factory=lambda: links.inside() is not None)

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        if self.own_addresses:
            address = self.addresses.setdefault(name, links.peer_address(len(self.addresses)))
            args = [arg.replace("/ip4/127.0.0.1/", f"/ip4/{address}/") if before == "--host-maddrs" else arg
                    for before, arg in zip([None, *args], args)]
        log = open(self.workdir / f"{name}.log", "w")
        process = subprocess.Popen([sys.executable, "-m", "p2ptrain.peer", *args], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def start_bootstrap(self, run_id: str, timeout: float = 180.0) -> list[str]:
        maddrs = self.workdir / "bootstrap.maddrs"
        maddrs.unlink(missing_ok=True)  # a file left by an earlier swarm would point at a dead peer
        self.start("bootstrap", ["--role", "bootstrap", "--run-id", run_id, "--host-maddrs", LOOPBACK,
                                 "--maddrs-file", str(maddrs)])
        deadline = time.monotonic() + timeout
        while not (maddrs.exists() and maddrs.read_text().strip()):
            if time.monotonic() > deadline or self.processes["bootstrap"].poll() is not None:
                raise RuntimeError(f"the bootstrap peer did not come up; see {self.workdir / 'bootstrap.log'}")
            time.sleep(0.1)
        self.initial_peers = maddrs.read_text().split()
        return self.initial_peers

    def failed(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() not in (None, 0)]

    def wire_bytes(self) -> dict[str, int]:
        """Behind emulated links: the bytes each peer has put on its uplink, headers and the DHT included; else {}."""
        if not self.addresses:
            return {}
        sent = links.bytes_sent()
        return {name: sent.get(address, 0) for name, address in self.addresses.items()}

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to each peer, which shuts its DHT and p2p daemon down; then SIGKILL to whatever is left of its
        process group (daemons included), so nothing outlives the swarm."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def peer_commands(plan: dict, common: list[str], *, client_mode: bool = False,
                  source: Sequence[str] = ()) -> dict[str, list[str]]:
    """One `p2ptrain.peer` command line per device the plan places; the plan's layer ranges go along. With
    `client_mode`, the volunteers (clients) dial out only, as behind NAT; the stage-0 FS, the data source, takes
    `source` too."""
    commands = {}
    num_stages = len(plan["stages"])
    for stage, entry in enumerate(plan["stages"]):
        layers = f"{entry['layers'][0]}:{entry['layers'][1]}"
        base = [*common, "--num-stages", str(num_stages), "--stage", str(stage), "--layers", layers]
        for device in entry["fs"]:
            commands[device] = [*base, "--role", "server", "--server-role", "fs", *(source if stage == 0 else ())]
        for device in entry["bs"]:
            commands[device] = [*base, "--role", "server", "--server-role", "bs"]
        for device in entry["clients"]:
            commands[device] = [*base, "--role", "client", *(["--client-mode"] if client_mode else [])]
    return commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peers", nargs="?", default=str(DEFAULT_PEERS), help="swarm file (default: peers/local.toml)")
    parser.add_argument("--epochs", type=count, default=30, help="global batches to train")
    parser.add_argument("--stages", type=count, default=2, help="pipeline stages (the planner places the devices)")
    parser.add_argument("--model", choices=TRAINABLE,
                        help="a preset (default: llama-tiny, or the checkpoint's model with --init-from)")
    parser.add_argument("--init-from", metavar="PATH",
                        help="start from a local Hugging Face checkpoint directory (config.json and safetensors)")
    parser.add_argument("--seq-len", type=count, default=64)
    parser.add_argument("--batch-rows", type=count,
                        help="rows per microbatch (default: the swarm file's [batch] tokens over --microbatches x "
                             "--seq-len)")
    parser.add_argument("--microbatches", type=count, help="microbatches per global batch (default: the swarm "
                                                           "file's [batch], else 4)")
    parser.add_argument("--compression", choices=CODECS, default="none")
    parser.add_argument("--data", help="a local text file, a folder of .txt files or a datasets folder (save_to_disk) "
                                       "(default: the embedded corpus)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a local Hugging Face tokenizer.json or transformers tokenizer folder (default: "
                             "byte-level tokens)")
    parser.add_argument("--eval-data", type=existing_file,
                        help="a held-out text file: the swarm's held-out loss is computed on it through the stages "
                             "and shown beside the training loss")
    parser.add_argument("--eval-every", type=count, default=5, help="with --eval-data: every this many epochs")
    parser.add_argument("--run-id", type=run_id, default="p2ptrain-local")
    parser.add_argument("--workdir", type=Path, help="where the peers' logs go (default: a temporary directory)")
    parser.add_argument("--timeout", type=positive, default=1800.0, help="give up after this many seconds")
    parser.add_argument("--client-mode-volunteers", action="store_true",
                        help="the volunteers (clients) run with --client-mode, dialing out only as behind NAT; the "
                             "servers, reachable, reduce their stages' averaging rounds")
    parser.add_argument("--export-to", type=Path, metavar="PATH",
                        help="at the end, write the trained model into this folder as a Hugging Face checkpoint "
                             "(config.json, safetensors) that transformers loads")
    add_compute_flags(parser, whose="every peer")
    parser.add_argument("--report", type=Path, metavar="PATH",
                        help="write the swarm's last status report (JSON, as `python -m p2ptrain.status --json`) here")
    emulated = parser.add_argument_group("emulated links (python -m p2ptrain.links; root, ip and tc)")
    emulated.add_argument("--uplink-mbit", type=positive,
                          help="run the swarm in a network namespace of its own where every peer has its own "
                               "address and an uplink capped at this many Mbit/s")
    emulated.add_argument("--delay-ms", type=float, default=0.0, help="with --uplink-mbit: added to every packet")
    add_optimization_flags(parser)
    add_deadline_flags(parser)
    parser.set_defaults(decay_epochs=None)  # the launcher knows the run's length: decay over all of it by default
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.uplink_mbit is not None and links.inside() is None:
        behind_links(parser, args, sys.argv[1:] if argv is None else argv)
    try:
        swarm_file = load_swarm(args.peers)
    except SwarmFileError as e:
        parser.error(str(e))
    microbatches = args.microbatches or swarm_file.microbatches or 4
    batch_tokens = swarm_file.batch_tokens or 4096
    rows = args.batch_rows or batch_tokens // (microbatches * args.seq_len)
    if rows < 1:
        parser.error(f"{args.peers}: [batch] tokens = {batch_tokens} is less than one row per microbatch "
                     f"of --seq-len {args.seq_len}; raise it, lower --seq-len or give --batch-rows")
    tokens = rows * microbatches * args.seq_len
    if args.decay_epochs is None:
        args.decay_epochs = args.epochs if args.epochs > args.warmup_epochs else 0
    with refusing(parser, {**RECIPE_FLAGS, "num_stages": "--stages"}):  # what every peer will check, checked first
        config = RunConfig(run_id=args.run_id, model=model_name(parser, args), num_stages=args.stages,
                           rows_per_microbatch=rows, microbatches=microbatches, seq_len=args.seq_len,
                           compression=args.compression, data=args.data, tokenizer=args.tokenizer,
                           init_from=args.init_from, **optimization_from(args))
    for flag, folder in (("--workdir", args.workdir), ("--export-to", args.export_to)):
        if folder is not None and folder.exists() and not folder.is_dir():
            parser.error(f"{flag} {folder}: is a file; give a folder")
    try:
        plan = make_plan(swarm_file, run_spec(config),
                         batch_tokens=tokens, microbatches=microbatches, planner="refined",
                         stages=args.stages, average_every=config.average_every).to_json()
    except PlanningError as e:
        parser.error(f"{args.peers}: {e}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="p2ptrain-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # the status reader's DHT needs torch and hivemind: load them before the first peer starts, so that a Ctrl-C
    # soon after the swarm is up finds this process watching it, not importing
    importlib.import_module("p2ptrain.dht")
    common = ["--run-id", config.run_id, *recipe_args(config), "--epochs", str(args.epochs), "--host-maddrs", LOOPBACK,
              *compute_args(args),
              *(["--eval-data", str(args.eval_data), "--eval-every", str(args.eval_every)] if args.eval_data else []),
              *deadline_args(args)]
    swarm = Swarm(workdir=workdir)
    interrupted = False
    pressed = take_ctrl_c()
    try:
        initial = swarm.start_bootstrap(args.run_id)
        source = ["--export-to", str(args.export_to.resolve())] if args.export_to else []
        for device, command in peer_commands(plan, common, client_mode=args.client_mode_volunteers,
                                             source=source).items():
            swarm.start(device, [*command, "--initial-peers", *initial])
        print(f"swarm of {len(swarm.processes)} processes, logs in {workdir}", file=sys.stderr)
        for stage, entry in enumerate(plan["stages"]):
            start, end = entry["layers"]
            print(f"  stage {stage} layers [{start}, {end}): FS {entry['fs']} BS {entry['bs']} "
                  f"clients {entry['clients']}" + (" (client mode)" if args.client_mode_volunteers else ""),
                  file=sys.stderr)
        report = watch(swarm, args, initial, pressed)
        if swarm.own_addresses:
            report["wire_bytes_sent"] = swarm.wire_bytes()
    except KeyboardInterrupt:
        interrupted = True
        report = None
    finally:
        swarm.stop()
    if interrupted:
        print("interrupted: all peers stopped", file=sys.stderr)
        sys.exit(130)
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1))
    losses = [e["loss"] for e in report["epochs"] if e["loss"] is not None]
    if losses:
        print(f"trained {len(losses)} epochs: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if args.export_to is not None:
        print(f"exported the trained model to {args.export_to}")


def behind_links(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Run this launch again in a network namespace of its own behind emulated links (never returns)."""
    try:
        caps = links.Links(uplink_mbit=args.uplink_mbit, delay_ms=args.delay_ms)
    except ValueError as e:
        parser.error(f"--uplink-mbit {args.uplink_mbit} --delay-ms {args.delay_ms}: {e}")
    try:
        links.exec_behind(caps, [sys.executable, "-m", "p2ptrain.launch", *argv])
    except links.Unavailable as e:
        parser.error(f"--uplink-mbit: {e}")


def take_ctrl_c() -> threading.Event:
    """Ctrl-C raises KeyboardInterrupt in this process whatever it inherited (an ignored or blocked SIGINT), and sets
    the event it returns, which the progress loop checks too: a KeyboardInterrupt that a library call on the way
    swallowed still stops the swarm. (The launcher was seen, in a loaded test run, going on for 90 s after a
    Ctrl-C with its main thread in the progress loop; the cause was not found.)"""
    pressed = threading.Event()

    def on_ctrl_c(signum: int, frame: object) -> None:
        pressed.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return pressed


def watch(swarm: Swarm, args: argparse.Namespace, initial: list[str], pressed: threading.Event) -> dict:
    """Follow the swarm through the DHT with a progress bar until the data source finishes, or Ctrl-C."""
    from p2ptrain.dht import start_dht, stop_dht
    from p2ptrain.status import History, collect

    dht = start_dht(args.run_id, initial_peers=initial, client_mode=True)
    history = History()  # the summary at the end covers every epoch, not only those the records still carry
    deadline = time.monotonic() + args.timeout
    try:
        with tqdm(total=args.epochs, unit="epoch", desc="training") as bar:
            while True:
                if pressed.is_set():
                    raise KeyboardInterrupt
                failed = swarm.failed()
                if failed:
                    raise RuntimeError(f"peers {failed} exited with an error; see their logs in {swarm.workdir}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"training did not finish in {args.timeout:.0f} s; logs in {swarm.workdir}")
                report = collect(dht, args.run_id, history=history)
                bar.n = report["epoch"] + 1
                if report["loss"] is not None:
                    held_out = {"eval": f"{report['eval_loss']:.3f}"} if report["eval_loss"] is not None else {}
                    bar.set_postfix(loss=f"{report['loss']:.3f}", **held_out,
                                    tok_s=f"{report['tokens_per_s'] or 0:.0f}")
                bar.refresh()
                if report["finished"] and report["epoch"] + 1 >= args.epochs:
                    return report
                time.sleep(1.0)
    finally:
        stop_dht(dht)


if __name__ == "__main__":
    main()
