"""The command line of the recipe scripts (`recipes/llama.py`): one model family's run, three ways.

    python recipes/llama.py                                   # a local swarm trains the tiny model, with progress
    python recipes/llama.py --size small --data text.txt --epochs 50 --lr 1e-3 --warmup-epochs 5
    python recipes/llama.py --init-from path/to/llama --export-to path/to/trained   # fine-tune a local checkpoint
    python recipes/llama.py --size llama-33b --plan peers/paper-sec43-32.toml      # how a swarm file would run it
    python recipes/llama.py --size small --print-commands --initial-peers ADDR     # the commands across machines

The model of every way is the same config (`models.MODEL_CONFIGS`, or the checkpoint's config.json): the local
swarm trains it, the planner prices it (`planner.presets.config_spec`), and the printed commands carry it.
"""
from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.cli import (
    RECIPE_FLAGS,
    add_compute_flags,
    add_optimization_flags,
    check_maddrs,
    compute_args,
    count,
    existing_file,
    optimization_from,
    recipe_args,
    refusing,
    run_id,
)
from p2ptrain.config import CODECS, RunConfig
from p2ptrain.models.hf_config import checkpoint_name

BOOTSTRAP_PORT = 31337  # the port the printed bootstrap command listens on


@dataclass(frozen=True, kw_only=True)
class Family:
    """What a recipe script fixes: its family's sizes (size -> preset of `models.MODEL_CONFIGS`), the sizes a
    local swarm on one machine can train, and the recipe's defaults."""

    name: str
    description: str  # the script's --help
    sizes: dict[str, str]  # the first is the default; the last, the paper's, is for planning
    local_sizes: tuple[str, ...]
    defaults: RunConfig = field(default_factory=RunConfig)


def build_parser(family: Family) -> argparse.ArgumentParser:
    defaults = family.defaults
    parser = argparse.ArgumentParser(prog=f"python recipes/{family.name}.py", description=family.description,
                                     epilog=examples(family),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to do (default: train in a local swarm on this machine)")
    modes = what.add_mutually_exclusive_group()
    modes.add_argument("--plan", type=existing_file, metavar="SWARMFILE",
                       help="print how the planner places this model on the devices of a swarm file (peers/*.toml)")
    modes.add_argument("--print-commands", action="store_true",
                       help="print the commands that run this recipe across machines: a bootstrap peer, the servers "
                            "of every stage and the volunteers")
    model = parser.add_argument_group("model")
    model.add_argument("--size", choices=tuple(family.sizes), default=next(iter(family.sizes)),
                       help=f"the model's size; {', '.join(s for s in family.sizes if s not in family.local_sizes)} "
                            "for --plan and --print-commands (too large for one machine)")
    model.add_argument("--init-from", metavar="PATH",
                       help="start from a local Hugging Face checkpoint directory instead (its config.json is the "
                            "model; --size goes unused)")
    model.add_argument("--export-to", type=Path, metavar="PATH",
                       help="at the end, write the trained model here as a Hugging Face checkpoint")
    data = parser.add_argument_group("data and batch")
    data.add_argument("--data", help="a local text file, a folder of .txt files or a datasets folder (save_to_disk) "
                                     "(default: the embedded corpus)")
    data.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer.json or transformers tokenizer folder "
                                                          "(default: byte-level tokens)")
    data.add_argument("--eval-data", type=existing_file, help="a held-out text file to evaluate on while training")
    data.add_argument("--seq-len", type=count, default=defaults.seq_len, help="tokens per row")
    data.add_argument("--batch-rows", type=count, default=defaults.rows_per_microbatch,
                      help="rows per microbatch")
    data.add_argument("--microbatches", type=count, default=defaults.microbatches,
                      help="microbatches per global batch (epoch)")
    run = parser.add_argument_group("run")
    run.add_argument("--epochs", type=count, default=30, help="global batches to train")
    run.add_argument("--stages", type=count, help=f"pipeline stages (default: {defaults.num_stages}; with --plan, "
                                                  "the planner's choice)")
    run.add_argument("--compression", choices=CODECS, default=defaults.compression,
                     help="codec of activations and gradients between stages")
    run.add_argument("--run-id", type=run_id, default=f"{family.name}-recipe", help="prefix of the swarm's DHT keys")
    run.add_argument("--peers", type=existing_file, metavar="SWARMFILE",
                     help="the local swarm's devices (default: peers/local.toml)")
    run.add_argument("--workdir", type=Path, help="where the local swarm's logs go (default: a temporary folder)")
    add_compute_flags(run, whose="the local swarm's peers")
    run.add_argument("--initial-peers", nargs="+", metavar="ADDR",
                     help="with --print-commands: the bootstrap peer's multiaddr (default: a placeholder)")
    add_optimization_flags(parser, defaults=defaults)
    parser.set_defaults(decay_epochs=None)  # as the launcher: decay over the whole run unless told otherwise
    return parser


def examples(family: Family) -> str:
    """The module doc's examples, for `family`."""
    big = list(family.sizes)[-1]
    lines = [line.replace("llama-33b", big).replace("llama", family.name) for line in __doc__.splitlines()
             if line.startswith("    python")]
    return "examples:\n" + "\n".join(lines)


def main(family: Family, argv: Sequence[str] | None = None) -> int:
    parser = build_parser(family)
    args = parser.parse_args(argv)
    if args.initial_peers is not None and not args.print_commands:
        parser.error("--initial-peers goes with --print-commands")
    check_maddrs(parser, "--initial-peers", args.initial_peers)
    if args.decay_epochs is None:
        args.decay_epochs = args.epochs if args.epochs > args.warmup_epochs else 0
    config = run_config(parser, args, family)
    if args.plan is not None:
        return plan(args, config)
    if args.print_commands:
        print(commands(args, config))
        return 0
    if args.init_from is None and args.size not in family.local_sizes:
        parser.error(f"--size {args.size}: too large to train on one machine; use it with --plan or "
                     "--print-commands, or train a smaller size here")
    from p2ptrain import launch

    launch.main(launch_args(args, config))
    return 0


def run_config(parser: argparse.ArgumentParser, args: argparse.Namespace, family: Family) -> RunConfig:
    """The run's recipe, checked before anything starts (exit 2 naming the flag)."""
    with refusing(parser, {**RECIPE_FLAGS, "num_stages": "--stages"}):
        return RunConfig(run_id=args.run_id, model=family.sizes[args.size] if args.init_from is None
                         else checkpoint_name(args.init_from), num_stages=args.stages or family.defaults.num_stages,
                         rows_per_microbatch=args.batch_rows, microbatches=args.microbatches, seq_len=args.seq_len,
                         compression=args.compression, data=args.data, tokenizer=args.tokenizer,
                         init_from=args.init_from, **optimization_from(args))


def launch_args(args: argparse.Namespace, config: RunConfig) -> list[str]:
    """`python -m p2ptrain.launch`'s arguments for this recipe on this machine."""
    return [*([str(args.peers)] if args.peers else []), *recipe_args(config), "--stages", str(config.num_stages),
            "--epochs", str(args.epochs), "--run-id", config.run_id, *compute_args(args),
            *(["--eval-data", str(args.eval_data)] if args.eval_data else []),
            *(["--export-to", str(args.export_to)] if args.export_to else []),
            *(["--workdir", str(args.workdir)] if args.workdir else [])]


def memory_args(config: RunConfig) -> list[str]:
    """The run's memory choices that differ from the defaults, for the planner; the swarm file's [model] says how
    its devices run otherwise (the paper's files: fp16 with the optimizer offloaded)."""
    defaults = RunConfig()
    return [*(["--precision", config.precision] if config.precision != defaults.precision else []),
            *(["--optimizer", config.optimizer] if config.optimizer != defaults.optimizer else []),
            *(["--offload", "optimizer"] if config.offload_optimizer else [])]


def plan(args: argparse.Namespace, config: RunConfig) -> int:
    """`python -m p2ptrain.plan` for this recipe's model and batch on the swarm file."""
    from p2ptrain.plan import main as plan_main

    model = ["--model-config", config.init_from] if config.init_from else ["--model", config.model]
    return plan_main([str(args.plan), *model, "--batch-tokens", str(config.tokens_per_epoch),
                      "--microbatches", str(config.microbatches), "--averaging-codec", config.averaging_codec,
                      *memory_args(config),
                      "--average-every", str(config.average_every),
                      *(["--stages", str(args.stages)] if args.stages else [])])


def commands(args: argparse.Namespace, config: RunConfig) -> str:
    """The shell commands of a run across machines. Only the data source (the stage-0 FS) is given the recipe: it
    publishes it, and every other peer takes it from the swarm (servers that hold a stage's state of a run that
    starts from a checkpoint bring their own copy of it)."""
    peer = ["python", "-m", "p2ptrain.peer"]
    address = args.initial_peers or ["BOOTSTRAP_ADDR"]
    joins = ["--initial-peers", *address]
    checkpoint = ["--init-from", config.init_from] if config.init_from else []
    lines = ["# 1. A bootstrap peer on a machine every peer can reach; it writes its address to bootstrap.addr",
             shlex.join([*peer, "--role", "bootstrap", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{BOOTSTRAP_PORT}",
                         "--identity-path", "bootstrap.key", "--maddrs-file", "bootstrap.addr"]),
             "", f"# 2. The servers, on reliable machines: an FS and a BS per stage ({config.num_stages} stages). The "
                 "stage-0 FS is the data source: it holds the recipe and publishes it",
             shlex.join([*peer, "--role", "server", "--stage", "0", "--server-role", "fs", *joins,
                         "--run-id", config.run_id, *recipe_args(config), "--num-stages", str(config.num_stages),
                         "--epochs", str(args.epochs),
                         *(["--export-to", str(args.export_to)] if args.export_to else []),
                         "--checkpoint-dir", "checkpoints/fs0"])]
    for stage in range(config.num_stages):
        if stage:
            lines.append(shlex.join([*peer, "--role", "server", "--stage", str(stage), "--server-role", "fs", *joins,
                                     "--run-id", config.run_id, *checkpoint, "--checkpoint-dir",
                                     f"checkpoints/fs{stage}"]))
        lines.append(shlex.join([*peer, "--role", "server", "--stage", str(stage), "--server-role", "bs", *joins,
                                 "--run-id", config.run_id]))
    lines += ["", "# 3. Volunteers, as many as come, anywhere (behind NAT: add --client-mode); each probes the stages "
                  "and picks one",
              shlex.join([*peer, "--role", "client", *joins])]
    return "\n".join(lines)
