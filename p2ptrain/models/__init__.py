"""Models behind one interface: torch-free configs and presets (`configs`), and a registry from a config's family
to its `StageModel` implementation (`base.StageModel`), imported only when a stage is built.

    from p2ptrain.models import build_stage, model_config
    stage = build_stage(model_config("llama-tiny"), start=0, end=2, seed=0)

`from_pretrained` and `export` (of `hf`) read and write local Hugging Face checkpoints; they load torch and
safetensors when first used.
"""
from __future__ import annotations

from p2ptrain.models.configs import MODEL_CONFIGS, AlbertConfig, LlamaConfig, ModelConfig, model_config
from p2ptrain.models.registry import STAGE_MODELS, TRAINABLE, build_stage, stage_model_class

__all__ = ["MODEL_CONFIGS", "STAGE_MODELS", "TRAINABLE", "AlbertConfig", "LlamaConfig", "ModelConfig",
           "build_stage", "export", "from_pretrained", "model_config", "stage_model_class"]


def __getattr__(name: str) -> object:
    if name in ("from_pretrained", "export"):
        from p2ptrain.models import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
