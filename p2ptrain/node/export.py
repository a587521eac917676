"""The swarm's model as a Hugging Face checkpoint directory (`--export-to`): every stage's state, downloaded from the
peers that hold it as a joining worker downloads it (`client.state_sync`), written a stage at a time
(`models.hf.ExportWriter`), so that the exporting peer holds one stage in memory.

The data source exports once its last epoch closed, before the run counts as finished; every stage must serve the
state after that epoch's step, so that the stages written together are of one model.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import hivemind
import torch

from p2ptrain.client.state_sync import load_state_from_peers
from p2ptrain.config import RunConfig
from p2ptrain.dht.readers import get_stage_members, state_holders
from p2ptrain.live.authority import Owner
from p2ptrain.models import build_stage
from p2ptrain.models.hf import ExportWriter
from p2ptrain.state.params import StageParams
from p2ptrain.transport import Caller

logger = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """A stage whose state no holder served, or stages that are not of one epoch."""


class StageCopy:
    """A stage that computes nothing, for `load_state_from_peers` to load a holder's state into."""

    def __init__(self, *, asker: str, stage: int, layers: tuple[int, int], config: RunConfig, epoch: int):
        start, end = layers
        self.worker_id, self.stage, self.epoch = asker, stage, epoch
        self.model = build_stage(config.model_config, start=start, end=end, seed=config.seed)
        self.master = StageParams(model=self.model, config=config)

    def load_state(self, *, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], epoch: int) -> None:
        self.master.load(model_state=model_state, optimizer_state=optimizer_state, epoch=epoch)


async def export_swarm(*, dht: hivemind.DHT, caller: Caller, config: RunConfig, epoch: int, path: Path,
                       owner: Owner | None = None) -> Path:
    """Write the swarm's model, as it stands once every stage stepped on the epochs before `epoch`, into `path`
    (a transformers checkpoint directory, with the run's tokenizer file beside it if it has one)."""
    extra = [config.tokenizer] if config.tokenizer is not None and Path(config.tokenizer).is_file() else []
    writer = ExportWriter(path, config.model_config, num_shards=config.num_stages, extra_files=extra)
    for stage in range(config.num_stages):
        members = await asyncio.to_thread(get_stage_members, dht, config.run_id, stage, owner=owner)
        servers, mates = state_holders(members)
        # the layers its holders announce (a plan may split the model unevenly), else the recipe's even split
        holders = {*servers, *mates}
        announced = Counter(m.layers for m in members if m.peer_id in holders and m.layers is not None)
        layers = announced.most_common(1)[0][0] if announced else config.stage_layers(stage)
        copy = StageCopy(asker=f"{caller.peer_id}/export", stage=stage, layers=layers, config=config, epoch=epoch)
        served = await load_state_from_peers(copy, caller=caller, servers=servers, candidates=mates)
        if served is None:
            raise ExportError(f"no holder of stage {stage} ({len(servers)} servers, {len(mates)} workers) served its "
                              f"state of epoch {epoch}; the export to {path} is incomplete")
        if served != epoch:
            raise ExportError(f"stage {stage} served its state of epoch {served}, not {epoch}: the swarm stepped while "
                              "it was exported")
        await asyncio.to_thread(writer.add, copy.master.module)
    directory = await asyncio.to_thread(writer.close)
    logger.info(f"exported the model of epoch {epoch} ({config.num_stages} stages) to {directory}")
    return directory
