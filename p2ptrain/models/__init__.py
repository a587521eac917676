"""Models behind one interface: torch-free configs and presets (`configs`), and a registry from a config's family
to its `StageModel` implementation (`base.StageModel`), imported only when a stage is built.

    from p2ptrain.models import build_stage, model_config
    stage = build_stage(model_config("llama-tiny"), start=0, end=2, seed=0)
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from p2ptrain.models.configs import MODEL_CONFIGS, AlbertConfig, LlamaConfig, ModelConfig, model_config

if TYPE_CHECKING:
    from p2ptrain.models.base import StageModel

# family -> "module:class" of its StageModel; a family without an entry can be planned but not trained
STAGE_MODELS: dict[str, str] = {"llama": "p2ptrain.models.llama:LlamaStage"}

# the presets a swarm can train
TRAINABLE: tuple[str, ...] = tuple(name for name, config in MODEL_CONFIGS.items() if config.family in STAGE_MODELS)

__all__ = ["MODEL_CONFIGS", "STAGE_MODELS", "TRAINABLE", "AlbertConfig", "LlamaConfig", "ModelConfig",
           "build_stage", "model_config", "stage_model_class"]


def stage_model_class(config: ModelConfig) -> type[StageModel]:
    if config.family not in STAGE_MODELS:
        raise ValueError(f"no stage implementation of the {config.family} family yet; trainable presets: "
                         f"{', '.join(TRAINABLE)}")
    module, name = STAGE_MODELS[config.family].split(":")
    return getattr(importlib.import_module(module), name)


def build_stage(config: ModelConfig, *, start: int, end: int, seed: int = 0) -> StageModel:
    """Layers [start, end) of the model, with the weights every peer builds for them from `seed`."""
    return stage_model_class(config)(config, start=start, end=end, seed=seed)
