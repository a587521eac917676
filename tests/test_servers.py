"""Stage servers driven in-process through their handlers (no network): results counted once, refusals, a state
saved mid-epoch and restored into a new server, and the message framing under a stream that ends early."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from hivemind.proto import runtime_pb2

from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.messages import (
    Ack,
    Closure,
    GroupMember,
    PushInputGrads,
    PushOutputs,
    PushRows,
    ReportTask,
    TakeTask,
    TaskOffer,
)
from p2ptrain.protocol.rows import Rows
from p2ptrain.server.backward import BackwardServer
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.server.state import BackwardState, FrontalState
from p2ptrain.transport import Answer, Caller, Envelope, Refused, pack, unpack

SEQ, ROWS = 4, 4
CONFIG = RunConfig(num_stages=1, rows_per_microbatch=ROWS, microbatches=1, seq_len=SEQ)
LAYOUT = Layout((StageServers(fs=("fs",), bs=("bs",)),))


def servers(*, fs_state: FrontalState | None = None, bs_state: BackwardState | None = None
            ) -> tuple[FrontalServer, BackwardServer]:
    """The FS and BS of a one-stage run, two peers whose calls reach each other in this process."""
    local, settings = {}, RuntimeConfig()
    fs = FrontalServer(peer_id="fs", stage=0, config=CONFIG, settings=settings, state=fs_state,
                       caller=Caller(p2p=None, peer_id="fs", codec="none", timeout=10.0, local=local))
    bs = BackwardServer(peer_id="bs", stage=0, config=CONFIG, settings=settings, state=bs_state,
                        caller=Caller(p2p=None, peer_id="bs", codec="none", timeout=10.0, local=local))
    return fs, bs


async def handled(answer: Ack | Answer) -> Ack:
    """What the caller gets, after the work a handler does once its reply is sent."""
    if isinstance(answer, Answer):
        if answer.then is not None:
            await answer.then()
        return answer.reply
    return answer


async def feed(fs: FrontalServer, epoch: int) -> None:
    tokens = torch.randint(0, 256, (ROWS, SEQ))
    ack = await fs.push_rows(PushRows(epoch=epoch, microbatch=0, rows=Rows(0, ROWS), total_rows=ROWS, layout=LAYOUT,
                                      inputs=tokens, labels=tokens), "fs")
    assert ack == Ack()


async def take(fs: FrontalServer, worker: str, epoch: int) -> TaskOffer:
    reply = await fs.take_task(TakeTask(worker=worker, compute=1.0, epoch=epoch), worker)
    assert reply.task is not None and reply.task.rows == Rows(0, ROWS)
    return reply.task


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
        assert await handled(await fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert fs.state.closed_epoch == 0  # all rows back: the epoch closed
        assert await fs.push_input_grads(grads(task, "w1"), "w1") == Ack(again=True)
        with pytest.raises(Refused, match="not held"):  # someone else's copy of the same rows never counts
            await fs.push_input_grads(grads(task, "w2"), "w2")
        assert fs.epoch_stats(0).rows == ROWS
        assert fs.state.closures[0] == Closure(epoch=0, fs=("fs",), group=(GroupMember(peer_id="w1",
                                                                                       client_mode=False),))

        # a worker that took its task without polling this FS (say, from another server) still joins the group
        await feed(fs, 1)
        task = await take(fs, "w1", 1)
        fs.state.workers.pop("w1")
        assert await handled(await fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert fs.state.closures[1].group == (GroupMember(peer_id="w1", client_mode=False),)

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
        assert await handled(await fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await handled(await bs.push_outputs(loss(task, "w1"), "w1")) == Ack()
        assert bs.state.closed_epoch == 0 and bs.epoch_stats(0).loss_sum == 3.0
        with pytest.raises(Refused, match="duplicate"):
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
        assert await handled(await restored_fs.push_input_grads(grads(task, "w1"), "w1")) == Ack()
        assert await handled(await restored_bs.push_outputs(loss(task, "w1"), "w1")) == Ack()
        assert restored_fs.state.closed_epoch == restored_bs.state.closed_epoch == 0
        assert restored_fs.state.closures[0].group == (GroupMember(peer_id="w1", client_mode=False),)

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
