"""Delayed parameter updates (paper §3.2.1): a swarm whose workers average and step in the background while the
next epoch computes, here with averaging made slow on purpose so that every step overlaps the next epoch, still
averages every row of every epoch, its workers and server replicas hold the same parameters after each step, and
its loss falls. (How much time DPU saves is a benchmark's to say: benchmarks/dataplane.py.)"""
from __future__ import annotations

import pytest

RECIPE = ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "8", "--microbatches", "4",
          "--seq-len", "64", "--seed", "5", "--lr", "0.003", "--epochs", "7", "--dpu", "on"]


@pytest.mark.timeout(420)
def test_delayed_updates_average_every_row_keep_replicas_equal_and_the_loss_falls(make_swarm):
    swarm = make_swarm("dpu-on", RECIPE)
    for stage in ("0", "1"):
        swarm.peer(f"fs{stage}", "--role", "server", "--stage", stage, "--server-role", "fs")
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", stage, "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", stage, "--fault", "slow-averaging")
    report = swarm.wait_finished(timeout=300)
    assert all(stage["digests_agree"] for stage in report["stages"]), report["stages"]
    epochs = [e for e in report["epochs"] if not e["abandoned"]]
    assert len(epochs) == 7
    for epoch in epochs:
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == 8 * 4 == stage["rows_averaged"], epoch
            assert stage["rounds_failed"] == 0 and stage["digests_agree"] is not False, epoch
    assert sum(stage["digests_agree"] is True for epoch in epochs for stage in epoch["stages"]) >= len(epochs)
    losses = [e["loss"] for e in epochs]
    assert losses[-1] < losses[0] - 0.3, losses
