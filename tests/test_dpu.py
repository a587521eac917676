"""Delayed parameter updates (paper §3.2.1): with averaging made slow on purpose, a swarm whose workers average and
step in the background while the next epoch computes runs its epochs faster than one whose workers wait for
each step, and its loss still falls."""
from __future__ import annotations

import statistics

import pytest

RECIPE = ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "8", "--microbatches", "4",
          "--seq-len", "64", "--seed", "5", "--lr", "0.003", "--epochs", "7"]
STEADY = slice(2, None)  # the first epochs include the clients' start


def run(make_swarm, dpu: str) -> list[dict]:
    swarm = make_swarm(f"dpu-{dpu}", [*RECIPE, "--dpu", dpu])
    for stage in ("0", "1"):
        swarm.peer(f"fs{stage}", "--role", "server", "--stage", stage, "--server-role", "fs")
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", stage, "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", stage, "--fault", "slow-averaging")
    epochs = swarm.wait_finished(timeout=300)["epochs"]
    swarm.stop()  # before the other run starts, so that both have the machine alike
    return [e for e in epochs if not e["abandoned"]]


@pytest.mark.timeout(720)
def test_delayed_updates_hide_slow_averaging_and_the_loss_still_falls(make_swarm):
    with_dpu, without = run(make_swarm, "on"), run(make_swarm, "off")
    seconds = {name: statistics.mean(e["seconds"] for e in epochs[STEADY])
               for name, epochs in (("on", with_dpu), ("off", without))}
    print(f"mean seconds per steady epoch: DPU on {seconds['on']:.2f}, off {seconds['off']:.2f}")
    # every stage's step takes 1 s longer than an epoch's compute here; DPU hides it behind the next epoch
    assert seconds["on"] < 0.85 * seconds["off"], seconds
    losses = [e["loss"] for e in with_dpu]
    assert losses[-1] < losses[0] - 0.3, losses
