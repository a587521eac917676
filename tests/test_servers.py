"""Stage servers driven in-process through their handlers (no network): results counted once, refusals, a state
saved mid-epoch and restored into a new server, the message framing under a stream that ends early, rows of a
vanished or leaving worker redone before the stage averages, leases sized by speed, bans that back off."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from unittest import mock

import pytest
import torch
from hivemind.proto import runtime_pb2

from p2ptrain.client.averaging import StageAllReduce
from p2ptrain.client.worker import Worker
from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.live.probe import LinkProbe
from p2ptrain.models import build_stage
from p2ptrain.protocol.closure import Verdict, judge
from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.messages import (
    FRONTAL_SERVER,
    GRADIENT_DEPOSITS,
    LINK_PROBE,
    Ack,
    AskEpoch,
    Closure,
    EndEpoch,
    GroupMember,
    Leave,
    MessageError,
    MicrobatchRef,
    PushInputGrads,
    PushOutputGrads,
    PushOutputs,
    PushRows,
    ReportTask,
    TakeTask,
    TaskOffer,
    TaskReply,
)
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.taskpool import Kind
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.base import StageServer
from p2ptrain.server.feeder import DataFeeder
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.server.state import BackwardState, FrontalState, KeptGrads, Result
from p2ptrain.server.watch import ServerWatch
from p2ptrain.traffic import METER
from p2ptrain.transport import Caller, Envelope, Refused, pack, unpack
from tests.loopback import loopback_p2ps

SEQ, ROWS = 4, 4
CONFIG = RunConfig(num_stages=1, rows_per_microbatch=ROWS, microbatches=1, seq_len=SEQ)
LAYOUT = Layout((StageServers(fs=("fs",), bs=("bs",)),))


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def members(closure: Closure) -> list[str]:
    """The peer ids of a closure's averaging group."""
    return [member.peer_id for member in closure.group]


def servers(*, fs_state: FrontalState | None = None, bs_state: BackwardState | None = None,
            clock: Callable[[], float] = time.monotonic, config: RunConfig = CONFIG,
            workers: tuple[str, ...] = ("w1", "w2"), fs_id: str = "fs") -> tuple[FrontalServer, BackwardServer]:
    """The FS (`fs_id`) and BS of a one-stage run, two peers whose calls reach each other in this process, and the
    link probes of live `workers` (a server probes a silent worker; one without a probe here cannot be reached, as if
    killed)."""
    local = {(worker, LINK_PROBE): LinkProbe(peer_id=worker) for worker in workers}
    settings = RuntimeConfig()
    fs = FrontalServer(peer_id=fs_id, stage=0, config=config, settings=settings, state=fs_state, clock=clock,
                       caller=Caller(p2p=None, peer_id=fs_id, codec="none", timeout=10.0, local=local))
    bs = BackwardServer(peer_id="bs", stage=0, config=config, settings=settings, state=bs_state, clock=clock,
                        caller=Caller(p2p=None, peer_id="bs", codec="none", timeout=10.0, local=local))
    return fs, bs


async def handled(server: StageServer, reply: Awaitable[Ack]) -> Ack:
    """What the caller gets, once the work the handler left for after its reply is done too."""
    ack = await reply
    await server.drain()
    return ack


async def feed(fs: FrontalServer, epoch: int, *, commit: bool = True, layout: Layout = LAYOUT) -> None:
    """The data source's rows of an epoch (under `layout`, from its data source); it also commits the epoch at once
    unless told not to (the FS closes it only once committed and complete: the tests that do not test committing
    need not wait for it)."""
    tokens = torch.randint(0, 256, (ROWS, SEQ))
    source = layout.stages[0].fs[0]
    ack = await fs.push_rows(PushRows(epoch=epoch, microbatch=0, rows=Rows(0, ROWS), total_rows=ROWS, layout=layout,
                                      inputs=tokens, labels=tokens), source)
    assert ack == Ack()
    if commit:
        assert await fs.end_epoch(EndEpoch(epoch=epoch, abandoned=False, layout=layout), source) == Ack()


async def take(fs: FrontalServer, worker: str, epoch: int) -> TaskOffer:
    reply = await fs.take_task(TakeTask(worker=worker, compute=1.0, epoch=epoch), worker)
    assert reply.task is not None and reply.task.rows == Rows(0, ROWS)
    return reply.task


async def deposited(fs: FrontalServer, worker: str, epoch: int, rows: int = ROWS) -> TaskReply:
    """`worker` polls with its gradients of `rows` rows of `epoch` deposited: only then may the FS count it ready
    to average."""
    return await fs.take_task(TakeTask(worker=worker, compute=1.0, epoch=epoch, deposited=rows), worker)


async def computed_and_deposited(fs: FrontalServer, clock: Clock, epoch: int) -> None:
    """The data source feeds `epoch`, w1 computes all of it and, half a second later, polls with its gradients
    deposited."""
    await feed(fs, epoch)
    task = await take(fs, "w1", epoch)
    assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
    clock.now += 0.5
    await deposited(fs, "w1", epoch)


def grads(task: TaskOffer, worker: str) -> PushInputGrads:
    return PushInputGrads(task=task.task, worker=worker, epoch=task.epoch, microbatch=task.microbatch, rows=task.rows,
                          issuer="fs")


def loss(task: TaskOffer, worker: str) -> PushOutputs:
    return PushOutputs(task=task.task, worker=worker, epoch=task.epoch, microbatch=task.microbatch, rows=task.rows,
                       total_rows=ROWS, layout=LAYOUT, fs="fs", loss=torch.tensor(3.0))


def test_a_result_pushed_again_after_a_lost_reply_is_accepted_again_and_counted_once():
    async def scenario() -> None:
        fs, _ = servers()
        await feed(fs, 0)
        task = await take(fs, "w1", 0)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        reply = await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")
        assert reply.deposit_to == "fs" and fs.state.closed_epoch == -1  # all rows back: w1 deposits first
        await deposited(fs, "w1", 0)
        assert fs.state.closed_epoch == 0
        assert await fs.push_input_grads(grads(task, "w1"), "w1") == Ack(again=True)
        with pytest.raises(Refused, match="not held"):  # someone else's copy of the same rows never counts
            await fs.push_input_grads(grads(task, "w2"), "w2")
        assert fs.epoch_stats(0).rows == ROWS
        assert fs.state.closures[0] == Closure(epoch=0, fs=("fs",), group=(GroupMember(peer_id="w1",
                                                                                       client_mode=False, rows=ROWS),))

        # a worker that took its task without polling this FS (say, from another server) still joins the group
        await feed(fs, 1)
        task = await take(fs, "w1", 1)
        fs.state.workers.pop("w1")
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await deposited(fs, "w1", 1)
        assert members(fs.state.closures[1]) == ["w1"]

    asyncio.run(scenario())


def test_a_result_whose_worker_dies_while_the_issuer_confirms_it_is_still_counted():
    """A worker killed while its result is confirmed breaks its stream, and hivemind cancels the handler: the issuer
    had counted the task done, and the rows were then counted nowhere (seen in the convergence benchmark at 25%
    churn: the epoch never closed)."""
    async def scenario() -> None:
        fs, _ = servers()
        await feed(fs, 0)
        task = await take(fs, "w1", 0)
        confirm = fs.task_result

        async def slow_reply(request: ReportTask, sender: str) -> Ack:  # the issuer counts it; its reply is slow
            ack = await confirm(request, sender)
            await asyncio.sleep(0.2)
            return ack

        fs.task_result = slow_reply
        handler = asyncio.create_task(fs.push_input_grads(grads(task, "w1"), "w1"))
        await asyncio.sleep(0.05)
        assert fs.state.pool.get(task.task) is None  # the issuer completed the task...
        handler.cancel()  # ...and then the worker's stream broke
        with pytest.raises(asyncio.CancelledError):
            await handler
        await fs.drain()
        assert (task.task, "w1") in fs.state.accepted[0] and fs.state.completed[0] == {0}

    asyncio.run(scenario())


def test_a_worker_polling_from_two_epochs_back_is_left_out_of_the_group_and_holds_nothing_open():
    """A state holder that restarted (or a joiner) polls from the epoch it has, catches up by loading a mate's state
    and would never take part in the round of the epoch that closes: in its group, it would hold every member until
    the round's timeout. One epoch behind, it steps that one first and then averages this one."""
    async def scenario() -> None:
        fs, _ = servers()
        holder = TakeTask(worker="w2", compute=1.0, epoch=0, holds_state=True)
        for epoch in (0, 1):
            await feed(fs, epoch)
            task = await take(fs, "w1", epoch)
            assert (await fs.take_task(holder, "w2")).task is None
            assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
            await deposited(fs, "w1", epoch)
            assert fs.state.closed_epoch == epoch - 1  # a holder seen before the rows were all back polls again first
            await fs.take_task(holder, "w2")
            assert fs.state.closed_epoch == epoch
        assert members(fs.state.closures[1]) == ["w1", "w2"]  # one epoch behind: it steps 0, then 1
        await feed(fs, 2)
        task = await take(fs, "w1", 2)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await deposited(fs, "w1", 2)
        await fs.take_task(holder, "w2")
        assert fs.state.closed_epoch == 2 and members(fs.state.closures[2]) == ["w1"]
        await feed(fs, 3)
        task = await take(fs, "w1", 3)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await deposited(fs, "w1", 3)
        await fs.take_task(dataclasses.replace(holder, epoch=3), "w2")  # caught up: in the group again
        assert members(fs.state.closures[3]) == ["w1", "w2"]

    asyncio.run(scenario())


def test_results_are_refused_unless_their_issuer_confirms_them_and_a_worker_speaks_for_itself_only():
    async def scenario() -> None:
        fs, bs = servers()
        await feed(fs, 0)
        task = await take(fs, "w1", 0)
        with pytest.raises(Refused, match="not the sender"):
            await fs.push_input_grads(grads(task, "w1"), "w2")
        with pytest.raises(Refused, match="does not confirm"):  # a task nobody issued
            await fs.push_input_grads(PushInputGrads(task="0:0:0:F99", worker="w1", epoch=0, microbatch=0,
                                                     rows=Rows(0, ROWS), issuer="fs"), "w1")
        with pytest.raises(Refused, match="does not confirm"):  # the BS of the last stage: the loss of rows the FS
            await bs.push_outputs(loss(task, "w1"), "w1")  # never accepted
        assert bs.state.ledger.rows(epoch=0, microbatch=0) == [] and not bs.state.microbatches
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await handled(bs, bs.push_outputs(loss(task, "w1"), "w1")) == Ack()
        assert bs.state.closed_epoch == 0 and bs.epoch_stats(0).loss_sum == 3.0
        with pytest.raises(Refused, match="duplicate"):
            await bs.push_outputs(loss(task, "w1"), "w1")

    asyncio.run(scenario())


def test_the_last_stages_bs_counts_a_loss_whose_issuer_died_once_the_data_source_commits_its_epoch():
    """The last stage's FS completes a task when it accepts the input gradients; the loss reaches the BS after, and
    the BS confirms it with that FS. An FS killed in between confirms nothing, and its rows were counted nowhere at
    the BS: that epoch and every one after stayed open there, with no loss, for the rest of the run (seen in CI: the
    status stood at the epoch before the kill while the swarm trained on). The data source's commit proves that every
    row passed its FS: the BS counts such rows then, without the loss it could not confirm."""
    def commit(epoch: int) -> EndEpoch:
        return EndEpoch(epoch=epoch, abandoned=False, layout=LAYOUT)

    async def scenario() -> None:
        fs, bs = servers()
        local = bs.caller.local
        await feed(fs, 0, commit=False)
        task = await take(fs, "w1", 0)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        issuer = local.pop(("fs", FRONTAL_SERVER))  # killed once it accepted the input gradients
        assert await handled(bs, bs.push_outputs(loss(task, "w1"), "w1")) == Ack()
        assert await bs.push_outputs(loss(task, "w1"), "w1") == Ack(again=True)  # held once
        assert bs.state.closed_epoch == -1 and bs.epoch_stats(0).tokens == 0  # not before the commit
        with pytest.raises(Refused, match="duplicate"):  # another worker's loss of the same rows
            await bs.push_outputs(loss(task, "w2"), "w2")
        assert await bs.end_epoch(commit(0), "fs") == Ack()
        assert bs.state.closed_epoch == 0 and bs.epoch_stats(0).rows == ROWS
        assert bs.epoch_stats(0).tokens == 0 and bs.epoch_stats(0).loss_sum == 0.0  # no loss it could not confirm

        # the commit may come first (a one-stage swarm): such a loss counts as soon as it comes
        local[("fs", FRONTAL_SERVER)] = issuer
        await deposited(fs, "w1", 0)
        assert await fs.end_epoch(commit(0), "fs") == Ack() and fs.state.closed_epoch == 0
        await feed(fs, 1)
        task = await take(fs, "w1", 1)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await bs.end_epoch(commit(1), "fs") == Ack() and bs.state.closed_epoch == 0
        local.pop(("fs", FRONTAL_SERVER))
        assert await handled(bs, bs.push_outputs(loss(task, "w1"), "w1")) == Ack()
        assert bs.state.closed_epoch == 1 and bs.epoch_stats(1).tokens == 0

        # a live issuer that does not confirm is still a refusal, committed or not
        local[("fs", FRONTAL_SERVER)] = issuer
        await deposited(fs, "w1", 1)
        await feed(fs, 2)
        assert await bs.end_epoch(commit(2), "fs") == Ack()
        with pytest.raises(Refused, match="does not confirm"):
            await bs.push_outputs(PushOutputs(task="2:0:0:F99", worker="w1", epoch=2, microbatch=0,
                                              rows=Rows(0, ROWS), total_rows=ROWS, layout=LAYOUT, fs="fs",
                                              loss=torch.tensor(3.0)), "w1")
        assert bs.state.closed_epoch == 1

    asyncio.run(scenario())


def test_the_last_stages_bs_closes_a_committed_epoch_without_the_loss_of_a_worker_killed_after_its_fs_accepted():
    """A worker killed after the last stage's FS accepted its input gradients never sends its loss: the BS closes
    the committed epoch `worker_lost_s` after the commit without it, at a poll, and not before."""
    clock = Clock()

    async def scenario() -> None:
        fs, bs = servers(clock=clock)
        await feed(fs, 0, commit=False)
        task = await take(fs, "w1", 0)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await bs.end_epoch(EndEpoch(epoch=0, abandoned=False, layout=LAYOUT), "fs") == Ack()
        poll = TakeTask(worker="w2", compute=1.0, epoch=0)
        await bs.take_task(poll, "w2")
        assert bs.state.closed_epoch == -1  # its loss may still be on its way
        clock.now += bs.settings.worker_lost_s
        await bs.take_task(poll, "w2")
        assert bs.state.closed_epoch == 0 and bs.epoch_stats(0).tokens == 0 and not bs.state.microbatches
        with pytest.raises(Refused, match="ended"):  # a loss that comes after all counts nowhere
            await bs.push_outputs(loss(task, "w1"), "w1")

    asyncio.run(scenario())


def test_a_confirmation_asked_again_after_a_lost_reply_is_confirmed_again_for_the_same_worker_only():
    async def scenario() -> None:
        fs, _ = servers()
        await feed(fs, 0)
        task = await take(fs, "w1", 0)
        report = ReportTask(task=task.task, worker="w1", epoch=0, ok=True)
        assert await fs.task_result(report, "fs") == Ack()
        assert await fs.task_result(report, "fs") == Ack(again=True)
        with pytest.raises(Refused, match="done by another worker"):
            await fs.task_result(dataclasses.replace(report, worker="w2"), "fs")
        assert fs.state.settled == {0: {(task.task, "w1")}}

    asyncio.run(scenario())


def test_a_state_saved_mid_epoch_restores_into_a_new_server_that_finishes_the_epoch(tmp_path):
    async def scenario() -> None:
        fs, bs = servers()
        await feed(fs, 0)
        task = await take(fs, "w1", 0)
        fs.state.save(tmp_path / "fs.safetensors")
        bs.state.save(tmp_path / "bs.safetensors")
        with pytest.raises(ValueError, match="cannot restore"):
            BackwardState.load(tmp_path / "fs.safetensors")

        restored_fs, restored_bs = servers(fs_state=FrontalState.load(tmp_path / "fs.safetensors"),
                                           bs_state=BackwardState.load(tmp_path / "bs.safetensors"))
        held = restored_fs.state.microbatches[(0, 0)]
        assert torch.equal(held.inputs, fs.state.microbatches[(0, 0)].inputs) and held.layout == LAYOUT
        assert restored_fs.state.pool.get(task.task) == fs.state.pool.get(task.task)  # still leased to w1
        assert await handled(restored_fs, restored_fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        holding, held_tensors = restored_fs.state.snapshot()
        assert holding["results"], "the accepted result is kept until its stage averaged"
        # a state saved by an earlier version: its result rows carry a sixth field, the task's issuer
        older = {**holding, "results": [[epoch, [[*row, "fs"] for row in rows]] for epoch, rows in holding["results"]]}
        assert FrontalState.restore(older, held_tensors).snapshot()[0] == holding
        assert await handled(restored_bs, restored_bs.push_outputs(loss(task, "w1"), "w1")) == Ack()
        await deposited(restored_fs, "w1", 0)
        assert restored_fs.state.closed_epoch == restored_bs.state.closed_epoch == 0
        assert members(restored_fs.state.closures[0]) == ["w1"]

        snapshot, tensors = restored_fs.state.snapshot()
        again = FrontalState.restore(snapshot, tensors)
        assert again.snapshot()[0] == snapshot

    asyncio.run(scenario())


def test_a_stream_cut_short_is_a_connection_error_the_caller_can_retry():
    x = torch.randn(600_000)
    protos = pack(Envelope({"a": 1}, {"x": x}), codec="none", proto=runtime_pb2.ExpertRequest)
    assert len(protos) > 2  # the header, then chunks of at most 1 MiB
    assert torch.equal(asyncio.run(unpack(protos)).tensors["x"], x)
    with pytest.raises(ConnectionError, match="ended early"):
        asyncio.run(unpack(protos[:-1]))
    with pytest.raises(ConnectionError, match="empty stream"):
        asyncio.run(unpack([]))


async def poll(server: FrontalServer | BackwardServer, worker: str, epoch: int) -> TaskOffer | None:
    return (await server.take_task(TakeTask(worker=worker, compute=1.0, epoch=epoch), worker)).task


async def both_results(fs: FrontalServer, bs: BackwardServer, clock: Clock) -> tuple[TaskOffer, TaskOffer]:
    """w1 and w2 each take half the rows of epoch 0; w2's result comes in, then 0.5 s later w1's, which completes
    the epoch; w1's task and w2's."""
    assert await poll(fs, "w1", 0) is None and await poll(fs, "w2", 0) is None  # both known: half the rows each
    await feed(fs, 0)
    first, second = await poll(fs, "w1", 0), await poll(fs, "w2", 0)
    for task, worker in ((second, "w2"), (first, "w1")):
        await handled(fs, fs.push_input_grads(grads(task, worker), worker))
        await bs.push_outputs(loss(task, worker), worker)
        clock.now += 0.5
    return first, second


def test_rows_of_a_worker_that_vanished_before_its_stage_averaged_are_redone_by_another():
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock)
        first, second = await both_results(fs, bs, clock)
        assert {len(first.rows), len(second.rows)} == {ROWS // 2}
        # every row is back, but w2 holds half of their parameter gradients and has not polled since
        clock.now += 1.0
        assert await poll(fs, "w1", 0) is None and fs.state.closed_epoch == -1
        clock.now += fs.settings.worker_lost_s
        redo = await poll(fs, "w1", 0)
        assert redo is not None and redo.kind == Kind.REDO and redo.rows == second.rows
        assert await handled(fs, fs.push_input_grads(grads(redo, "w1"), "w1")) == Ack()
        with pytest.raises(Refused, match="duplicate"):  # w2 had delivered the loss of those rows already
            await bs.push_outputs(loss(redo, "w1"), "w1")
        assert (await deposited(fs, "w1", 0, ROWS // 2)).task is None  # its deposit before the redo: too few rows
        assert fs.state.closed_epoch == -1
        assert (await deposited(fs, "w1", 0)).task is None
        assert fs.state.closed_epoch == 0
        assert members(fs.state.closures[0]) == ["w1"]
        stats = fs.epoch_stats(0)
        assert (stats.rows_grouped, stats.rows_recomputed, stats.workers_lost) == (ROWS, ROWS // 2, 1)
        assert fs.state.pool.redone[0] == 1

    asyncio.run(scenario())


def test_rows_redone_and_lost_again_in_a_first_stage_fetch_their_output_gradients_from_the_bs_again():
    """A worker that took a redo and vanished before its stage averaged: its result's issuer is the FS itself (it
    issued the redo), yet the output gradients for redoing those rows once more are the BS's. Fetched from the
    issuer, the FS dialled itself for good and the epoch never closed (a chaos run in CI, with DPU on)."""
    async def scenario() -> None:
        config = dataclasses.replace(CONFIG, num_stages=2)
        layout = Layout((StageServers(fs=("fs",), bs=("bs",)), StageServers(fs=("fs1",), bs=("bs1",))))
        fs, bs = servers(config=config)
        await feed(fs, 0, layout=layout)
        assert (await poll(fs, "w1", 0)).kind == Kind.FORWARD  # out: only the redo is left to hand out
        kept = torch.randn(ROWS, *bs.hidden_shape)
        bs.state.kept_grads[(0, 0)] = KeptGrads(segment=Rows(0, ROWS), grad=kept, fs=("fs",))
        lost = Rows(ROWS // 2, ROWS)
        fs.state.results[0] = [Result(task="redone", worker="w2", microbatch=0, rows=lost)]
        fs._redo(0, {"w2"})
        await asyncio.wait_for(fs.drain(), timeout=5.0)
        reply = await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")
        assert reply.task is not None and reply.task.kind == Kind.REDO and reply.task.rows == lost
        assert torch.equal(reply.grad, kept[ROWS // 2:])

    asyncio.run(scenario())


def test_an_fs_counts_a_worker_ready_to_average_only_once_its_gradients_are_deposited():
    """Every row back, the FS names the server to deposit with; a worker holding rows is ready only once its poll
    says its deposit covers them all, and one that polls but never deposits is counted gone after the averaging
    timeout, its rows redone by another (who then deposits again, for its rows and the redone ones)."""
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock)
        first, second = await both_results(fs, bs, clock)
        assert (await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")).deposit_to == "fs"
        assert (await deposited(fs, "w1", 0, len(first.rows))).deposit_to == "fs"
        assert (await poll(fs, "w2", 0)) is None and fs.state.closed_epoch == -1  # w2 polls, not deposited
        clock.now += fs.settings.averaging_timeout_s - 1.0
        await deposited(fs, "w1", 0, len(first.rows))
        assert await poll(fs, "w2", 0) is None and fs.state.closed_epoch == -1  # still waiting for w2's deposit
        clock.now += 1.0
        redo = (await deposited(fs, "w1", 0, len(first.rows))).task
        assert redo is not None and redo.kind == Kind.REDO and redo.rows == second.rows
        assert await poll(fs, "w2", 0) is None  # out of the epoch now
        await handled(fs, fs.push_input_grads(grads(redo, "w1"), "w1"))
        assert (await deposited(fs, "w1", 0, len(first.rows))).deposit_to == "fs" and fs.state.closed_epoch == -1
        await deposited(fs, "w1", 0)
        assert fs.state.closed_epoch == 0 and members(fs.state.closures[0]) == ["w1"]
        assert fs.epoch_stats(0).rows_grouped == ROWS and fs.epoch_stats(0).workers_lost == 1

    asyncio.run(scenario())


def test_a_worker_whose_bytes_keep_arriving_on_a_slow_link_is_never_counted_gone():
    """Deadlines that follow the link (issue 25): a worker that does not poll while its gradients crawl in (each chunk
    tells the node's hearing) is neither gone after `worker_lost_s` nor undeposited after the averaging timeout; once
    its bytes stop for that long, it is, and its rows are redone."""
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock)
        first, second = await both_results(fs, bs, clock)
        assert (await deposited(fs, "w1", 0, len(first.rows))).deposit_to == "fs"
        await poll(fs, "w2", 0)
        timeout = fs.settings.averaging_timeout_s
        for _ in range(4):  # twice the averaging timeout, and far past worker_lost_s, with a chunk every few s
            clock.now += timeout / 2 - 1.0
            fs.hearing.heard("w2", GRADIENT_DEPOSITS)
            assert (await deposited(fs, "w1", 0, len(first.rows))).task is None and fs.state.closed_epoch == -1
            assert not fs.gone("w2")
        clock.now += timeout  # the deposit stopped moving
        redo = (await deposited(fs, "w1", 0, len(first.rows))).task
        assert redo is not None and redo.kind == Kind.REDO and redo.rows == second.rows

    asyncio.run(scenario())


def test_a_worker_judged_gone_that_was_alive_after_all_stays_out_of_the_epoch_its_rows_were_redone_in():
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock)
        first, second = await both_results(fs, bs, clock)
        clock.now += fs.settings.worker_lost_s  # w2 froze: judged gone, its rows go to a redo
        redo = await poll(fs, "w1", 0)
        assert redo is not None and redo.kind == Kind.REDO
        assert await poll(fs, "w2", 0) is None  # w2 thaws and polls: it gets no work of the epoch...
        with pytest.raises(Refused, match="judged gone"):  # ...and its result, pushed again, no longer counts
            await fs.push_input_grads(grads(second, "w2"), "w2")
        await handled(fs, fs.push_input_grads(grads(redo, "w1"), "w1"))
        assert (await deposited(fs, "w1", 0)).task is None and fs.state.closed_epoch == 0
        assert members(fs.state.closures[0]) == ["w1"]  # w2 polled, yet is out
        assert fs.epoch_stats(0).rows_grouped == ROWS

    asyncio.run(scenario())


def test_at_the_second_fs_of_a_stage_a_worker_judged_gone_that_polls_again_does_not_hold_the_epoch_open():
    """With two FS, an FS waits for every worker it knows to poll (any may hold rows of the other's segment); one it
    judged gone, whose rows it had redone, is out of the epoch there even when it polls again (it was only silent:
    a worker held in a poll at a frozen FS), or the epoch would never close."""
    async def scenario() -> None:
        clock = Clock()
        layout = Layout((StageServers(fs=("fs", "fs2"), bs=("bs",)),))
        fs2, _ = servers(clock=clock, fs_id="fs2")  # the stage's second FS
        (_, segment), = [(peer, rows) for peer, rows in layout.route(0, "fs", Rows(0, ROWS), ROWS) if peer == "fs2"]
        assert await poll(fs2, "w1", 0) is None and await poll(fs2, "w2", 0) is None
        tokens = torch.randint(0, 256, (len(segment), SEQ))
        await fs2.push_rows(PushRows(epoch=0, microbatch=0, rows=segment, total_rows=ROWS, layout=layout,
                                     inputs=tokens, labels=tokens), "fs")
        await fs2.end_epoch(EndEpoch(epoch=0, abandoned=False, layout=layout), "fs")
        first, second = await poll(fs2, "w1", 0), await poll(fs2, "w2", 0)
        for task, worker in ((second, "w2"), (first, "w1")):  # w1's result, 0.5 s after w2's, completes the epoch
            await handled(fs2, fs2.push_input_grads(dataclasses.replace(grads(task, worker), issuer="fs2"), worker))
            clock.now += 0.5
        clock.now += fs2.settings.worker_lost_s  # w2 silent: judged gone, its rows here go to a redo
        redo = await poll(fs2, "w1", 0)
        assert redo is not None and redo.kind == Kind.REDO and redo.rows == second.rows
        assert await poll(fs2, "w2", 0) is None  # w2 polls again: alive after all, and out of the epoch here
        await handled(fs2, fs2.push_input_grads(dataclasses.replace(grads(redo, "w1"), issuer="fs2"), "w1"))
        await deposited(fs2, "w1", 0)
        assert fs2.state.closed_epoch == 0
        assert "w2" not in members(fs2.state.closures[0])

    asyncio.run(scenario())


def test_under_the_swarm_policy_a_vanished_workers_rows_are_dropped_and_named_for_the_data_source_to_feed_again():
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock, config=dataclasses.replace(CONFIG, fault_policy="swarm"))
        assert await poll(fs, "w1", 0) is None and await poll(fs, "w2", 0) is None
        await feed(fs, 0)
        first, second = await poll(fs, "w1", 0), await poll(fs, "w2", 0)
        await handled(fs, fs.push_input_grads(grads(second, "w2"), "w2"))  # w2 vanishes before it sends the loss
        clock.now += 0.5
        await handled(fs, fs.push_input_grads(grads(first, "w1"), "w1"))
        await bs.push_outputs(loss(first, "w1"), "w1")
        clock.now += fs.settings.worker_lost_s
        assert (await deposited(fs, "w1", 0, ROWS // 2)).task is None  # no redo: it closes without w2's rows
        assert fs.state.closed_epoch == 0 and fs.state.pool.redone.get(0, 0) == 0
        assert members(fs.state.closures[0]) == ["w1"]
        stats = fs.epoch_stats(0)
        assert (stats.rows_grouped, stats.rows_dropped, stats.rows_recomputed, stats.workers_lost) == (
            ROWS // 2, ROWS // 2, 0, 1)
        for _ in range(100):  # the BS hears of the drop, and counts w2's rows through with no loss
            if bs.state.closed_epoch == 0:
                break
            await asyncio.sleep(0.01)
        assert bs.state.closed_epoch == 0 and bs.epoch_stats(0).tokens == (ROWS // 2) * SEQ
        state = await fs.ask_epoch(AskEpoch(epoch=1), "fs")
        assert state.dropped == (MicrobatchRef(epoch=0, microbatch=0),)

    asyncio.run(scenario())


def test_a_killed_worker_is_known_gone_as_soon_as_a_probe_cannot_reach_it():
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock, workers=("w1",))  # w2 is killed after its result: its process is gone
        first, second = await both_results(fs, bs, clock)
        assert await poll(fs, "w1", 0) is None and fs.state.closed_epoch == -1  # w2 silent 1 s: probed now
        await asyncio.sleep(0.05)  # the probe fails: no process answers
        assert fs.state.workers["w2"].unreachable > 0 and fs.gone("w2")
        redo = await poll(fs, "w1", 0)  # long before worker_lost_s
        assert clock.now - fs.state.workers["w2"].last_seen < fs.settings.worker_lost_s
        assert redo is not None and redo.kind == Kind.REDO and redo.rows == second.rows
        assert fs.state.workers["w1"].probed == 0.0  # a worker that polls is never probed

    asyncio.run(scenario())


def test_a_worker_that_leaves_has_its_rows_redone_without_waiting_for_its_silence():
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock)
        assert await poll(fs, "w1", 0) is None and await poll(fs, "w2", 0) is None
        await feed(fs, 0)
        first, second = await poll(fs, "w1", 0), await poll(fs, "w2", 0)
        await handled(fs, fs.push_input_grads(grads(second, "w2"), "w2"))
        assert await fs.leave(Leave(worker="w2"), "w2") == Ack()  # stops, holding the gradients of its rows
        await handled(fs, fs.push_input_grads(grads(first, "w1"), "w1"))
        redo = await poll(fs, "w1", 0)  # no clock moved: w2 said it is gone
        assert redo is not None and redo.rows == second.rows
        assert await poll(fs, "w2", 0) is None  # a worker that left gets nothing more

    asyncio.run(scenario())


def test_leases_follow_a_workers_measured_speed_and_bans_last_longer_each_time():
    async def scenario() -> None:
        clock = Clock()
        fs, _ = servers(clock=clock)
        await feed(fs, 0)
        task = await poll(fs, "w1", 0)
        # not timed yet: the timeout, plus what the task's activations need at the slowest uplink allowed for
        settings, (seq, hidden) = fs.settings, fs.hidden_shape
        bound = settings.lease_timeout_s + settings.deadline_slack * 2 * ROWS * seq * hidden * 4 / settings.slowest_uplink
        assert fs.state.pool.lease(task.task).deadline == pytest.approx(clock.now + bound)
        clock.now += 0.5
        await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1"))
        assert fs.state.workers["w1"].seconds_per_row == pytest.approx(0.5 / ROWS)
        await feed(fs, 1)
        clock.now += 0.1
        task = await poll(fs, "w1", 1)
        expected = max(fs.settings.lease_min_s, fs.settings.lease_slack * 0.5)
        assert fs.state.pool.lease(task.task).deadline == pytest.approx(clock.now + expected)

        record = fs.state.workers["w1"]
        for ban in (1, 2):
            for _ in range(fs.settings.refusals_before_ban):
                with pytest.raises(Refused):
                    await fs.refuse_result(task="t", worker="w1", epoch=1, issuer=None, error="bad")
            assert record.bans == ban
            assert record.banned_until == clock.now + fs.settings.ban_s * 2 ** (ban - 1)
            assert await poll(fs, "w1", 1) is None  # banned: no task while the ban lasts
            assert fs.condition() == "workers banned"  # its only worker: the status says why the stage waits
            clock.now = record.banned_until
        assert await poll(fs, "w1", 1) is not None  # the ban is over; the task went back after its lease
        assert fs.condition() == "training"

    asyncio.run(scenario())


def end(epoch: int, *, abandoned: bool) -> EndEpoch:
    return EndEpoch(epoch=epoch, abandoned=abandoned, layout=LAYOUT)


def test_a_replica_announced_before_its_first_poll_is_in_the_first_group_and_one_that_never_polls_is_waited_for_once():
    """The data source may feed epoch 0 before a BS's replica has found its FS in the DHT: the FS, told which servers
    of its stage announced that they hold the state, waits for such a replica's first poll, as for its own, for
    `worker_lost_s` at most; one that stayed silent is not waited for again while its record stays in the DHT."""
    async def scenario() -> None:
        clock = Clock()
        fs, _ = servers(clock=clock)
        fs.expect_replicas({"bs"})
        clock.now += 1.0

        await computed_and_deposited(fs, clock, 0)
        assert fs.state.closed_epoch == -1  # every row deposited, but the replica has not polled yet
        replica = TakeTask(worker="bs", compute=1.0, epoch=0, holds_state=True)
        await fs.take_task(replica, "bs")
        assert fs.state.closed_epoch == 0 and members(fs.state.closures[0]) == ["bs", "w1"]
        fs.expect_replicas({"bs", "bs2"})  # bs2 announced itself, then died before its first poll
        clock.now += 1.0
        await computed_and_deposited(fs, clock, 1)
        await fs.take_task(dataclasses.replace(replica, epoch=1), "bs")
        assert fs.state.closed_epoch == 0
        clock.now += fs.settings.worker_lost_s
        await fs.take_task(dataclasses.replace(replica, epoch=1), "bs")
        await deposited(fs, "w1", 1)
        assert fs.state.closed_epoch == 1 and members(fs.state.closures[1]) == ["bs", "w1"]
        fs.expect_replicas({"bs", "bs2"})  # its record lingers in the DHT
        await computed_and_deposited(fs, clock, 2)
        await fs.take_task(dataclasses.replace(replica, epoch=2), "bs")
        assert fs.state.closed_epoch == 2 and members(fs.state.closures[2]) == ["bs", "w1"]

    asyncio.run(scenario())


def test_the_fss_own_replica_held_past_worker_lost_s_is_waited_for_and_a_silent_remote_one_is_not():
    """The stage's replica in the FS's own process lives as long as the FS: its loop held past `worker_lost_s` (by a
    round that fails at its deadline), it is neither gone nor left out of the next group, which would step without
    it. A remote replica silent that long is gone (its worker keeps it heard while it waits: `Worker._heard_by`)."""
    async def scenario() -> None:
        clock = Clock()
        fs, _ = servers(clock=clock)
        own = TakeTask(worker="fs", compute=1.0, epoch=0, holds_state=True)
        remote = TakeTask(worker="bs", compute=1.0, epoch=0, holds_state=True)

        fs.expect_replicas({"fs", "bs"})
        await computed_and_deposited(fs, clock, 0)
        for replica in (own, remote):
            await fs.take_task(replica, replica.worker)
        assert fs.state.closed_epoch == 0 and members(fs.state.closures[0]) == ["bs", "fs", "w1"]
        for replica in (own, remote):
            await fs.take_task(dataclasses.replace(replica, epoch=1), replica.worker)
        clock.now += fs.settings.worker_lost_s + 1.0  # neither replica polls meanwhile
        await computed_and_deposited(fs, clock, 1)
        assert fs.gone("bs") and not fs.gone("fs")
        assert fs.state.closed_epoch == 0  # the FS's own replica is waited for
        await fs.take_task(dataclasses.replace(own, epoch=1), "fs")
        assert fs.state.closed_epoch == 1 and members(fs.state.closures[1]) == ["fs", "w1"]

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_worker_whose_loop_waits_past_worker_lost_s_is_heard_by_its_fs_over_the_network_meanwhile():
    """A worker's loop held between polls (its round failing at its deadline, a state download) probes its FS every
    quarter of `worker_lost_s` over real P2P on 127.0.0.1: the FS's node hears it, and does not count it gone until
    the wait ends and it stays silent."""
    async def scenario() -> None:
        settings = RuntimeConfig(worker_lost_s=0.8)
        async with loopback_p2ps(2, timeout=20) as (fs_p2p, worker_p2p):
            fs_id, worker_id = fs_p2p.peer_id.to_base58(), worker_p2p.peer_id.to_base58()
            fs = FrontalServer(peer_id=fs_id, stage=0, config=CONFIG, settings=settings,
                               caller=Caller(p2p=fs_p2p, peer_id=fs_id, codec="none", timeout=10.0))
            await LinkProbe(peer_id=fs_id, hearing=fs.hearing).add_p2p_handlers(fs_p2p)
            caller = Caller(p2p=worker_p2p, peer_id=worker_id, codec="none", timeout=10.0)
            start, end = CONFIG.stage_layers(0)
            worker = Worker(worker_id=worker_id, stage=0, config=CONFIG, settings=settings, caller=caller,
                            model=build_stage(CONFIG.model_config, start=start, end=end, seed=CONFIG.seed),
                            averager=StageAllReduce(p2p=None, run_id=CONFIG.run_id, stage=0, timeout=1.0,
                                                    caller=caller),
                            servers=lambda: ([fs_id], []), compute=1.0)
            await fs.take_task(TakeTask(worker=worker_id, compute=1.0, epoch=0), worker_id)
            async with worker._heard_by([fs_id]):
                await asyncio.sleep(3 * settings.worker_lost_s)
                assert not fs.gone(worker_id)
            await asyncio.sleep(1.5 * settings.worker_lost_s)
            assert fs.gone(worker_id)

    asyncio.run(scenario())


def test_an_fs_closes_an_epoch_only_once_the_data_source_committed_it():
    async def scenario() -> None:
        fs, _ = servers()
        await feed(fs, 0, commit=False)
        assert not (await fs.ask_epoch(AskEpoch(epoch=0), "fs")).complete
        task = await take(fs, "w1", 0)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert fs.state.closed_epoch == -1 and not fs.state.closures  # complete, but no stage steps before commit
        assert (await fs.ask_epoch(AskEpoch(epoch=0), "fs")).complete
        with pytest.raises(Refused, match="not the data source"):  # a worker cannot end epochs
            await fs.end_epoch(end(0, abandoned=False), "w1")
        await deposited(fs, "w1", 0)
        assert fs.state.closed_epoch == -1
        assert await fs.end_epoch(end(0, abandoned=False), "fs") == Ack()
        assert fs.state.closed_epoch == 0 and not fs.state.closures[0].abandoned
        with pytest.raises(Refused, match="cannot be abandoned"):  # a stage may have stepped on it
            await fs.end_epoch(end(0, abandoned=True), "fs")

    asyncio.run(scenario())


def test_the_data_source_waiting_on_its_fs_is_woken_as_rows_come_back_and_as_the_epoch_closes():
    async def scenario() -> None:
        fs, _ = servers()
        stop = asyncio.Event()

        def waiting(ready: Callable[[], bool]) -> asyncio.Future:  # no look before an hour: only a wake ends it
            return asyncio.ensure_future(fs.progress.until(ready, stop, check_s=3600.0))

        await feed(fs, 0, commit=False)
        assert fs.in_flight() == 1
        free, complete = waiting(lambda: fs.in_flight() == 0), waiting(lambda: bool(fs.state.completed.get(0)))
        closed = waiting(lambda: fs.state.closed_epoch >= 0)
        task = await take(fs, "w1", 0)
        fs.progress.moved()  # a wake whose state is not ready leaves the waiters waiting
        await asyncio.sleep(0.05)
        assert not (free.done() or complete.done() or closed.done())
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await asyncio.wait_for(asyncio.gather(free, complete), 5.0) == [True, True]
        assert not closed.done()
        await deposited(fs, "w1", 0)
        assert await fs.end_epoch(end(0, abandoned=False), "fs") == Ack()
        assert await asyncio.wait_for(closed, 5.0)
        stopped = asyncio.ensure_future(fs.progress.until(lambda: False, stop, check_s=0.05))
        stop.set()
        assert await asyncio.wait_for(stopped, 5.0) is False

    asyncio.run(scenario())


def test_an_abandoned_epoch_is_dropped_by_every_server_and_its_workers_drop_it_alike():
    async def scenario() -> None:
        fs, bs = servers()
        await feed(fs, 0, commit=False)
        task = await take(fs, "w1", 0)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await fs.end_epoch(end(0, abandoned=True), "fs") == Ack()
        assert await bs.end_epoch(end(0, abandoned=True), "fs") == Ack()
        assert await fs.end_epoch(end(0, abandoned=True), "fs") == Ack(again=True)  # a repeat after a lost reply
        for server in (fs, bs):
            assert server.state.closed_epoch == 0 and server.epoch_stats(0).abandoned
            assert not server.state.microbatches and not server.state.pool.to_dict()["pending"]
        assert fs.state.closures[0] == Closure(epoch=0, fs=("fs",), group=(), abandoned=True)
        assert not fs.state.results and not fs.state.accepted
        with pytest.raises(Refused, match="ended"):  # a late result of the abandoned epoch counts nowhere
            await bs.push_outputs(loss(task, "w1"), "w1")
        reply = await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")
        assert judge(0, {"fs": reply}) == Verdict(epoch_fs=(), abandoned=True)

        # the batch comes again as the next epoch, and trains as any other
        await feed(fs, 1)
        task = await take(fs, "w1", 1)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await deposited(fs, "w1", 1)
        assert fs.state.closed_epoch == 1 and not fs.state.closures[1].abandoned

    asyncio.run(scenario())


def test_a_server_laid_out_after_an_abandoned_epoch_closes_it_as_abandoned_for_the_workers_that_held_rows_of_it():
    """Epoch 0's only FS of the stage died before it closed 0, and the data source abandoned it; fs2, which the DHT
    showed only later, is the stage's FS from epoch 1 on. Told of the abandon, it tells epoch 0's workers to drop its
    rows; without that, its start at epoch 1 would stand past epoch 0 with no closure of it, which a worker of epoch 0
    takes for its stage having stepped without it (it would wait for a mate's newer state that nobody has)."""
    async def scenario() -> None:
        fs2, _ = servers(fs_id="fs2")
        with pytest.raises(Refused, match="no FS of stage 0 in epoch 0's layout"):  # only an abandon is news to it
            await fs2.end_epoch(end(0, abandoned=False), "fs")
        with pytest.raises(Refused, match="not the data source"):
            await fs2.end_epoch(end(0, abandoned=True), "w1")
        assert await fs2.end_epoch(end(0, abandoned=True), "fs") == Ack()
        assert await fs2.end_epoch(end(0, abandoned=True), "fs") == Ack(again=True)  # a repeat after a lost reply
        assert fs2.state.closed_epoch == 0
        assert fs2.state.closures[0] == Closure(epoch=0, fs=("fs",), group=(), abandoned=True)
        reply = await fs2.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")
        assert judge(0, {"fs2": reply}, epoch_fs=("fs",), gone={"fs"}) == Verdict(epoch_fs=(), abandoned=True)

        await feed(fs2, 1, commit=False, layout=Layout((StageServers(fs=("fs2",), bs=("bs",)),)))
        assert (await take(fs2, "w1", 1)).epoch == 1  # the batch comes again as epoch 1

        # a server that holds rows of its own epochs took part in the swarm: it cannot skip to an abandoned one
        fs3, _ = servers(fs_id="fs3")
        await feed(fs3, 1, commit=False, layout=Layout((StageServers(fs=("fs3",), bs=("bs",)),)))
        with pytest.raises(Refused, match="holds rows of others"):
            await fs3.end_epoch(end(2, abandoned=True), "fs")

    asyncio.run(scenario())


def test_a_restarted_server_takes_the_swarms_epoch_and_an_abandon_waits_for_the_epoch_closing_before_it():
    async def scenario() -> None:
        fs, _ = servers()  # a server restarted empty: the swarm is at epoch 5, which it never saw
        assert await fs.end_epoch(end(5, abandoned=True), "fs") == Ack()
        assert fs.state.closed_epoch == 5 and fs.state.closures[5].abandoned

        # epoch 6 is complete but its workers have not polled since; epoch 7 is abandoned meanwhile
        clock = Clock()
        fs, _ = servers(clock=clock)
        await feed(fs, 6, commit=False)
        task = await take(fs, "w1", 6)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await feed(fs, 7, commit=False)
        assert await fs.end_epoch(end(7, abandoned=True), "fs") == Ack()
        assert fs.state.closed_epoch == 5 and fs.ended(7)  # 6 must close first, with its group
        clock.now += 1.0
        await fs.end_epoch(end(6, abandoned=False), "fs")
        await deposited(fs, "w1", 6)
        assert fs.state.closed_epoch == 7
        assert members(fs.state.closures[6]) == ["w1"]
        assert fs.state.closures[7].abandoned

    asyncio.run(scenario())


def test_a_server_restored_behind_its_stage_mates_closes_the_epochs_between_and_its_workers_catch_up():
    async def scenario() -> None:
        fs, _ = servers()
        fs.resume(epoch=4, batch=3)  # its checkpoint is of epoch 4; a stage mate's is of epoch 7
        fs.expect_replica("fs")
        assert (await fs.ask_epoch(AskEpoch(epoch=0), "fs")).state_epoch == 4
        with pytest.raises(Refused, match="not the data source"):
            await fs.end_epoch(EndEpoch(epoch=6, abandoned=False, caught_up=True, layout=LAYOUT), "w1")
        assert await fs.end_epoch(EndEpoch(epoch=6, abandoned=False, caught_up=True, layout=LAYOUT), "fs") == Ack()
        assert fs.state.closed_epoch == 6 and not fs.state.closures
        assert await fs.end_epoch(EndEpoch(epoch=5, abandoned=False, caught_up=True, layout=LAYOUT), "fs") == \
            Ack(again=True)
        # its replica, at epoch 4, finds no group of epochs 4 to 6: it loads a mate's state of epoch 7
        reply = await fs.take_task(TakeTask(worker="fs", compute=1.0, epoch=4, holds_state=True), "fs")
        assert judge(4, {"fs": reply}) == Verdict(epoch_fs=(), catch_up_to=7)
        with pytest.raises(MessageError, match="either abandoned or caught up"):
            EndEpoch.from_header({**EndEpoch(epoch=6, abandoned=True, layout=LAYOUT).to_header(), "caught_up": True})

    asyncio.run(scenario())


def test_a_replica_one_epoch_behind_an_epoch_closed_without_a_group_is_left_out_of_the_next_group():
    """A server restored from a checkpoint one epoch older than its stage mate's closes that epoch without a group
    (`catch_up`): its replica, at that epoch, cannot step it, so it catches up by loading a mate's state and never takes
    part in the next epoch's round; in that round's group it would hold every member until the timeout, and the mate
    it loads from would wait for the round (seen in a swarm killed whole and resumed). Back at the stage's epoch, it is
    in the groups again."""
    async def scenario() -> None:
        fs, _ = servers()
        fs.resume(epoch=5, batch=4)  # its checkpoint is of epoch 5; a stage mate's is of epoch 6
        fs.expect_replica("fs")
        assert await fs.end_epoch(EndEpoch(epoch=5, abandoned=False, caught_up=True, layout=LAYOUT), "fs") == Ack()
        replica = TakeTask(worker="fs", compute=1.0, epoch=5, holds_state=True)
        await fs.take_task(replica, "fs")
        await feed(fs, 6)
        task = await take(fs, "w1", 6)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await deposited(fs, "w1", 6)
        reply = await fs.take_task(replica, "fs")
        assert fs.state.closed_epoch == 6 and members(fs.state.closures[6]) == ["w1"]
        assert judge(5, {"fs": reply}) == Verdict(epoch_fs=(), catch_up_to=7)
        await feed(fs, 7)
        task = await take(fs, "w1", 7)
        assert await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        await deposited(fs, "w1", 7)
        await fs.take_task(dataclasses.replace(replica, epoch=7), "fs")  # it loaded a mate's state of epoch 7
        assert fs.state.closed_epoch == 7 and members(fs.state.closures[7]) == ["fs", "w1"]

    asyncio.run(scenario())


def test_a_server_left_out_of_some_epochs_layouts_closes_them_when_rows_of_a_later_one_come():
    """A server lost for a while (or restarted, and told where its stage stands) is laid out again from epoch 7 on:
    epochs 5 and 6, laid out without it, never come here. One that still holds rows of an earlier epoch waits for it."""
    async def scenario() -> None:
        fs, _ = servers()
        fs.resume(epoch=5, batch=4)  # through epoch 4
        await feed(fs, 7, commit=False)
        assert fs.state.closed_epoch == 6 and not fs.ended(7)

        fs, _ = servers()
        fs.resume(epoch=5, batch=4)
        await feed(fs, 5, commit=False)
        await feed(fs, 6, commit=False)
        assert fs.state.closed_epoch == 4

    asyncio.run(scenario())


async def until(ready: Callable[[], bool], timeout: float = 5.0) -> None:
    """Until `ready()`, for a scenario of live tasks (a watch pinging, a feeder telling); fails past `timeout`."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_an_fs_restarted_while_its_stage_closes_an_epoch_is_told_at_once_what_it_missed_and_no_worker_waits_for_it():
    """Epoch 0 is committed, and fsb's stage mate fs closed it; fsb died before it closed it, and epoch 1, open
    then, was abandoned while fsb was lost. The workers step epoch 0 once every FS of its layout closed it, and a
    restarted fsb, knowing nothing of it, would never close it (a deadlock seen in CI). The data source's watch sees
    fsb answer again with a new start; the data source tells it at once, with no epoch of its own closing meanwhile,
    that its stage stands past epoch 0 and that epoch 1 was abandoned."""
    two = Layout((StageServers(fs=("fs", "fsb"), bs=("bs",)),))
    closure = Closure(epoch=0, fs=("fs", "fsb"), group=(GroupMember(peer_id="w1", client_mode=False, rows=ROWS),))
    mate = TaskReply(closed_epoch=0, closures=(closure,))  # what fs answers a worker of epoch 0

    async def scenario() -> None:
        source, _ = servers()  # fs: the data source's FS
        local = source.caller.local
        restarted = FrontalServer(peer_id="fsb", stage=0, config=CONFIG, settings=RuntimeConfig(),
                                  caller=Caller(p2p=None, peer_id="fsb", codec="none", timeout=10.0, local=local))
        local[("fsb", LINK_PROBE)] = LinkProbe(peer_id="fsb", started=1.0)
        watch = ServerWatch(caller=source.caller, servers=lambda: ["fsb"], period_s=0.01, lost_s=0.05,
                            timeout_s=0.05)
        feeder = DataFeeder(server=source, source=None, layout=lambda: two, is_leader=lambda peer: peer == "fs",
                            epochs=3, max_in_flight=1, watch=watch)
        # where `_feed_epochs` stands: epoch 0 committed; epoch 1 abandoned, heard of by all but fsb
        feeder._committed = (0, two)
        feeder._abandoned = {1: (two, {"fs", "bs"})}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(watch.run(stop)), asyncio.create_task(feeder._tell_returned(stop))]

        await until(lambda: watch.started.get("fsb") == 1.0)
        local[("fsb", LINK_PROBE)] = LinkProbe(peer_id="fsb", delay_s=10.0, started=1.0)  # silent: killed
        await until(lambda: "fsb" in watch.lost)
        local[("fsb", FRONTAL_SERVER)] = restarted
        reply = await restarted.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")
        assert judge(0, {"fs": mate, "fsb": reply}) == Verdict(epoch_fs=("fs", "fsb"))  # waits for fsb
        local[("fsb", LINK_PROBE)] = LinkProbe(peer_id="fsb", started=2.0)  # back, restarted
        await until(lambda: restarted.state.closed_epoch == 1)
        assert "fsb" not in watch.lost and "fsb" in feeder._abandoned[1][1]
        reply = await restarted.take_task(TakeTask(worker="w1", compute=1.0, epoch=0), "w1")
        assert judge(0, {"fs": mate, "fsb": reply}) == Verdict(epoch_fs=("fs", "fsb"), group=closure.group)
        assert judge(1, {"fs": mate, "fsb": reply}).abandoned  # fsb's word suffices: fs may not have answered yet
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_commit_retried_while_its_fs_restarts_never_reaches_the_new_process():
    """The data source commits epoch 0 to fsb just as fsb is SIGKILLed, and retries after a back-off; meanwhile its
    watch holds fsb lost, and fsb restarts with its identity. The retry must not land at the new process: it holds
    nothing of epoch 0, and a commit there would stand for rows that nobody reports (seen in CI: a stage's rows of
    an epoch missing from the status, with no log saying why). The data source says it could not commit there; the
    restarted fsb hears where its stage stands from `_tell` instead."""
    two = Layout((StageServers(fs=("fs", "fsb"), bs=("bs",)),))

    async def scenario() -> None:
        source, _ = servers()
        source.settings = dataclasses.replace(source.settings, push_backoff_s=1.0)  # the retry comes after the restart
        local = source.caller.local
        local[("fsb", LINK_PROBE)] = LinkProbe(peer_id="fsb", started=1.0)
        watch = ServerWatch(caller=source.caller, servers=lambda: ["fsb"], period_s=0.01, lost_s=0.05,
                            timeout_s=0.05)
        feeder = DataFeeder(server=source, source=None, layout=lambda: two, is_leader=lambda peer: peer == "fs",
                            epochs=3, max_in_flight=1, watch=watch)
        stop = asyncio.Event()
        watching = asyncio.create_task(watch.run(stop))

        await until(lambda: watch.started.get("fsb") == 1.0)
        local[("fsb", LINK_PROBE)] = LinkProbe(peer_id="fsb", delay_s=10.0, started=1.0)  # killed: no FS either
        started = time.monotonic()
        commit = asyncio.create_task(feeder._end(0, two, abandoned=False, batch=0, stop=stop, only={"fsb"}))
        await until(lambda: "fsb" in watch.lost)
        restarted = FrontalServer(peer_id="fsb", stage=0, config=CONFIG, settings=RuntimeConfig(),  # serves at once
                                  caller=Caller(p2p=None, peer_id="fsb", codec="none", timeout=10.0, local=local))
        local[("fsb", LINK_PROBE)] = LinkProbe(peer_id="fsb", started=2.0)
        await until(lambda: watch.started.get("fsb") == 2.0)
        assert time.monotonic() - started < 1.0, "the retry came before the restart: this tests nothing"
        assert await asyncio.wait_for(commit, 5.0) == set()
        assert not restarted.state.committed and watch.restarts["fsb"] == 1
        stop.set()
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)

    asyncio.run(scenario())


def test_an_idle_fs_holds_polls_until_its_news_and_answers_them_at_once_when_rows_come_or_are_all_back():
    """A quiet swarm polls little (issue 21): while nothing of the open epoch is out, the FS holds a poll up to its
    `idle_wait_s` and says it was quiet (no backward task can be waiting); rows that come answer a worker's held
    poll with a task at once, and a replica's (it takes no tasks) is answered once the epoch's rows are all back,
    so that its next poll, fresh, lets the epoch close without waiting out the hold. A BS never holds one long."""
    async def scenario() -> None:
        fs, bs = servers()
        loop = asyncio.get_running_loop()
        idle = TakeTask(worker="w1", compute=1.0, epoch=0, idle_wait_s=0.3)
        start = loop.time()
        reply = await fs.take_task(idle, "w1")
        assert reply.task is None and reply.quiet and loop.time() - start >= 0.3
        start = loop.time()
        assert not (await bs.take_task(idle, "w1")).quiet and loop.time() - start < 0.3

        held = asyncio.create_task(fs.take_task(dataclasses.replace(idle, idle_wait_s=30.0), "w1"))
        replica = TakeTask(worker="bs", compute=1.0, epoch=0, holds_state=True, idle_wait_s=30.0)
        replica_held = asyncio.create_task(fs.take_task(replica, "bs"))
        await asyncio.sleep(0.2)
        assert not held.done() and not replica_held.done()
        await feed(fs, 0)
        task = (await asyncio.wait_for(held, 2.0)).task
        assert task is not None and task.rows == Rows(0, ROWS)
        await asyncio.sleep(0.2)
        assert not replica_held.done()  # rows are out: nothing for it yet
        reply = await fs.take_task(dataclasses.replace(idle, idle_wait_s=30.0), "w1")  # in flight: not held long
        assert reply.task is None and not reply.quiet
        await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1"))
        assert not (await asyncio.wait_for(replica_held, 2.0)).quiet
        await deposited(fs, "w1", 0)
        await asyncio.wait_for(fs.take_task(replica, "bs"), 2.0)
        assert fs.state.closed_epoch == 0 and members(fs.state.closures[0]) == ["bs", "w1"]
        start = loop.time()  # epoch 0 closed: a poll of epoch 1 is held again, and one of epoch 0 answered at once
        assert (await fs.take_task(dataclasses.replace(idle, epoch=1), "w1")).quiet and loop.time() - start >= 0.3
        start = loop.time()
        assert not (await fs.take_task(dataclasses.replace(idle, idle_wait_s=30.0), "w1")).quiet
        assert loop.time() - start < 1.0
        # however long a worker asks, a hold ends within half the time after which the FS counts a silent worker gone
        fs.settings = dataclasses.replace(fs.settings, worker_lost_s=0.8)
        start = loop.time()
        assert (await fs.take_task(dataclasses.replace(idle, epoch=1, idle_wait_s=30.0), "w1")).quiet
        assert 0.4 <= loop.time() - start < 1.0 and not fs.gone("w1")

    asyncio.run(scenario())


def test_a_poll_whose_reply_tells_the_worker_to_deposit_or_to_step_is_answered_at_once():
    """At the epoch boundary (issue 21): once every row is back, a worker holding undeposited rows is told at once
    where to deposit, and the poll whose deposit lets the FS close the epoch is answered at once with the closure;
    a hold there would only stall the stage. A worker with nothing to deposit is held as before."""
    async def scenario() -> None:
        fs, _ = servers()
        loop = asyncio.get_running_loop()
        await feed(fs, 0)
        task = await take(fs, "w1", 0)
        await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1"))
        start = loop.time()
        held = await fs.take_task(TakeTask(worker="w2", compute=1.0, epoch=0, wait_s=0.3), "w2")
        assert held.deposit_to == "fs" and loop.time() - start >= 0.3  # w2 holds no rows: nothing to do at once
        start = loop.time()
        reply = await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=0, wait_s=30.0), "w1")
        assert reply.task is None and reply.deposit_to == "fs" and loop.time() - start < 1.0
        reply = await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=0, wait_s=30.0, deposited=ROWS), "w1")
        assert fs.state.closed_epoch == 0 and loop.time() - start < 2.0
        assert judge(0, {"fs": reply}).group == fs.state.closures[0].group
        start = loop.time()  # a worker of the next epoch, with no rows out yet, is held again
        assert (await fs.take_task(TakeTask(worker="w1", compute=1.0, epoch=1, wait_s=0.3), "w1")).task is None
        assert loop.time() - start >= 0.3

    asyncio.run(scenario())


def test_a_first_stage_worker_awaiting_its_backward_task_waits_for_it_at_the_bs_instead_of_polling_in_a_loop():
    """Issue 21: a stage-0 worker that holds forward states and whose FS had no work for it holds its next poll at
    the stage's only BS, which answers it as soon as the backward task is there: one call, where short polls of the
    BS and the FS in turn would have come back empty first."""
    async def scenario() -> None:
        config = RunConfig(num_stages=2, rows_per_microbatch=ROWS, microbatches=1, seq_len=SEQ)
        layout = Layout((StageServers(fs=("fs0",), bs=("bs0",)), StageServers(fs=("fs1",), bs=("bs1",))))
        local: dict = {}
        settings = RuntimeConfig()

        def caller(peer: str) -> Caller:
            return Caller(p2p=None, peer_id=peer, codec="none", timeout=10.0, local=local)

        fs0 = FrontalServer(peer_id="fs0", stage=0, config=config, settings=settings, caller=caller("fs0"))
        bs0 = BackwardServer(peer_id="bs0", stage=0, config=config, settings=settings, caller=caller("bs0"))
        fs1 = FrontalServer(peer_id="fs1", stage=1, config=config, settings=settings, caller=caller("fs1"))
        start, end = config.stage_layers(0)
        worker = Worker(worker_id="w", stage=0, config=config, settings=settings, caller=caller("w"),
                        model=build_stage(config.model_config, start=start, end=end, seed=config.seed),
                        averager=StageAllReduce(p2p=None, run_id=config.run_id, stage=0, timeout=1.0,
                                                caller=caller("w")),
                        servers=lambda: (["fs0"], ["bs0"]), compute=1.0)
        tokens = torch.randint(0, 256, (ROWS, SEQ))
        await fs0.push_rows(PushRows(epoch=0, microbatch=0, rows=Rows(0, ROWS), total_rows=ROWS, layout=layout,
                                     inputs=tokens, labels=tokens), "fs0")
        forward, _ = await worker._take(["fs0"], ["bs0"])
        await worker._run_task(forward)
        await worker._pushed()
        await bs0.drain()
        assert worker.cache and fs1.state.microbatches  # its outputs went on to stage 1
        assert await worker._take(["fs0"], ["bs0"]) == (None, {"fs0": mock.ANY})  # nothing anywhere for now

        async def backward_comes() -> None:
            await asyncio.sleep(0.03)
            grad = torch.zeros(ROWS, *bs0.hidden_shape)
            await bs0.push_output_grads(PushOutputGrads(epoch=0, microbatch=0, rows=Rows(0, ROWS), grad=grad), "fs1")

        polls = METER.served_snapshot().get("rpc_take_task", 0)
        (backward, _), _ = await asyncio.gather(worker._take(["fs0"], ["bs0"]), backward_comes())
        assert backward is not None and backward.task.kind == Kind.BACKWARD
        assert METER.served_snapshot()["rpc_take_task"] - polls == 1
        for server in (fs0, bs0, fs1):
            await server.shutdown()

    asyncio.run(scenario())


def test_a_diloco_round_waits_for_a_worker_with_rows_earlier_in_the_interval_that_took_none_of_the_round_epoch():
    """DiLoCo (`average_every` 2): a worker that trained rows in epoch 0 but took none of epoch 1 (the round's) still
    holds its steps' sum: the round's closure waits for its poll and groups it with its interval's rows; only once it
    is gone does the round go on without it."""
    async def scenario() -> None:
        clock = Clock()
        config = dataclasses.replace(CONFIG, average_every=2, dpu=False)
        fs, _ = servers(clock=clock, config=config)
        assert await poll(fs, "w1", 0) is None and await poll(fs, "w2", 0) is None
        await feed(fs, 0)
        halves = {worker: await poll(fs, worker, 0) for worker in ("w1", "w2")}
        for worker, task in halves.items():
            assert task is not None and len(task.rows) == ROWS // 2
            await handled(fs, fs.push_input_grads(grads(task, worker), worker))
        for worker in halves:
            await poll(fs, worker, 0)
        assert fs.state.closed_epoch == 0 and fs.state.interval_rows == {"w1": ROWS // 2, "w2": ROWS // 2}

        for epoch, w2_polls in ((1, True), (3, False)):
            if epoch == 3:  # epoch 2 as epoch 0, but w2 keeps silent after it
                await feed(fs, 2)
                halves = {worker: await poll(fs, worker, 2) for worker in ("w1", "w2")}
                for worker, task in halves.items():
                    await handled(fs, fs.push_input_grads(grads(task, worker), worker))
                    await poll(fs, worker, 2)
                assert fs.state.closed_epoch == 2
            clock.now += 1.0
            await feed(fs, epoch)
            while (task := await poll(fs, "w1", epoch)) is not None:  # w1 takes every row of the round's epoch
                await handled(fs, fs.push_input_grads(grads(task, "w1"), "w1"))
            assert fs.state.closed_epoch == epoch - 1  # w2 holds rows of the interval and has not polled since
            if w2_polls:
                await poll(fs, "w2", epoch)
                group = {member.peer_id: member.rows for member in fs.state.closures[epoch].group}
                assert group == {"w1": ROWS // 2 + ROWS, "w2": ROWS // 2}
            else:
                clock.now += fs.settings.worker_lost_s
                await poll(fs, "w1", epoch)
                assert members(fs.state.closures[epoch]) == ["w1"]
            assert fs.state.closed_epoch == epoch and fs.state.interval_rows == {}

    asyncio.run(scenario())


class Certificates:
    """An owner's authorizations as a server reads them (`Authority`): what it has read, and what a fresh read of
    the DHT would find; `refreshed` counts the reads it was asked for."""

    def __init__(self, *, read: set[tuple[str, int, str]], in_dht: set[tuple[str, int, str]]):
        self.read, self.in_dht, self.refreshes = read, in_dht, 0

    def data_source(self) -> str | None:
        return "fs" if ("fs", 0, "fs") in self.read else None

    def authorizes(self, peer: str, stage: int, role: str) -> bool:
        return (peer, stage, role) in self.read

    async def refreshed(self, timeout: float) -> None:
        self.refreshes += 1
        self.read = set(self.in_dht)


def test_a_layout_naming_a_server_not_read_yet_is_read_again_before_it_is_refused():
    """A server that starts after the data source has not read every certificate when the first rows come: it reads
    them again rather than refuse a sound layout (its sender would not ask again: a refused push stalled a fresh
    swarm). A layout naming a server the owner never authorized is refused after that read."""
    async def scenario() -> None:
        fs, bs = servers()
        fs.authority = Certificates(read={("fs", 0, "fs")}, in_dht={("fs", 0, "fs"), ("bs", 0, "bs")})
        await feed(fs, 0)
        assert fs.authority.refreshes == 1 and (0, 0) in fs.state.microbatches
        await feed(fs, 1)
        assert fs.authority.refreshes == 1  # nothing to read again for a layout it knows
        stranger = Layout((StageServers(fs=("fs",), bs=("bs", "stranger")),))
        tokens = torch.randint(0, 256, (ROWS, SEQ))
        with pytest.raises(Refused, match="stranger as BS of stage 0, which the run's owner did not authorize"):
            await fs.push_rows(PushRows(epoch=2, microbatch=0, rows=Rows(0, ROWS), total_rows=ROWS, layout=stranger,
                                        inputs=tokens, labels=tokens), "fs")
        assert fs.authority.refreshes == 2 and (2, 0) not in fs.state.microbatches
        bs.authority = Certificates(read=set(), in_dht={("fs", 0, "fs"), ("bs", 0, "bs")})
        with pytest.raises(Refused, match="not the data source"):  # read first: a worker is no data source
            await bs.end_epoch(end(0, abandoned=False), "w1")
        assert bs.authority.refreshes == 1

    asyncio.run(scenario())


def test_a_worker_that_may_overlap_epochs_gets_the_next_epochs_task_only_once_nothing_of_its_own_is_left_or_due():
    """`--overlap-epochs on` (issue 21): a poll with `ahead` takes a task of its own epoch first; one of the next epoch
    only when none of its own is left for it; while its deposit of its own epoch is due, one of the next epoch with
    the reply's word to deposit (it deposits as it computes); none once its own epoch ended (it steps first). A poll
    without `ahead` never gets the next epoch's."""
    async def scenario() -> None:
        fs, _ = servers()
        await feed(fs, 0, commit=False)
        await feed(fs, 1, commit=False)  # the data source fed the next epoch while epoch 0 is still out
        ahead = TakeTask(worker="w1", compute=1.0, epoch=0, ahead=True)
        first = (await fs.take_task(ahead, "w1")).task
        assert first.epoch == 0
        assert (await fs.take_task(TakeTask(worker="w2", compute=1.0, epoch=0), "w2")).task is None
        await handled(fs, fs.push_input_grads(grads(first, "w1"), "w1"))
        reply = await fs.take_task(dataclasses.replace(ahead, ahead=False), "w1")  # epoch 0's rows are all back
        assert reply.task is None and reply.deposit_to == "fs"
        reply = await fs.take_task(ahead, "w1")
        assert reply.task is not None and reply.task.epoch == 1 and reply.deposit_to == "fs"
        assert fs.state.closed_epoch == -1  # epoch 0 is not committed yet: nothing stepped
        await fs.end_epoch(EndEpoch(epoch=0, abandoned=False, layout=LAYOUT), "fs")
        reply = await fs.take_task(dataclasses.replace(ahead, deposited=ROWS), "w1")
        assert fs.state.closed_epoch == 0 and reply.task is None  # deposited, epoch 0 closed: the worker steps first

    asyncio.run(scenario())


def test_a_task_handed_again_while_its_first_result_is_on_its_way_counts_its_rows_once():
    """Issue 21, with push_behind: a worker's result is still on its way to the FS when the task's lease runs out
    (seen when the swarm stood still past a lease) and the FS hands the same rows to the same worker again. The FS
    accepts both results (the second as a repeat of the first), and the worker counts the rows once: counted twice,
    its gradient weighs its rows double and its deposit disagrees with the FS's rows."""
    async def scenario() -> None:
        clock = Clock()
        fs, bs = servers(clock=clock, workers=("w",))
        caller = Caller(p2p=None, peer_id="w", codec="none", timeout=10.0, local=fs.caller.local)
        start, end = CONFIG.stage_layers(0)
        worker = Worker(worker_id="w", stage=0, config=CONFIG, settings=RuntimeConfig(push_behind=True),
                        caller=caller, model=build_stage(CONFIG.model_config, start=start, end=end, seed=CONFIG.seed),
                        averager=StageAllReduce(p2p=None, run_id=CONFIG.run_id, stage=0, timeout=1.0, caller=caller),
                        servers=lambda: (["fs"], ["bs"]), compute=1.0)
        await feed(fs, 0)
        first, _ = await worker._take(["fs"], ["bs"])
        gate = asyncio.Event()
        accept = fs.push_input_grads

        async def held(request: PushInputGrads, sender: str) -> Ack:
            await gate.wait()
            return await accept(request, sender)

        with mock.patch.object(fs, "push_input_grads", side_effect=held):
            await worker._run_task(first)  # computed; its result waits at the gate, on its way
            clock.now += 10 * fs.settings.lease_timeout_s
            again, _ = await worker._take(["fs"], ["bs"])
            assert again is not None and again.task.rows == first.task.rows
            gate.set()
            await worker._run_task(again)
            await worker._pushed()
        await fs.drain()
        await bs.drain()
        assert fs.epoch_stats(0).rows == ROWS
        assert worker.rows_accumulated == ROWS
        for server in (fs, bs):
            await server.shutdown()

    asyncio.run(scenario())
