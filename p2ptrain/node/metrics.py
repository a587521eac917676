"""What each peer publishes about its training progress, refreshed in the DHT every few seconds."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from p2ptrain.client.worker import Worker
from p2ptrain.config import RunConfig
from p2ptrain.dht import MAX_EPOCHS_KEPT, Announcer, EpochMetrics, Metrics
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.base import StageServer
from p2ptrain.server.feeder import DataFeeder

logger = logging.getLogger(__name__)

HISTORY = 64  # epochs kept in a record: enough for status and the launcher, small enough for one DHT value
assert HISTORY <= MAX_EPOCHS_KEPT


def server_epochs(server: StageServer) -> list[EpochMetrics]:
    records = []
    for epoch, stats in sorted(server.state.epochs.items()):
        if stats.finished is None:
            continue
        last_stage_bs = isinstance(server, BackwardServer) and server.is_last and stats.tokens > 0
        records.append(EpochMetrics(
            epoch=epoch, rows_in_batch=stats.rows, rows_averaged=stats.rows_grouped,
            tasks_redone=server.state.pool.redone.get(epoch, 0),
            loss=stats.loss_sum / stats.tokens if last_stage_bs and not stats.abandoned else None, tokens=stats.tokens,
            seconds=stats.finished - (stats.started or stats.finished), rows_recomputed=stats.rows_recomputed,
            workers_lost=stats.workers_lost, workers_joined=stats.workers_joined, abandoned=stats.abandoned,
            rows_dropped=stats.rows_dropped,
        ))
    return records[-HISTORY:]


def worker_epochs(worker: Worker) -> list[EpochMetrics]:
    return [
        EpochMetrics(epoch=r.epoch, rows_in_batch=r.rows, rows_averaged=r.rows if r.averaged else 0, tasks_redone=0,
                     tokens=r.tokens, seconds=r.seconds, digest=list(r.digest) or None, round_failed=r.round_failed,
                     lr=r.lr, grad_norm=r.grad_norm, rows_lost=r.rows_lost, unclipped=r.unclipped)
        for r in worker.history[-HISTORY:]
    ]


def feeder_epochs(feeder: DataFeeder, config: RunConfig) -> list[EpochMetrics]:
    """The data source's epochs; `tokens`: those of fresh data (what was fed again trained before)."""
    tokens_per_microbatch = config.rows_per_microbatch * config.seq_len
    return [
        EpochMetrics(epoch=epoch, rows_in_batch=config.rows_per_epoch, rows_averaged=0, tasks_redone=0,
                     tokens=config.tokens_per_epoch - again * tokens_per_microbatch, seconds=seconds,
                     microbatches_retrained=again, eval_loss=feeder.progress.eval_loss.get(epoch))
        for epoch, seconds in sorted(feeder.progress.epoch_seconds.items())[-HISTORY:]
        for again in [feeder.progress.retrained.get(epoch, 0)]
    ]


def build_record(*, peer_id: str, stage: int, role: str, server: StageServer | None, worker: Worker | None,
                 feeder: DataFeeder | None, config: RunConfig, carried: list[EpochMetrics] = ()) -> Metrics:
    """One record per peer: its server's epochs, its worker's, and the data source's if it leads stage 0.
    `carried`: what the record of this peer's previous process said of epochs (a peer restarted with its identity
    keeps its history in the status; what this process saw of an epoch wins)."""
    own = server_epochs(server) if server is not None else worker_epochs(worker)
    if carried:
        merged = {entry.epoch: entry for entry in carried} | {entry.epoch: entry for entry in own}
        own = [merged[epoch] for epoch in sorted(merged)][-HISTORY:]
    last = own[-1] if own else None
    leads = feeder is not None and feeder.leads
    source = feeder_epochs(feeder, config) if leads else []
    return Metrics(
        peer_id=peer_id, stage=stage, role=role, epoch=last.epoch if last else 0, loss=last.loss if last else None,
        tokens_per_s=source[-1].tokens / source[-1].seconds if source and source[-1].seconds else 0.0,
        rows_in_batch=last.rows_in_batch if last else 0, rows_averaged=last.rows_averaged if last else 0,
        tasks_redone=last.tasks_redone if last else 0, updated=time.time(),
        epochs_planned=feeder.epochs if leads else None, finished=leads and feeder.progress.finished, per_epoch=own,
        worker_epochs=worker_epochs(worker) if server is not None and worker is not None else [],
        source_epochs=source, condition=server.condition() if server is not None else "",
        holds_state=worker is not None and worker.holds_only,
        client_mode=worker is not None and worker.client_mode,
    )


async def publish_metrics(*, announcer: Announcer, period_s: float, stop: asyncio.Event, **parts) -> None:
    """Store the record when it changed (the announcer refreshes it otherwise): every store costs DHT work
    (signing, replication, schema checks) on a machine the training shares."""
    published = None
    while not stop.is_set():
        try:
            record = build_record(**parts)
            content = dataclasses.replace(record, updated=0.0)
            if content != published:
                announcer.set_metrics(record)
                published = content
        except Exception as e:
            logger.warning(f"could not publish metrics: {e!r}")
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except asyncio.TimeoutError:
            pass
