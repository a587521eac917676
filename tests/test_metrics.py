"""Metrics records stay small enough for hivemind's DHT process to read whole (a call of over 16 KiB could be read
half-written, and the DHT process then exited: docs/design.md §7), and a status reader that polls keeps the epochs
the records no longer carry."""
from __future__ import annotations

import dataclasses
import pickle

from p2ptrain.dht.records import EpochMetrics, Metrics
from p2ptrain.node.metrics import HISTORY, MAX_RECORD_BYTES, fit
from p2ptrain.status import History, _epochs, render
from p2ptrain.traffic import KINDS

PEER = "12D3KooW" + "x" * 44


def entry(epoch: int, **fields) -> EpochMetrics:
    return EpochMetrics(epoch=epoch, rows_in_batch=16, rows_averaged=16, tasks_redone=0, loss=2.5, tokens=1024,
                        seconds=3.2, digest=[0.12345] * 8, lr=0.001, grad_norm=0.7, eval_loss=2.6, **fields)


def record(epochs: range, *, role: str = "fs", peer: str = PEER, stage: int = 0, lists: int = 3) -> Metrics:
    entries = [entry(e) for e in epochs]
    return Metrics(peer_id=peer, stage=stage, role=role, epoch=epochs[-1], updated=1.0, per_epoch=entries,
                   worker_epochs=entries if lists > 1 else [], source_epochs=entries if lists > 2 else [],
                   bytes_sent=dict.fromkeys(KINDS, 2**50))


def test_the_data_sources_record_of_a_long_run_keeps_its_newest_epochs_within_the_bound():
    fitted = fit(record(range(HISTORY)))
    assert len(pickle.dumps(fitted.to_value())) <= MAX_RECORD_BYTES < 16 * 1024
    kept = [e.epoch for e in fitted.per_epoch]
    assert kept == list(range(HISTORY - len(kept), HISTORY)) and len(kept) >= 16
    assert [e.epoch for e in fitted.source_epochs] == kept == [e.epoch for e in fitted.worker_epochs]
    assert fitted.complete_from == kept[0]
    assert Metrics.from_value(fitted.to_value()) == fitted


def test_a_record_within_the_bound_is_left_whole():
    small = record(range(5))
    assert fit(small) == small and small.complete_from is None


def test_a_record_is_whole_from_its_newest_cut_of_any_list_or_of_what_it_carried():
    lists = record(range(10)).newest(10)
    assert lists.complete_from is None
    short = Metrics(peer_id=PEER, stage=0, role="fs", epoch=9, updated=1.0, per_epoch=[entry(e) for e in range(10)],
                    worker_epochs=[entry(e) for e in range(4, 10)])
    assert short.newest(5).complete_from == 5 and [e.epoch for e in short.newest(5).worker_epochs] == [5, 6, 7, 8, 9]
    assert short.newest(8).complete_from == 2 and len(short.newest(8).worker_epochs) == 6
    carried = dataclasses.replace(short, complete_from=3)
    assert carried.newest(10).complete_from == 3 and carried.newest(8).complete_from == 3
    assert carried.newest(0).complete_from == 10 and not carried.newest(0).per_epoch


def test_a_single_read_leaves_out_the_epochs_some_records_no_longer_hold_instead_of_showing_rows_lost():
    # two FS of one stage, 8 rows each an epoch; records cut to different depths: epochs 0-5 are in fs_b's only
    fs_a = fit(record(range(40), peer="fs_a", lists=1), max_bytes=4000)
    fs_b = record(range(40), peer="fs_b", lists=1)
    assert fs_a.complete_from is not None and fs_a.complete_from > 0 and fs_b.complete_from is None
    epochs = _epochs([fs_a, fs_b], 1)
    assert [e["epoch"] for e in epochs] == list(range(fs_a.complete_from, 40))
    assert {e["stages"][0]["rows_in_batch"] for e in epochs} == {32}


def test_a_history_keeps_the_epochs_a_record_dropped_and_the_newest_word_on_each():
    history = History()
    history.merge([record(range(0, 10), role="fs", lists=1)])
    merged = history.merge([Metrics(peer_id=PEER, stage=0, role="fs", epoch=14, updated=2.0,
                                    per_epoch=[entry(e) for e in range(5, 15)][:-1] + [entry(14, rows_dropped=3)])])
    [fs] = merged
    assert [e.epoch for e in fs.per_epoch] == list(range(15)) and fs.per_epoch[-1].rows_dropped == 3
    assert [e["epoch"] for e in _epochs(merged, 1)] == list(range(15))


def test_a_history_is_whole_from_its_first_read_unless_its_reads_left_a_gap():
    history = History()
    [first] = history.merge([record(range(10), lists=1)])
    assert first.complete_from is None
    [read] = history.merge([record(range(10), lists=1).newest(4)])  # epochs 6-9, cut at 6: all seen before
    assert read.complete_from is None and [e.epoch for e in read.per_epoch] == list(range(10))
    [late] = history.merge([record(range(30), lists=1).newest(4)])  # 26-29: epochs 10-25 were never read
    assert late.complete_from == 26
    assert [e["epoch"] for e in _epochs([late], 1)] == [26, 27, 28, 29]


def test_a_history_keeps_the_epochs_of_peers_whose_records_are_gone():
    history = History()
    history.merge([record(range(3), role="worker", peer="gone", lists=1), record(range(3), role="fs", lists=1)])
    merged = history.merge([record(range(3, 6), role="fs", lists=1)])
    assert {m.peer_id: [e.epoch for e in m.per_epoch] for m in merged} == {"gone": [0, 1, 2],
                                                                         PEER: [0, 1, 2, 3, 4, 5]}


def test_an_epoch_counts_as_abandoned_only_if_no_stage_stepped_on_it():
    # epoch 1: abandoned everywhere (its batch came again); epoch 2: stage 1 stepped on it, and stage 0's FS, which
    # restarted empty after the data source had committed it, dropped it (its rows died with the old FS)
    fs0 = Metrics(peer_id="fs0", stage=0, role="fs", epoch=2, updated=1.0,
                  per_epoch=[entry(0), entry(1, abandoned=True), entry(2, abandoned=True)])
    fs1 = Metrics(peer_id="fs1", stage=1, role="fs", epoch=2, updated=1.0,
                  per_epoch=[entry(0), entry(1, abandoned=True), entry(2)])
    epochs = _epochs([fs0, fs1], 2)
    assert [(e["epoch"], e["abandoned"], e["closed"]) for e in epochs] == [(0, False, True), (1, True, False),
                                                                         (2, False, True)]


def test_a_stage_whose_fs_has_not_published_an_epoch_yet_is_shown_as_not_reported_not_as_rows_lost():
    # the last stage closed epoch 2 and published it; stage 0's FS has not refreshed its record since epoch 1
    fs0 = Metrics(peer_id="fs0", stage=0, role="fs", epoch=1, updated=1.0, per_epoch=[entry(0), entry(1)])
    fs1 = Metrics(peer_id="fs1", stage=1, role="fs", epoch=2, updated=1.0, per_epoch=[entry(0), entry(1), entry(2)])
    epochs = _epochs([fs0, fs1], 2)
    assert [[s["reported"] for s in e["stages"]] for e in epochs] == [[True, True], [True, True], [False, True]]
    report = {"run_id": "run", "epoch": 1, "epochs_planned": 3, "loss": 2.5, "tokens_per_s": None, "finished": False,
              "stages": [], "epochs": epochs}
    *_, shown = render(report).splitlines()
    assert shown.split()[:5] == ["2", "2.5000", "-", "-", "16/16"], shown
