"""A frontal server driven in-process through its RPC handlers (the Caller's local shortcut, no network), and
the message framing under a stream that ends early."""
from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.proto import runtime_pb2

from p2ptrain.layout import Layout, StageServers
from p2ptrain.server.frontal import FrontalServer
from p2ptrain.transport import Caller, Message, pack, unpack

SEQ, ROWS = 4, 4
LAYOUT = Layout((StageServers(fs=("fs",), bs=("bs",)),))


def _result(task: dict, worker: str) -> Message:
    return Message({"task": task["task"], "worker": worker, "epoch": task["epoch"], "microbatch": task["microbatch"],
                    "rows": task["rows"], "fs": "fs", "total_rows": ROWS, "layout": LAYOUT.to_header(),
                    "microbatches_per_epoch": 1, "issuer": "fs"})


def test_a_result_pushed_again_after_a_lost_reply_is_accepted_again_and_counted_once():
    async def scenario() -> None:
        fs = FrontalServer(peer_id="fs", stage=0, num_stages=1, seq_len=SEQ, hidden_size=8, lease_timeout=30.0,
                           codec="none")
        fs.caller = caller = Caller(p2p=None, local={"fs": fs}, codec="none", timeout=10.0)
        tokens = torch.randint(0, 256, (ROWS, SEQ))
        pushed = await caller.call("fs", FrontalServer, "rpc_push_rows", Message(
            {"epoch": 0, "microbatch": 0, "rows": [0, ROWS], "total_rows": ROWS, "layout": LAYOUT.to_header(),
             "microbatches_per_epoch": 1}, {"inputs": tokens, "labels": tokens}))
        assert pushed.header["accepted"]
        task = (await caller.call("fs", FrontalServer, "rpc_take_task", Message(
            {"worker": "w1", "compute": 1.0, "epoch": 0, "wait_s": 0.0}))).header
        assert task["rows"] == [0, ROWS]

        first = await caller.call("fs", FrontalServer, "rpc_push_input_grads", _result(task, "w1"))
        assert first.header["accepted"] and fs.closed_epoch == 0  # all rows back: the epoch closed
        again = await caller.call("fs", FrontalServer, "rpc_push_input_grads", _result(task, "w1"))
        assert again.header["accepted"] and again.header["again"]
        other = await caller.call("fs", FrontalServer, "rpc_push_input_grads", _result(task, "w2"))
        assert not other.header["accepted"]  # someone else's copy of the same rows never counts
        assert fs.epoch_stats(0).rows == ROWS
        assert fs.closures["0"] == {"fs": ["fs"], "group": [["w1", False]]}

        # a worker that took its task without polling this FS (say, from another server) still joins the group
        pushed = await caller.call("fs", FrontalServer, "rpc_push_rows", Message(
            {"epoch": 1, "microbatch": 0, "rows": [0, ROWS], "total_rows": ROWS, "layout": LAYOUT.to_header(),
             "microbatches_per_epoch": 1}, {"inputs": tokens, "labels": tokens}))
        task = (await caller.call("fs", FrontalServer, "rpc_take_task", Message(
            {"worker": "w1", "compute": 1.0, "epoch": 1, "wait_s": 0.0}))).header
        fs.state.workers.pop("w1")
        assert (await caller.call("fs", FrontalServer, "rpc_push_input_grads", _result(task, "w1"))).header["accepted"]
        assert fs.closures["1"]["group"] == [["w1", False]]

    asyncio.run(scenario())


def test_a_stream_cut_short_is_a_connection_error_the_caller_can_retry():
    x = torch.randn(600_000)
    protos = pack(Message({"a": 1}, {"x": x}), codec="none", proto=runtime_pb2.ExpertRequest)
    assert len(protos) > 2  # the header, then chunks of at most 1 MiB
    assert torch.equal(asyncio.run(unpack(protos)).tensors["x"], x)
    with pytest.raises(ConnectionError, match="ended early"):
        asyncio.run(unpack(protos[:-1]))
    with pytest.raises(ConnectionError, match="empty stream"):
        asyncio.run(unpack([]))
