"""Hugging Face interchange: pipeline stages from a local `transformers` checkpoint directory, and stages back to one.

    stages = from_pretrained("path/to/llama", num_stages=2)
    logits = stages[1](stages[0](token_ids))
    export(stages, "path/to/trained")  # transformers.AutoModelForCausalLM (ALBERT: ForMaskedLM) loads it

A checkpoint is a directory with config.json and safetensors weights (one model.safetensors, or shards listed in
model.safetensors.index.json). Nothing is fetched from a hub. Each family names its parameters' checkpoint keys
(`StageModel.hf_names`) and reads and writes its config (`from_hf`, `to_hf` of its config class).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from p2ptrain.models.base import StageModel
from p2ptrain.models.configs import ModelConfig, even_split
from p2ptrain.models.hf_config import CheckpointError, checkpoint_dir, read_config
from p2ptrain.models.registry import build_stage

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def from_pretrained(path: str | Path, *, num_stages: int = 1, bounds: Sequence[tuple[int, int]] | None = None,
                    config: ModelConfig | None = None) -> list[StageModel]:
    """The stage modules of a local checkpoint: `num_stages` even splits of its layers, or the given layer
    `bounds`; `config` overrides what config.json says (the same architecture, e.g. a longer max_seq_len)."""
    directory = checkpoint_dir(path)
    config = config or read_config(directory)
    bounds = list(bounds) if bounds is not None else even_split(config.num_layers, num_stages)
    stages = [build_stage(config, start=start, end=end) for start, end in bounds]
    with _Weights(directory) as weights:
        for stage in stages:
            load_stage(stage, weights)
    return stages


def load_stage(stage: StageModel, weights: _Weights) -> None:
    names = stage.hf_names()
    for name, param in stage.named_parameters():
        key = names[name]
        tensor = weights.get(key)
        if tensor.shape != param.shape:
            raise CheckpointError(f"{weights.directory}: {key} has shape {tuple(tensor.shape)}, the config's model "
                                  f"needs {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)


def load_pretrained(stage: StageModel, path: str | Path) -> None:
    """Load `stage`'s parameters from a local checkpoint whose config is the stage's."""
    with _Weights(checkpoint_dir(path)) as weights:
        load_stage(stage, weights)


def export(stages: Sequence[StageModel], path: str | Path, *, extra_files: Sequence[str | Path] = ()) -> Path:
    """Writes stages that together cover the model's layers as a transformers checkpoint directory (config.json,
    model.safetensors in fp32) and copies `extra_files` (e.g. tokenizer files) into it."""
    if not stages:
        raise ValueError("no stages to export")
    writer = ExportWriter(path, stages[0].config, num_shards=1, extra_files=extra_files)
    writer.add(*sorted(stages, key=lambda stage: stage.start))
    return writer.close()


class ExportWriter:
    """Writes a transformers checkpoint directory a shard at a time, so that exporting a large model holds one
    stage of it in memory: `add` writes the next stages' tensors as one shard (a single shard is model.safetensors,
    several are listed in model.safetensors.index.json), `close` writes the index and then config.json, last, so that
    a directory with a config.json is whole. A tensor that several stages hold (tied embeddings, ALBERT's shared
    blocks) is written once, by the first, and every other copy must equal it."""

    def __init__(self, path: str | Path, config: ModelConfig, *, num_shards: int,
                 extra_files: Sequence[str | Path] = ()):
        self.directory, self.config, self.num_shards = Path(path), config, num_shards
        self.extra_files = [Path(file) for file in extra_files]
        self.weight_map: dict[str, str] = {}
        self.digests: dict[str, str] = {}  # sha256 of each written tensor's bytes, to check the other copies against
        self.layers = 0  # layers [0, layers) are written
        self.shards = 0
        self.total_size = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in (WEIGHTS, WEIGHTS_INDEX, "config.json", *(f.name for f in self.directory.glob("model-*-of-*"))):
            (self.directory / stale).unlink(missing_ok=True)  # what an earlier export left would be read with it

    def add(self, *stages: StageModel) -> None:
        """Write `stages` (the next layers in order) as the next shard."""
        if self.shards >= self.num_shards:
            raise ValueError(f"all {self.num_shards} shards are written")
        tensors: dict[str, torch.Tensor] = {}
        for stage in stages:
            if stage.config != self.config or stage.start != self.layers:
                raise ValueError(f"a stage of layers [{stage.start}, {stage.end}) after layers [0, {self.layers}) "
                                 "written: export needs the stages of one model, in order, covering each layer once")
            names = stage.hf_names()
            for name, param in stage.named_parameters():
                key = names[name]
                value = param.detach().to(torch.float32).contiguous()
                digest = hashlib.sha256(value.numpy().tobytes()).hexdigest()
                if self.digests.setdefault(key, digest) != digest:
                    raise ValueError(f"the copies of {key} differ between stages; shared weights must be kept equal")
                if key not in self.weight_map and key not in tensors:
                    tensors[key] = value.clone()
            self.layers = stage.end
        self.shards += 1
        name = WEIGHTS if self.num_shards == 1 else f"model-{self.shards:05d}-of-{self.num_shards:05d}.safetensors"
        if tensors:  # a stage whose tensors earlier stages wrote (a middle stage of ALBERT's shared block) has none
            save_file(tensors, str(self.directory / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.total_size += sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> Path:
        """Write the index (several shards), the extra files and config.json; the directory."""
        if self.layers != self.config.num_layers or self.shards != self.num_shards:
            raise ValueError(f"{self.shards} of {self.num_shards} shards with layers [0, {self.layers}) of "
                             f"{self.config.num_layers} written: export needs every layer")
        if self.num_shards > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for file in self.extra_files:
            (self.directory / file.name).write_bytes(file.read_bytes())
        (self.directory / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2) + "\n")
        return self.directory


class _Weights:
    """The tensors of a checkpoint's safetensors files, opened once and read by key."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / WEIGHTS_INDEX
        if index.is_file():
            try:
                weight_map: dict[str, Any] = json.loads(index.read_text())["weight_map"]
            except (OSError, KeyError, ValueError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            self.files = {key: directory / name for key, name in weight_map.items()}
        elif (directory / WEIGHTS).is_file():
            self.files = {}
        else:
            found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
            raise CheckpointError(f"{directory}: no {WEIGHTS} or {WEIGHTS_INDEX} (found {found}); save the model "
                                  "with safetensors (transformers' default, save_pretrained(safe_serialization=True))")
        self.handles: dict[Path, Any] = {}

    def __enter__(self) -> _Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handles.clear()

    def get(self, key: str) -> torch.Tensor:
        file = self.files.get(key, self.directory / WEIGHTS)
        if file not in self.handles:
            try:
                self.handles[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a damaged file
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
        handle = self.handles[file]
        if key not in handle.keys():
            raise CheckpointError(f"{self.directory}: the checkpoint has no tensor {key}, which the config's model "
                                  "needs")
        return handle.get_tensor(key)
