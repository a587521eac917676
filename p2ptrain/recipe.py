"""The run's recipe as the swarm carries it, so that a volunteer needs the swarm's address and nothing else.

The stage-0 FS publishes its recipe in the DHT (`dht.records.RecipeRecord`, signed with its key; readers take the
data source's); a peer started with no recipe flags adopts it, and a peer given a flag that disagrees with it is
refused, naming the flag and both values (`adopt`).

The model travels as its whole config (vocabulary included), so a peer needs neither the preset, the tokenizer nor
the checkpoint the run starts from; the data, the tokenizer and that checkpoint travel as fingerprints (sha256 of
their bytes), so a peer given its own copy is checked against the run's (and a worker with none downloads its
stage's state from a mate). Pure: no network, no torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2ptrain.config import ConfigError, RunConfig
from p2ptrain.models.configs import ModelConfig, config_from_dict, config_to_dict

# RunConfig fields a peer brings from where it runs, not from the recipe: its own copies of the files
LOCAL_FIELDS = ("data", "tokenizer", "init_from")


class RecipeConflict(ConfigError):
    """A value given to a peer that differs from the swarm's recipe."""

    def __init__(self, field: str, given: object, carried: object):
        super().__init__(field, given, f"the swarm's recipe has {carried}; leave the flag out to take the swarm's, or "
                                       "join the run it belongs to")
        self.carried = carried


@dataclass(frozen=True, kw_only=True)
class Recipe:
    config: RunConfig  # with the model's whole config as its architecture, and no paths (LOCAL_FIELDS)
    data: str | None  # fingerprint of the data (None: the embedded corpus)
    tokenizer: str | None  # fingerprint of the tokenizer (None: byte-level tokens)
    init_from: str | None  # fingerprint of the checkpoint the run starts from (None: the seed's weights)

    @classmethod
    def of(cls, config: RunConfig) -> Recipe:
        return cls(config=dataclasses.replace(config, architecture=config.model_config,
                                              **dict.fromkeys(LOCAL_FIELDS)),
                   data=fingerprint(config.data) if config.data is not None else None,
                   tokenizer=fingerprint(config.tokenizer) if config.tokenizer is not None else None,
                   init_from=fingerprint(config.init_from) if config.init_from is not None else None)

    @property
    def model(self) -> ModelConfig:
        return self.config.model_config

    def to_value(self) -> dict[str, Any]:
        fields = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(RunConfig)
                  if f.name not in ("architecture", *LOCAL_FIELDS)}
        return {"config": fields, "model": config_to_dict(self.model), "data": self.data, "tokenizer": self.tokenizer,
                "init_from": self.init_from}

    @classmethod
    def from_value(cls, value: Mapping[str, Any]) -> Recipe:
        """The recipe of a `to_value` dict; a ValueError (a ConfigError for a value no peer may run) if it is not
        one."""
        try:
            fields = {name: v for name, v in value["config"].items() if name not in LOCAL_FIELDS}
            config = RunConfig(**fields, architecture=config_from_dict(value["model"]))
            return cls(config=config, data=value["data"], tokenizer=value["tokenizer"], init_from=value["init_from"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a recipe: {e!r}") from None

    def describe(self) -> str:
        c = self.config
        return (f"{c.model} ({self.model.family}, {self.model.num_layers} layers"
                f"{', from a checkpoint' if self.init_from else ''}) in {c.num_stages} stages, "
                f"{c.microbatches} x {c.rows_per_microbatch} rows of {c.seq_len} tokens, {c.optimizer} lr {c.lr}")


def adopt(recipe: Recipe, given: Mapping[str, object]) -> RunConfig:
    """This peer's config: the recipe's, with the values it was `given` (RunConfig field -> value) checked against
    it. A given data file, tokenizer or checkpoint must have the recipe's fingerprint (the peer then uses its own
    copy); any other given value must equal the recipe's. RecipeConflict names the first that does not."""
    carried = recipe.config
    for field, value in given.items():
        if field in LOCAL_FIELDS:
            if value is not None and fingerprint(str(value)) != getattr(recipe, field):
                raise RecipeConflict(field, value, f"another {field} (sha256 {getattr(recipe, field)})"
                                     if getattr(recipe, field) else f"no {field} (the default)")
        elif value != getattr(carried, field):
            raise RecipeConflict(field, value, getattr(carried, field))
    local = {field: given.get(field) for field in LOCAL_FIELDS}
    return dataclasses.replace(carried, **local)


def fingerprint(path: str) -> str:
    """sha256 of a file's bytes, or of a folder's files (each one's path within it, then its bytes, in path
    order), so the same data has the same fingerprint wherever it lies."""
    where = Path(path)
    digest = hashlib.sha256()
    files = sorted(f for f in where.rglob("*") if f.is_file()) if where.is_dir() else [where]
    for file in files:
        if where.is_dir():
            digest.update(file.relative_to(where).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
