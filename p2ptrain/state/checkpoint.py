"""A server's checkpoints of its stage: the parameters and optimizer state it holds, the epoch they are current for
and the data position, in a folder of its own (`--checkpoint-dir`).

A checkpoint of epoch E is two files: ``state-E.safetensors``, the tensors exactly as a stage mate downloads them
(`state.codec`'s blob: ``model/<name>`` and ``optimizer/<index>/<name>``, the optimizer's other entries in
the safetensors metadata), and ``manifest-E.json``, which names that file and says what it holds:

    {"format": 1, "run_id": ..., "recipe": {model, num_stages, seq_len, rows_per_microbatch, microbatches, seed,
     optimizer}, "stage": S, "layers": [start, end], "role": "fs" | "bs", "epoch": E, "batch": B,
     "tensors": "state-E.safetensors", "bytes": n, "sha256": hex}

`epoch` is the next epoch the stage computes (its parameters have stepped through E - 1); `batch` the last global
batch of data the swarm trained on (-1 where this server is not told: a BS). Saving is atomic: each file goes to a
temporary file that is synced and renamed, the tensors first; the manifest is the commit point, so a crash leaves
the earlier checkpoints whole. The newest `KEPT` checkpoints stay, older ones are removed.

Loading checks everything before it touches the model: a manifest that does not parse, another run, recipe, stage or
layer range, a tensor file of the wrong size or hash (truncated, corrupt), or tensors that do not fit the stage raise
`CheckpointError`, whose text names the file and what differs. When the newest checkpoint is refused, an older valid
one is loaded instead, and the log says which and why; with none valid, the newest one's error is raised.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2ptrain.config import RunConfig
from p2ptrain.state.codec import StateMismatch, encode_state
from p2ptrain.state.params import StageParams

logger = logging.getLogger(__name__)

FORMAT = 1
KEPT = 2  # checkpoints kept in a folder: the newest, and one to fall back to if it is damaged
_MANIFEST = re.compile(r"manifest-(\d+)\.json")
RECIPE_FIELDS = ("model", "num_stages", "seq_len", "rows_per_microbatch", "microbatches", "seed", "optimizer")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the text names the file and what is wrong."""


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """What a loaded checkpoint restores beside the tensors."""

    epoch: int
    batch: int
    path: Path


def recipe_of(config: RunConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in RECIPE_FIELDS}


def save_checkpoint(folder: Path, *, config: RunConfig, stage: int, layers: tuple[int, int], role: str, epoch: int,
                    batch: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> Path:
    """Write a checkpoint into `folder` atomically (module doc) and remove those older than the newest `KEPT`; the
    manifest's path. The states must be copies no one steps meanwhile (`StageParams.snapshot`)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = encode_state(model_state, optimizer_state).numpy().tobytes()
    name = f"state-{epoch}.safetensors"
    _write_atomically(folder / name, data)
    manifest = {"format": FORMAT, "run_id": config.run_id, "recipe": recipe_of(config), "stage": stage,
                "layers": list(layers), "role": role, "epoch": epoch, "batch": batch, "tensors": name,
                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path = folder / f"manifest-{epoch}.json"
    _write_atomically(path, (json.dumps(manifest, indent=1) + "\n").encode())
    for old_epoch, old in manifests(folder)[KEPT:]:
        old.unlink(missing_ok=True)
        (folder / f"state-{old_epoch}.safetensors").unlink(missing_ok=True)
    return path


def manifests(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints' manifests in `folder` as (epoch, path), newest first."""
    found = [(int(match.group(1)), path) for path in folder.glob("manifest-*.json")
             if (match := _MANIFEST.fullmatch(path.name))]
    return sorted(found, reverse=True)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power loss once its folder is synced
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_checkpoint(folder: Path, *, config: RunConfig, stage: int, layers: tuple[int, int], params: StageParams
                    ) -> tuple[Checkpoint, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest valid checkpoint in `folder`, checked against this run, stage and layers, with its model and
    optimizer state (checked against `params`, which it does not touch); None if the folder holds none. Raises the newest checkpoint's `CheckpointError` if none is valid."""
    found = manifests(folder) if folder.is_dir() else []
    refused: list[CheckpointError] = []
    for _, path in found:
        try:
            loaded = _load(path, config=config, stage=stage, layers=layers, params=params)
        except CheckpointError as e:
            logger.error(f"checkpoint refused: {e}")
            refused.append(e)
            continue
        if refused:
            logger.warning(f"loading the older checkpoint {path} instead of the refused {found[0][1]}")
        return loaded
    if refused:
        raise refused[0]
    return None


def _load(path: Path, *, config: RunConfig, stage: int, layers: tuple[int, int], params: StageParams
          ) -> tuple[Checkpoint, dict[str, torch.Tensor], dict[str, Any]]:
    try:
        manifest = json.loads(path.read_text())
        epoch, batch, tensors = int(manifest["epoch"]), int(manifest["batch"]), str(manifest["tensors"])
        size, digest, version = int(manifest["bytes"]), str(manifest["sha256"]), manifest["format"]
        saved_run, saved_recipe = manifest["run_id"], manifest["recipe"]
        saved_stage, saved_layers = manifest["stage"], manifest["layers"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a checkpoint manifest ({e!r})") from None
    if version != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {version}, this version reads format {FORMAT}")
    if saved_run != config.run_id:
        raise CheckpointError(f"{path}: saved by run {saved_run!r}, this is run {config.run_id!r}")
    for name, value in recipe_of(config).items():
        if saved_recipe.get(name) != value:
            raise CheckpointError(f"{path}: saved with {name} = {saved_recipe.get(name)!r}, this run has {value!r}")
    if saved_stage != stage or list(saved_layers) != list(layers):
        raise CheckpointError(f"{path}: holds stage {saved_stage} layers {saved_layers}, this server serves stage "
                              f"{stage} layers {list(layers)}")
    tensor_path = path.parent / Path(tensors).name
    try:
        data = tensor_path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{tensor_path}: cannot be read ({e.strerror}); {path} names it") from None
    if len(data) != size:
        raise CheckpointError(f"{tensor_path}: {len(data)} bytes, the manifest says {size} (truncated?)")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{tensor_path}: its SHA-256 differs from the manifest's (corrupt)")
    try:
        model_state, optimizer_state = params.decode(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except StateMismatch as e:
        raise CheckpointError(f"{tensor_path}: {e}") from None
    return Checkpoint(epoch=epoch, batch=batch, path=path), model_state, optimizer_state
