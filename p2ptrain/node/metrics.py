"""What each peer publishes about its training progress, refreshed in the DHT every few seconds.

A record carries the peer's newest epochs only (and says from which epoch on its lists are whole, `complete_from`),
as many as fit in `MAX_RECORD_BYTES`: hivemind's DHT process reads
the calls of its owner from a pipe it has made non-blocking, and a call of over 16 KiB (which multiprocessing writes
in two parts) could be read half-written; the DHT process then fails on the rest ("Ran out of input") and exits,
taking the peer's p2p daemon with it (docs/design.md §7). The data source's record, which carries three lists of
epochs, crossed that size after about 28 epochs, and its peer was cut off from the swarm. Readers that need more
history than a record holds keep what they have seen (`p2ptrain.status.History`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time

from p2ptrain.client.worker import Worker
from p2ptrain.config import RunConfig
from p2ptrain.dht import MAX_EPOCHS_KEPT, Announcer, EpochMetrics, Metrics
from p2ptrain.dht.records import EPOCH_LISTS, join_epochs
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.base import StageServer
from p2ptrain.server.feeder import DataFeeder
from p2ptrain.traffic import METER

logger = logging.getLogger(__name__)

HISTORY = 64  # epochs a record keeps at most (the lists below are built one longer, so cutting them tells where)...
assert HISTORY <= MAX_EPOCHS_KEPT
# ...and the most a record's value may take, pickled as it travels to the DHT process: below multiprocessing's
# 16 KiB (past which it writes a message in two parts), with room for the key, subkey, expiration and call
MAX_RECORD_BYTES = 12_000


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
    return records[-HISTORY - 1:]


def worker_epochs(worker: Worker) -> list[EpochMetrics]:
    return [
        EpochMetrics(epoch=r.epoch, rows_in_batch=r.rows, rows_averaged=r.rows if r.averaged else 0, tasks_redone=0,
                     tokens=r.tokens, seconds=r.seconds, digest=list(r.digest) or None, round_failed=r.round_failed,
                     lr=r.lr, grad_norm=r.grad_norm, rows_lost=r.rows_lost, unclipped=r.unclipped,
                     averaging_bytes=METER.of_epoch("averaging", r.epoch), overflow=r.overflow,
                     loss_scale=r.loss_scale)
        for r in worker.history[-HISTORY - 1:]
    ]


def feeder_epochs(feeder: DataFeeder, config: RunConfig) -> list[EpochMetrics]:
    """The data source's epochs; `tokens`: those of fresh data (what was fed again trained before)."""
    tokens_per_microbatch = config.rows_per_microbatch * config.seq_len
    return [
        EpochMetrics(epoch=epoch, rows_in_batch=config.rows_per_epoch, rows_averaged=0, tasks_redone=0,
                     tokens=config.tokens_per_epoch - again * tokens_per_microbatch, seconds=seconds,
                     microbatches_retrained=again, eval_loss=feeder.progress.eval_loss.get(epoch))
        for epoch, seconds in sorted(feeder.progress.epoch_seconds.items())[-HISTORY - 1:]
        for again in [feeder.progress.retrained.get(epoch, 0)]
    ]


def build_record(*, peer_id: str, stage: int, role: str, server: StageServer | None, worker: Worker | None,
                 feeder: DataFeeder | None, config: RunConfig, previous: Metrics | None = None) -> Metrics:
    """One record per peer: its server's epochs, its worker's, and the data source's if it leads stage 0, each its
    newest `HISTORY`. `previous`: the record of this peer's previous process (a peer restarted with its identity
    keeps its history of epochs in the status; what this process saw of an epoch wins)."""
    own = server_epochs(server) if server is not None else worker_epochs(worker)
    if previous is not None:
        own = join_epochs(previous.per_epoch, own)
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
        client_mode=worker is not None and worker.client_mode, bytes_sent=METER.snapshot(),
        calls_served=METER.served_snapshot(), complete_from=previous.complete_from if previous is not None else None,
    ).newest(HISTORY)


def fit(record: Metrics, *, max_bytes: int = MAX_RECORD_BYTES) -> Metrics:
    """`record` with its lists of epochs cut to their newest `keep` entries (`Metrics.newest`), `keep` as large as
    lets its value take at most `max_bytes`."""
    while (size := len(pickle.dumps(record.to_value()))) > max_bytes:
        longest = max(len(getattr(record, name)) for name in EPOCH_LISTS)
        if longest == 0:
            raise ValueError(f"a metrics record of no epochs takes {size} bytes, over {max_bytes}")
        record = record.newest(min(longest - 1, longest * max_bytes // size))  # entries are about alike: aim, check
    return record


async def publish_metrics(*, announcer: Announcer, period_s: float, stop: asyncio.Event, **parts) -> None:
    """Store the record when it changed (the announcer refreshes it otherwise): every store costs DHT work
    (signing, replication, schema checks) on a machine the training shares. Bytes sent and calls served change all
    the time: they ride along with the other changes (an epoch that closes) instead of causing a store of their
    own."""
    published = None
    while not stop.is_set():
        try:
            record = fit(build_record(**parts))
            content = dataclasses.replace(record, updated=0.0, bytes_sent={}, calls_served={})
            if content != published:
                announcer.set_metrics(record)
                published = content
        except Exception as e:
            logger.warning(f"could not publish metrics: {e!r}")
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except asyncio.TimeoutError:
            pass
