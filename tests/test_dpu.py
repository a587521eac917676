"""Delayed parameter updates (paper §3.2.1): a swarm whose workers average and step in the background while the
next epoch computes. Here averaging is made slow on purpose (every round takes `SLOW_AVERAGING_S` longer), so that
every step overlaps the next epoch: the swarm with DPU still averages every row of every epoch, its workers and
server replicas hold the same parameters after each step, and its loss falls; and the same swarm without DPU, run
beside it, waits out every slow round at the boundary, so its epochs take longer (issue 21's first must-show: the
slowdown is a second per epoch against epochs of about as much compute, far above this machine's noise; how much
DPU saves on an ordinary swarm is benchmarks/dataplane.py's to say)."""
from __future__ import annotations

import asyncio
import copy
import statistics
from types import SimpleNamespace

import pytest
import torch

from p2ptrain.client.worker import SLOW_AVERAGING_S
from p2ptrain.config import RunConfig
from p2ptrain.protocol.rows import Rows
from tests.lone import give_gradients, lone_worker, step_alone

EPOCHS = 7
RECIPE = ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "8", "--microbatches", "4",
          "--seq-len", "64", "--seed", "5", "--lr", "0.003", "--epochs", str(EPOCHS)]


def run(make_swarm, dpu: str) -> dict:
    swarm = make_swarm(f"dpu-{dpu}", [*RECIPE, "--dpu", dpu])
    for stage in ("0", "1"):
        swarm.peer(f"fs{stage}", "--role", "server", "--stage", stage, "--server-role", "fs")
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", stage, "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", stage, "--fault", "slow-averaging")
    report = swarm.wait_finished(timeout=300)
    swarm.stop()  # one swarm at a time on this machine's cores
    return report


def check_every_row_averaged_once(report: dict) -> list[dict]:
    """Every epoch closed with every row averaged once at each stage, no round failed, the replicas' parameters
    agree with the workers', and the loss fell; the epochs."""
    assert all(stage["digests_agree"] for stage in report["stages"]), report["stages"]
    epochs = [e for e in report["epochs"] if not e["abandoned"]]
    assert len(epochs) == EPOCHS
    for epoch in epochs:
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == 8 * 4 == stage["rows_averaged"], epoch
            assert stage["rounds_failed"] == 0 and stage["digests_agree"] is not False, epoch
    losses = [e["loss"] for e in epochs]
    assert losses[-1] < losses[0] - 0.3, losses
    return epochs


def steady_seconds(report: dict) -> float:
    """The median of the data source's seconds per epoch after the first (which includes the workers' start)."""
    return statistics.median(e["seconds"] for e in report["epochs"] if e["epoch"] > 0 and not e["abandoned"])


@pytest.mark.timeout(600)
def test_delayed_updates_hide_slow_averaging_average_every_row_keep_replicas_equal_and_the_loss_falls(make_swarm):
    without = run(make_swarm, "off")
    report = run(make_swarm, "on")
    epochs = check_every_row_averaged_once(report)
    assert sum(stage["digests_agree"] is True for epoch in epochs for stage in epoch["stages"]) >= len(epochs)
    on, off = steady_seconds(report), steady_seconds(without)
    print(f"seconds per epoch (median after the first), slow averaging +{SLOW_AVERAGING_S} s per round: "
          f"dpu off {off:.2f}, dpu on {on:.2f}")
    assert on < off, (on, off, [e["seconds"] for e in report["epochs"]], [e["seconds"] for e in without["epochs"]])


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_worker_computes_the_epoch_after_a_delayed_step_before_it_or_looking_ahead_where_it_lands(lookahead: bool):
    """A worker alone in its stage: its gradient is the stage's, so its look-ahead lands exactly where the step in
    flight does (which then takes the look-ahead's step instead of stepping again), while plain DPU computes the next
    epoch on the parameters from before the step."""
    config = RunConfig(num_stages=2, rows_per_microbatch=2, microbatches=1, seq_len=8, dpu=True,
                       dpu_lookahead=lookahead)
    worker = lone_worker(config)
    give_gradients(worker, seed=3)
    before = [param.detach().clone() for param in worker.model.parameters()]
    steps, master_step = [], worker.master.step
    worker.master.step = lambda grads, *, epoch: steps.append(epoch) or master_step(grads, epoch=epoch)

    async def step() -> list[torch.Tensor]:
        await step_alone(worker)
        computes_on = [param.detach().clone() for param in worker.model.parameters()]
        assert worker.master.epoch == 0  # the step is still in flight
        await worker.settle()
        return computes_on

    computes_on = asyncio.run(step())
    assert worker.master.epoch == 1
    stepped = list(worker.master.module.parameters())
    assert all(torch.equal(mine, param) for mine, param in zip(computes_on, stepped if lookahead else before))
    assert not any(torch.equal(old, new) for old, new in zip(before, stepped))
    assert steps == ([] if lookahead else [0])


def test_a_worker_that_begins_the_next_epoch_early_keeps_backpropagating_this_one_through_its_own_parameters():
    """`--overlap-epochs on`: the model takes the next epoch's parameters while forward states of this epoch await
    their backward; those still differentiate by the parameters they were computed on, and the next epoch's
    gradients and forward states become the worker's own when it moves on."""
    config = RunConfig(num_stages=2, rows_per_microbatch=2, microbatches=1, seq_len=8, dpu=True, dpu_lookahead=False,
                       overlap_epochs=True)
    worker = lone_worker(config)
    inputs = torch.randint(0, config.model_config.vocab_size, (2, config.seq_len))
    reference = copy.deepcopy(worker.model)
    state = asyncio.run(worker._forward_state(SimpleNamespace(epoch=0, rows=Rows(0, 2)), inputs))
    worker.cache["0:0:0:F1"] = state
    grad = torch.randn_like(state.outputs)
    expected = torch.autograd.grad(reference(inputs), [p for p in reference.parameters() if p.requires_grad],
                                   grad_outputs=grad)
    computed_on = [param.detach().clone() for param in state.params]
    give_gradients(worker, seed=3)
    worker.master.step(worker._mean_gradients(), epoch=0)  # the step of the epoch before, landed meanwhile

    asyncio.run(worker._begin_next())
    assert all(torch.equal(mine, master) for mine, master in zip(worker.model.parameters(),
                                                                  worker.master.module.parameters()))
    assert not any(torch.equal(new, old) for new, old in zip(worker.params, computed_on))
    assert all(torch.equal(param, old) for param, old in zip(state.params, computed_on))
    got = worker._backward_compute(state, grad)
    assert all(torch.allclose(a, b) for a, b in zip(got, expected))

    worker._next.sums[0].fill_(1.0)
    worker._next.rows = 2
    next_state = asyncio.run(worker._forward_state(SimpleNamespace(epoch=1, rows=Rows(0, 2)), inputs))
    worker.cache["1:0:0:F2"] = next_state
    worker._advance(1)
    assert worker.epoch == 1 and worker.rows_accumulated == 2 and bool((worker.accumulated[0] == 1.0).all())
    assert list(worker.cache) == ["1:0:0:F2"] and worker._next is None


def test_a_worker_that_begins_the_next_epoch_early_computes_it_where_a_step_on_its_own_gradient_so_far_lands():
    """`--overlap-epochs on` with the look-ahead: before its stage's mean gradient of this epoch exists, the next
    epoch's first microbatches compute where a step on the worker's own gradient (clipped as the last step was)
    takes the master copy, which keeps its parameters and optimizer state."""
    config = RunConfig(num_stages=2, rows_per_microbatch=2, microbatches=1, seq_len=8, dpu=True, dpu_lookahead=True,
                       overlap_epochs=True)
    worker, reference = lone_worker(config), lone_worker(config)
    give_gradients(worker, seed=3)
    worker._clip_scale = 0.5
    before = [param.detach().clone() for param in worker.master.trainable]

    asyncio.run(worker._begin_next())
    reference.master.step([grad * 0.5 for grad in worker._mean_gradients()], epoch=0)
    assert all(torch.equal(mine, stepped) for mine, stepped in zip(worker.model.parameters(),
                                                                    reference.master.module.parameters()))
    assert all(torch.equal(param, old) for param, old in zip(worker.master.trainable, before))
    assert worker.master.epoch == 0 and not worker.master.optimizer.state


@pytest.mark.timeout(600)
def test_epochs_overlap_without_a_drain_average_every_row_once_keep_replicas_equal_and_the_loss_falls(make_swarm):
    swarm = make_swarm("overlap", [*RECIPE, "--dpu", "on", "--overlap-epochs", "on"])
    for stage in ("0", "1"):
        swarm.peer(f"fs{stage}", "--role", "server", "--stage", stage, "--server-role", "fs")
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", stage, "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", stage)
    report = swarm.wait_finished(timeout=300)
    swarm.stop()
    client0 = (swarm.workdir / "client0.log").read_text()
    check_every_row_averaged_once(report)
    # the next epoch did begin before the stage closed the last one
    assert "before its stage closed epoch" in client0, client0[-3000:]
