"""Hugging Face interchange: pipeline stages from a local `transformers` checkpoint directory, and stages back to one.

    stages = from_pretrained("path/to/llama", num_stages=2)
    logits = stages[1](stages[0](token_ids))
    export(stages, "path/to/trained")  # transformers.AutoModelForCausalLM (ALBERT: ForMaskedLM) loads it

A checkpoint is a directory with config.json and safetensors weights (one model.safetensors, or shards listed in
model.safetensors.index.json). Nothing is fetched from a hub. Each family names its parameters' checkpoint keys
(`StageModel.hf_names`) and reads and writes its config (`from_hf`, `to_hf` of its config class).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from p2ptrain.models.base import StageModel
from p2ptrain.models.configs import FAMILIES, ModelConfig, even_split
from p2ptrain.models.registry import build_stage

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read, with what to fix."""


def checkpoint_dir(path: str | Path) -> Path:
    """`path` as a local checkpoint directory; a name that looks like a hub id is refused with what to do."""
    directory = Path(path)
    if directory.is_dir():
        return directory
    if not directory.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not str(path).startswith("."):
        raise CheckpointError(f"{path}: no such directory. It looks like a Hugging Face hub name; p2ptrain downloads "
                              "nothing: download the checkpoint (e.g. `huggingface-cli download "
                              f"{path} --local-dir DIR`) and pass the local directory")
    raise CheckpointError(f"{path}: not a directory; pass a local transformers checkpoint directory (config.json and "
                          "model.safetensors)")


def read_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint directory's config.json."""
    file = checkpoint_dir(path) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; a transformers checkpoint directory has a config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable JSON config ({e})") from None
    model_type = hf.get("model_type") if isinstance(hf, dict) else None  # transformers names the families alike
    if model_type not in FAMILIES:
        raise CheckpointError(f"{file}: model_type {model_type!r} is not supported; p2ptrain trains "
                              f"{', '.join(FAMILIES)}")
    try:
        return FAMILIES[model_type].from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e if not isinstance(e, KeyError) else f'{e} is missing'}") from None


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


def export(stages: Sequence[StageModel], path: str | Path, *, extra_files: Sequence[str | Path] = ()) -> Path:
    """Writes stages that together cover the model's layers as a transformers checkpoint directory (config.json,
    model.safetensors in fp32) and copies `extra_files` (e.g. tokenizer files) into it."""
    if not stages:
        raise ValueError("no stages to export")
    config = stages[0].config
    ordered = sorted(stages, key=lambda stage: stage.start)
    covered = [(stage.start, stage.end) for stage in ordered]
    if any(stage.config != config for stage in ordered) or covered[0][0] != 0 or covered[-1][1] != config.num_layers \
            or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise ValueError(f"the stages hold layers {covered} of different or incomplete models; export needs stages "
                         f"of one model that cover layers 0..{config.num_layers} once")
    tensors: dict[str, torch.Tensor] = {}
    for stage in ordered:
        names = stage.hf_names()
        for name, param in stage.named_parameters():
            key = names[name]
            value = param.detach().to(torch.float32).contiguous()
            if key in tensors and not torch.equal(tensors[key], value):
                raise ValueError(f"the copies of {key} differ between stages; shared weights must be kept equal")
            tensors.setdefault(key, value.clone())
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    for file in map(Path, extra_files):
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


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
