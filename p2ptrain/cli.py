"""What the command lines share: argparse value types that refuse bad numbers and missing files with a message
naming the flag (argparse exits 2), the flags of the run's recipe, and turning a config's refusal into one."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from p2ptrain.config import CODECS, FAULT_POLICIES, ConfigError, RunConfig, check_run_id
from p2ptrain.models import TRAINABLE

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


def run_id(text: str) -> str:
    try:
        check_run_id(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e.problem}") from None
    return text


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
                "seed": "--seed", "lr": "--lr", "weight_decay": "--weight-decay", "compression": "--compression",
                "data": "--data", "fault_policy": "--fault-policy", "stage": "--stage"}


def add_recipe_flags(parser: argparse.ArgumentParser, *, defaults: RunConfig = RunConfig()) -> None:
    """The flags every peer of a run must give alike (DESIGN §5)."""
    recipe = parser.add_argument_group("recipe (the same on every peer)")
    recipe.add_argument("--run-id", type=run_id, default=defaults.run_id, help="prefix of this swarm's DHT keys")
    recipe.add_argument("--model", default=defaults.model, choices=TRAINABLE)
    recipe.add_argument("--num-stages", type=count, default=defaults.num_stages)
    recipe.add_argument("--batch-rows", type=count, default=defaults.rows_per_microbatch,
                        help="rows (sequences) per microbatch")
    recipe.add_argument("--microbatches", type=count, default=defaults.microbatches,
                        help="microbatches per global batch (epoch)")
    recipe.add_argument("--seq-len", type=count, default=defaults.seq_len)
    recipe.add_argument("--seed", type=index, default=defaults.seed)
    recipe.add_argument("--lr", type=positive, default=defaults.lr)
    recipe.add_argument("--weight-decay", type=non_negative, default=defaults.weight_decay,
                        help="AdamW weight decay of matrices and embeddings")
    recipe.add_argument("--compression", choices=CODECS, default=defaults.compression,
                        help="codec for activations and gradients")
    recipe.add_argument("--data", help="a local text file to train on (default: the embedded corpus)")
    recipe.add_argument("--fault-policy", choices=FAULT_POLICIES, default=defaults.fault_policy,
                        help="rows whose gradients a vanished worker took: 'taskpool' redoes them at their stage from "
                             "the inputs its FS keeps; 'swarm' drops them and feeds their microbatches again from "
                             "stage 0 in a later epoch, as SWARM does (for comparison)")


def recipe_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunConfig:
    with refusing(parser, RECIPE_FLAGS):
        return RunConfig(run_id=args.run_id, model=args.model, num_stages=args.num_stages,
                         rows_per_microbatch=args.batch_rows, microbatches=args.microbatches, seq_len=args.seq_len,
                         seed=args.seed, lr=args.lr, weight_decay=args.weight_decay, compression=args.compression,
                         data=args.data, fault_policy=args.fault_policy)


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
