"""What the command lines share: argparse value types that refuse bad numbers and missing files with a message
naming the flag (argparse exits 2), the flags of the run's recipe, and turning a config's refusal into one."""
from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from p2ptrain.config import (
    AVERAGING_CODECS,
    CODECS,
    FAULT_POLICIES,
    OPTIMIZERS,
    PRECISIONS,
    ConfigError,
    RunConfig,
    RuntimeConfig,
    check_device,
    check_run_id,
)
from p2ptrain.models import TRAINABLE
from p2ptrain.models.hf_config import checkpoint_name

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _checked(kind: type, ok: Callable[[float], bool], problem: str) -> Callable[[str], int | float]:
    """An argparse type: a finite number of `kind` for which `ok` holds, else an error saying `problem`."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text}: {problem}")
        return value
    return parse


count = _checked(int, lambda value: value >= 1, "must be at least 1")
index = _checked(int, lambda value: value >= 0, "must be 0 or more")
positive = _checked(float, lambda value: value > 0, "must be positive")
non_negative = _checked(float, lambda value: value >= 0, "must be 0 or more")
fraction = _checked(float, lambda value: 0 <= value < 1, "must be in [0, 1)")


def _config_checked(check: Callable[[str], None]) -> Callable[[str], str]:
    """An argparse type that takes a string `check` accepts (it raises a ConfigError saying what to fix)."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(f"{text}: {e.problem}") from None
        return text
    return parse


run_id = _config_checked(check_run_id)
device_name = _config_checked(check_device)  # auto, cpu, cuda or cuda:N


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def writable_file(text: str) -> Path:
    """A file to be written: its folder must exist."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {path.parent} does not exist")
    return path


# RunConfig fields and the flags that set them
RECIPE_FLAGS = {"run_id": "--run-id", "model": "--model", "num_stages": "--num-stages",
                "rows_per_microbatch": "--batch-rows", "microbatches": "--microbatches", "seq_len": "--seq-len",
                "seed": "--seed", "optimizer": "--optimizer", "lr": "--lr", "warmup_epochs": "--warmup-epochs",
                "decay_epochs": "--decay-epochs", "min_lr": "--min-lr", "weight_decay": "--weight-decay",
                "clip_norm": "--clip-norm", "dpu": "--dpu", "dpu_lookahead": "--dpu-lookahead",
                "overlap_epochs": "--overlap-epochs", "precision": "--precision",
                "loss_scale": "--loss-scale", "loss_scale_growth": "--loss-scale-growth",
                "offload_optimizer": "--offload-optimizer",
                "averaging_codec": "--averaging-codec",
                "average_every": "--average-every", "outer_lr": "--outer-lr", "outer_momentum": "--outer-momentum",
                "compression": "--compression", "data": "--data",
                "tokenizer": "--tokenizer", "init_from": "--init-from",
                "fault_policy": "--fault-policy", "stage": "--stage"}
OPTIMIZATION_FIELDS = ("optimizer", "lr", "warmup_epochs", "decay_epochs", "min_lr", "weight_decay", "clip_norm", "dpu",
                       "dpu_lookahead", "overlap_epochs", "precision", "loss_scale", "loss_scale_growth", "offload_optimizer", "averaging_codec",
                       "average_every", "outer_lr", "outer_momentum")
SWITCH = {"on": True, "off": False}
# the on/off fields of OPTIMIZATION_FIELDS (None where the flag is absent and the field decides its default)
SWITCHES = ("dpu", "dpu_lookahead", "overlap_epochs", "offload_optimizer")


def flag_value(value: object) -> str:
    """A config value as its flag takes it: switches as on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_optimization_flags(parser: argparse.ArgumentParser, *, defaults: RunConfig = RunConfig()) -> None:
    """How every stage steps: the optimizer, its learning-rate schedule keyed on the global epoch, clipping and
    delayed parameter updates (part of the recipe)."""
    group = parser.add_argument_group("optimization (the same on every peer)")
    group.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer,
                       help="AdamW; AdamW with 8-bit state (bitsandbytes: about a quarter of AdamW's state); or LAMB "
                            "(bitsandbytes, 32-bit); all with weight decay on matrices only")
    group.add_argument("--lr", type=positive, default=defaults.lr, help="peak learning rate, after the warm-up")
    group.add_argument("--warmup-epochs", type=index, default=defaults.warmup_epochs,
                       help="epochs of linear warm-up to --lr")
    group.add_argument("--decay-epochs", type=index, default=defaults.decay_epochs,
                       help="the epoch where the cosine decay after the warm-up reaches --min-lr (0: no decay)")
    group.add_argument("--min-lr", type=non_negative, default=defaults.min_lr,
                       help="the learning rate the cosine decay ends at")
    group.add_argument("--weight-decay", type=non_negative, default=defaults.weight_decay,
                       help="weight decay of matrices and embeddings")
    group.add_argument("--clip-norm", type=non_negative, default=defaults.clip_norm,
                       help="clip the gradient by its global norm across all stages (0: no clipping)")
    group.add_argument("--dpu", choices=tuple(SWITCH),
                       help="delayed parameter updates: average and step in the background while the next epoch "
                            "computes on the previous parameters (default: on, except with --precision fp16 or "
                            "--average-every above 1, which they do not work with)")
    group.add_argument("--dpu-lookahead", choices=tuple(SWITCH), default=flag_value(defaults.dpu_lookahead),
                       help="with --dpu on: each worker computes the next epoch where a step on its stage's mean "
                            "gradient (from the server holding the stage's deposits) would take the stage, instead "
                            "of on the parameters before the step in flight; the stage still steps on the round's "
                            "average")
    group.add_argument("--overlap-epochs", choices=tuple(SWITCH), default=flag_value(defaults.overlap_epochs),
                       help="with --dpu on: no drain at the epoch boundary; the data source feeds the next epoch while "
                            "the last microbatches of this one are still in backward, and workers with nothing left of "
                            "this epoch compute the next one's on the parameters delayed updates give it")
    group.add_argument("--precision", choices=PRECISIONS, default=defaults.precision,
                       help="what the stages compute in: fp32, or bf16 or fp16 under autocast (fp16 with a dynamic "
                            "loss scale); master weights, optimizer state and the wire stay fp32 either way")
    group.add_argument("--loss-scale", type=positive, default=defaults.loss_scale,
                       help="fp16: the loss scale the run starts at; it halves after an epoch whose gradients "
                            "overflowed, which every stage skips")
    group.add_argument("--loss-scale-growth", type=count, default=defaults.loss_scale_growth, metavar="EPOCHS",
                       help="fp16: the loss scale doubles after this many epochs in a row without overflow")
    group.add_argument("--offload-optimizer", choices=tuple(SWITCH), nargs="?", const="on",
                       default=flag_value(defaults.offload_optimizer),
                       help="keep the master weights, accumulated gradients and optimizer state in host memory "
                            "(ZeRO-Offload), only the weights computed with on the device")
    group.add_argument("--averaging-codec", choices=tuple(AVERAGING_CODECS), default=defaults.averaging_codec,
                       help="how each stage's all-reduce sends its gradients: fp32 (exact), fp16, or int8 (blockwise, "
                            "bitsandbytes; about a quarter of fp32's bytes); every member ends with the same average")
    group.add_argument("--average-every", type=count, default=defaults.average_every, metavar="H",
                       help="average each stage once every H epochs (DiLoCo): each worker steps on its own gradients "
                            "meanwhile, and the round averages how far they moved, for an outer SGD step with Nesterov "
                            "momentum (1: average the gradients at every epoch)")
    group.add_argument("--outer-lr", type=positive, default=defaults.outer_lr,
                       help="the outer step's learning rate (with --average-every > 1)")
    group.add_argument("--outer-momentum", type=fraction, default=defaults.outer_momentum,
                       help="the outer step's Nesterov momentum, in [0, 1) (with --average-every > 1)")


def add_compute_flags(group: argparse._ActionsContainer, *, whose: str) -> None:
    """Where `whose` compute and whether they recompute activations: each peer's own choices, not the recipe's."""
    group.add_argument("--device", type=device_name, default="auto", metavar="auto|cpu|cuda|cuda:N",
                       help=f"the device of {whose}: where the stage computes and its parameters and optimizer "
                            "state live (auto: the first CUDA device when there is one, else the CPU); tensors travel "
                            "from the host")
    group.add_argument("--recompute", action="store_true",
                       help=f"activation checkpointing for {whose}: keep each block's input only while a microbatch "
                            "is in flight and compute the block again in backward (less memory, a third more "
                            "compute)")


def compute_args(args: argparse.Namespace) -> list[str]:
    """The flags of `add_compute_flags` as parsed, for the peers a launcher starts."""
    return ["--device", args.device, *(["--recompute"] if args.recompute else [])]


def optimization_from(args: argparse.Namespace) -> dict[str, object]:
    """The RunConfig fields of `add_optimization_flags`."""
    return {name: SWITCH.get(getattr(args, name)) if name in SWITCHES else getattr(args, name)
            for name in OPTIMIZATION_FIELDS}


# RuntimeConfig fields of the deadlines (docs/design.md §5) and the flags that set them; a peer's own, not the recipe's
DEADLINE_FLAGS = {"rpc_timeout_s": "--rpc-timeout", "averaging_timeout_s": "--averaging-timeout",
                  "lease_timeout_s": "--lease-timeout", "worker_lost_s": "--worker-lost",
                  "server_lost_s": "--server-lost", "slowest_uplink_mbit": "--slowest-uplink-mbit",
                  "deadline_slack": "--deadline-slack"}


def add_deadline_flags(parser: argparse.ArgumentParser) -> None:
    """The floors of the waits that judge a peer gone or a transfer lost; each adds the time the bytes in flight
    need at the rate measured on the link (docs/design.md §5, "Deadlines that follow the link")."""
    defaults = RuntimeConfig()
    group = parser.add_argument_group("deadlines (floors; each adds the bytes' time at the link's measured rate)")
    group.add_argument("--rpc-timeout", type=positive, default=defaults.rpc_timeout_s,
                       help="seconds a call may wait beyond its request's transfer time, and between chunks of its "
                            "reply")
    group.add_argument("--averaging-timeout", type=positive, default=defaults.averaging_timeout_s,
                       help="seconds an all-reduce round may take beyond its bytes' time, or a groupmate send "
                            "nothing; an FS counts a worker gone whose gradient deposit sent nothing this long")
    group.add_argument("--lease-timeout", type=positive, default=defaults.lease_timeout_s,
                       help="seconds a task stays with a worker not timed yet, beyond its activations' time at "
                            "--slowest-uplink-mbit; a timed worker's leases follow its measured speed, up to that")
    group.add_argument("--worker-lost", type=positive, default=defaults.worker_lost_s,
                       help="seconds without a poll, a result or any bytes of a worker after which a server counts it "
                            "gone and has its work redone")
    group.add_argument("--server-lost", type=positive, default=defaults.server_lost_s,
                       help="seconds a stage server may not answer before it counts as lost: the data source abandons "
                            "the open epoch and lays the next one out without it (a restarted server is noticed at "
                            "once), and workers stop waiting for it to close an epoch")
    group.add_argument("--slowest-uplink-mbit", type=positive, default=defaults.slowest_uplink_mbit,
                       help="the rate a link is assumed to have until a transfer on it was timed")
    group.add_argument("--deadline-slack", type=positive, default=defaults.deadline_slack,
                       help="how many times the bytes' time at the measured rate a deadline allows")


def deadlines_from(args: argparse.Namespace) -> dict[str, float]:
    """The RuntimeConfig fields of `add_deadline_flags`."""
    return {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in DEADLINE_FLAGS.items()}


def deadline_args(args: argparse.Namespace) -> list[str]:
    """`add_deadline_flags`' values as a peer's command line takes them."""
    return [item for name, value in deadlines_from(args).items() for item in (DEADLINE_FLAGS[name], str(value))]


def add_recipe_flags(parser: argparse.ArgumentParser, *, defaults: RunConfig = RunConfig()) -> None:
    """The flags every peer of a run must give alike (docs/design.md §5)."""
    recipe = parser.add_argument_group("recipe (the same on every peer)")
    recipe.add_argument("--run-id", type=run_id, default=defaults.run_id, help="prefix of this swarm's DHT keys")
    recipe.add_argument("--model", choices=TRAINABLE, help=f"a preset (default: {defaults.model}, or the checkpoint's "
                                                           "model with --init-from)")
    recipe.add_argument("--num-stages", type=count, default=defaults.num_stages)
    recipe.add_argument("--batch-rows", type=count, default=defaults.rows_per_microbatch,
                        help="rows (sequences) per microbatch")
    recipe.add_argument("--microbatches", type=count, default=defaults.microbatches,
                        help="microbatches per global batch (epoch)")
    recipe.add_argument("--seq-len", type=count, default=defaults.seq_len)
    recipe.add_argument("--seed", type=index, default=defaults.seed)
    recipe.add_argument("--compression", choices=CODECS, default=defaults.compression,
                        help="codec for activations and gradients")
    recipe.add_argument("--data", help="what to train on: a local UTF-8 text file, a folder of .txt files, or a "
                                       "datasets folder written by save_to_disk (its text column) (default: the "
                                       "embedded corpus)")
    recipe.add_argument("--tokenizer", metavar="PATH",
                        help="a local Hugging Face tokenizer.json, or a transformers tokenizer folder, to tokenize the "
                             "text with; the model's vocabulary takes its size (default: byte-level tokens, 256)")
    recipe.add_argument("--init-from", metavar="PATH",
                        help="start from a local Hugging Face checkpoint directory (config.json and safetensors): the "
                             "model is its config.json's; a client without a copy downloads its stage's state from a "
                             "stage mate")
    recipe.add_argument("--fault-policy", choices=FAULT_POLICIES, default=defaults.fault_policy,
                        help="rows whose gradients a vanished worker took: 'taskpool' redoes them at their stage from "
                             "the inputs its FS keeps; 'swarm' drops them and feeds their microbatches again from "
                             "stage 0 in a later epoch, as SWARM does (for comparison)")
    add_optimization_flags(parser, defaults=defaults)


def recipe_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunConfig:
    with refusing(parser, RECIPE_FLAGS):
        return RunConfig(run_id=args.run_id, model=model_name(parser, args), num_stages=args.num_stages,
                         rows_per_microbatch=args.batch_rows, microbatches=args.microbatches, seq_len=args.seq_len,
                         seed=args.seed, compression=args.compression, data=args.data, tokenizer=args.tokenizer,
                         init_from=args.init_from, fault_policy=args.fault_policy, **optimization_from(args))


def model_name(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """--model, or with --init-from the checkpoint directory's name (its config.json is the model)."""
    if args.init_from is None:
        return args.model or RunConfig.model
    if args.model is not None:
        fail(parser, "--model", args.model, "--init-from takes the model from the checkpoint's config.json; drop "
                                            "--model")
    return checkpoint_name(args.init_from)


def recipe_args(config: RunConfig) -> list[str]:
    """The recipe flags that give a peer, or the launcher, `config`'s model, batch, codec, data, tokenizer and
    optimization (its run id and stages go apart: the launcher names them otherwise)."""
    model = ["--init-from", config.init_from] if config.init_from else ["--model", config.model]
    return [*model, "--batch-rows", str(config.rows_per_microbatch), "--microbatches", str(config.microbatches),
            "--seq-len", str(config.seq_len), "--compression", config.compression,
            *(["--data", config.data] if config.data else []),
            *(["--tokenizer", config.tokenizer] if config.tokenizer else []),
            *(item for name in OPTIMIZATION_FIELDS for item in (RECIPE_FLAGS[name], flag_value(getattr(config, name))))]


def given_recipe(parser: argparse.ArgumentParser, args: argparse.Namespace, config: RunConfig,
                 argv: list[str] | None) -> dict[str, object]:
    """The RunConfig fields whose flags the command line `argv` gives (a value equal to the default counts: it was
    asked for), with their values in `config`."""
    shadow = copy.deepcopy(parser)
    for action in shadow._actions:  # parse again with no defaults: what is left was typed
        action.default = argparse.SUPPRESS
    typed = vars(shadow.parse_args(argv))
    dests = {name: flag[2:].replace("-", "_") for name, flag in RECIPE_FLAGS.items()}
    return {name: getattr(config, name) for name, dest in dests.items()
            if dest in typed and hasattr(config, name) and hasattr(args, dest)}


@contextmanager
def refusing(parser: argparse.ArgumentParser, flags: dict[str, str]) -> Iterator[None]:
    """Within it, a ConfigError ends the command line with exit 2 and a message naming the flag of its field."""
    try:
        yield
    except ConfigError as error:
        fail(parser, flags.get(error.field, error.field), error.value, error.problem)


def fail(parser: argparse.ArgumentParser, flag: str, value: object, problem: str) -> NoReturn:
    parser.error(f"{flag} {value}: {problem}")


def check_maddrs(parser: argparse.ArgumentParser, flag: str, values: list[str] | None) -> None:
    """Refuse a malformed multiaddr before anything starts (hivemind's parser; hivemind loads here)."""
    from hivemind.utils.multiaddr import Multiaddr

    for value in values or []:
        try:
            Multiaddr(value)
        except Exception as e:
            fail(parser, flag, value, f"not a multiaddr ({e}); e.g. /ip4/127.0.0.1/tcp/31337/p2p/PEER_ID")
