"""A local Hugging Face checkpoint directory and its config.json, read without torch: the run's config takes its
model from a checkpoint (`--init-from`) in processes that never build a stage."""
from __future__ import annotations

import json
import re
from pathlib import Path

from p2ptrain.models.configs import FAMILIES, ModelConfig


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


def checkpoint_name(path: str | Path) -> str:
    """A checkpoint's model named after its folder (of a config.json file given, the file's folder)."""
    where = Path(path).resolve()
    return where.parent.name if where.is_file() else where.name


def read_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint directory's config.json, or of a config.json file itself."""
    file = Path(path) if Path(path).is_file() else checkpoint_dir(path) / "config.json"
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
