"""p2ptrain: train large transformers across the internet on volunteer devices, with parameter servers inside every
pipeline stage, over hivemind.

    import asyncio
    from p2ptrain import NodeOptions, Peer, Placement, RunConfig

    config = RunConfig(model="llama-tiny", num_stages=2)
    peer = Peer(config=config, options=NodeOptions(role="client", placement=Placement(
        stage=0, server_role=None, layers=config.stage_layers(0), num_stages=2)))

The heavy parts (torch, hivemind) load on first use of `Peer`, so `import p2ptrain.planner` and the command lines'
`--help` stay fast.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.protocol.layout import Placement

if TYPE_CHECKING:
    from p2ptrain.node.options import NetworkOptions, NodeOptions, PlannerOptions, PlanningOptions
    from p2ptrain.node.peer import Peer

_LAZY = {"Peer": "p2ptrain.node.peer", "NodeOptions": "p2ptrain.node.options",
         "NetworkOptions": "p2ptrain.node.options", "PlanningOptions": "p2ptrain.node.options",
         "PlannerOptions": "p2ptrain.node.options"}

__all__ = ["NetworkOptions", "NodeOptions", "Peer", "Placement", "PlannerOptions", "PlanningOptions", "RunConfig",
           "RuntimeConfig"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
