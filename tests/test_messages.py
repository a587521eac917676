"""The typed messages: every request and reply survives the wire, and a malformed header is refused with one error
type whose text names the message and the field."""
from __future__ import annotations

import pytest

from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.messages import (
    MAX_EPOCH,
    Ack,
    Closure,
    Echo,
    FetchInputs,
    GroupMember,
    Inputs,
    MessageError,
    Probe,
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

LAYOUT = Layout((StageServers(fs=("fs0",), bs=("bs0", "bs0b")), StageServers(fs=("fs1",), bs=("bs1",))))
X = object()  # tensors are opaque to the protocol: any object stands for one
OFFER = TaskOffer(task="0:1:0:B7", kind=Kind.BACKWARD, epoch=0, microbatch=1, rows=Rows(2, 4), total_rows=4,
                  fs="fs0", bs="bs0", layout=LAYOUT, forward_task="0:1:0:F3")

EXAMPLES = [
    Ack(), Ack(again=True),
    PushRows(epoch=3, microbatch=1, rows=Rows(0, 2), total_rows=4, layout=LAYOUT, inputs=X, labels=X),
    TakeTask(worker="w", compute=2e9, epoch=0, client_mode=True, wait_s=0.1),
    TaskReply(task=OFFER, closed_epoch=-1, grad=X),
    TaskReply(closed_epoch=5, closures=(Closure(epoch=5, fs=("fs0",),
                                                group=(GroupMember(peer_id="w", client_mode=False),)),)),
    FetchInputs(epoch=0, microbatch=0, rows=Rows(1, 2)), Inputs(inputs=X, labels=X),
    PushOutputs(task="t", worker="w", epoch=0, microbatch=0, rows=Rows(0, 4), total_rows=4, layout=LAYOUT, fs="fs0",
                outputs=X, labels=X),
    PushOutputs(task="t", worker="w", epoch=0, microbatch=0, rows=Rows(0, 4), total_rows=4, layout=LAYOUT, fs="fs0",
                loss=X),
    PushInputGrads(task="t", worker="w", epoch=0, microbatch=0, rows=Rows(0, 4), issuer="bs0", grad=X),
    PushInputGrads(task="t", worker="w", epoch=0, microbatch=0, rows=Rows(0, 4), issuer="fs0"),
    PushOutputGrads(epoch=0, microbatch=0, rows=Rows(0, 4), grad=X),
    ReportTask(task="t", worker="w", epoch=2, ok=False), Probe(), Probe(payload=X), Echo(received=1024),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_header_and_tensors(message):
    header = message.to_header()
    assert all(isinstance(key, str) for key in header)
    assert type(message).from_header(header, message.tensors()) == message


def test_requests_name_their_method_and_reply():
    assert (PushRows.method, PushRows.reply) == ("rpc_push_rows", Ack)
    assert (TakeTask.method, TakeTask.reply) == ("rpc_take_task", TaskReply)
    assert (FetchInputs.reply, Probe.reply) == (Inputs, Echo)


PUSH = EXAMPLES[2]


@pytest.mark.parametrize("change, tensors, error", [
    ({"epoch": None}, None, r"PushRows\.epoch: missing field"),
    ({"colour": "red"}, None, r"PushRows: unknown field 'colour'"),
    ({"epoch": "3"}, None, r"PushRows\.epoch: expected an integer, got str"),
    ({"epoch": 3.0}, None, r"PushRows\.epoch: expected an integer, got float"),
    ({"epoch": True}, None, r"PushRows\.epoch: expected an integer, got bool"),
    ({"epoch": -1}, None, r"PushRows\.epoch: -1 is outside 0\.\."),
    ({"epoch": MAX_EPOCH + 1}, None, r"PushRows\.epoch: .* is outside"),
    ({"rows": [-1, 2]}, None, r"PushRows\.rows: -1 is outside"),
    ({"rows": [3, 3]}, None, r"PushRows\.rows: \[3, 3\) is not a non-empty row range"),
    ({"rows": [0, 9]}, None, r"PushRows\.rows: rows \[0, 9\) run past the microbatch's 4 rows"),
    ({"rows": [0, 2**40]}, None, r"PushRows\.rows: .* is outside"),
    ({"rows": "0:2"}, None, r"PushRows\.rows: expected a list, got str"),
    ({"total_rows": 0}, None, r"PushRows\.total_rows: 0 is outside"),
    ({"layout": []}, None, r"PushRows\.layout: a list of 0 items"),
    ({"layout": [[["a"], []]]}, None, r"PushRows\.layout\[0\]\.bs: a list of 0 items"),
    ({"layout": [[["a", "a"], ["b"]]]}, None, r"PushRows\.layout\[0\]\.fs: a server is listed twice"),
    ({"layout": [[["a"], [7]]]}, None, r"PushRows\.layout\[0\]\.bs: expected a string, got int"),
    ({}, {"inputs": X}, r"PushRows\.labels: missing tensor"),
    ({}, {"inputs": X, "labels": X, "grad": X}, r"PushRows: unexpected tensor 'grad'"),
])
def test_a_malformed_header_is_refused_naming_the_field(change, tensors, error):
    header = {**PUSH.to_header(), **change}
    header = {key: value for key, value in header.items() if value is not None}
    with pytest.raises(MessageError, match=error):
        PushRows.from_header(header, PUSH.tensors() if tensors is None else tensors)


@pytest.mark.parametrize("header, error", [
    ([1, 2], r"TakeTask: expected a map of fields, got list"),
    ({"worker": "w", "compute": 0.0, "epoch": 0}, r"TakeTask\.compute: 0 is outside"),
    ({"worker": "w", "compute": float("nan"), "epoch": 0}, r"TakeTask\.compute: nan is not finite"),
    ({"worker": "w", "compute": 1.0, "epoch": 0, "wait_s": 1e9}, r"TakeTask\.wait_s: 1e\+09 is outside"),
    ({"worker": "", "compute": 1.0, "epoch": 0}, r"TakeTask\.worker: a string of 0 characters"),
    ({"worker": "w" * 500, "compute": 1.0, "epoch": 0}, r"TakeTask\.worker: a string of 500 characters"),
])
def test_a_task_poll_cannot_ask_for_nonsense(header, error):
    with pytest.raises(MessageError, match=error):
        TakeTask.from_header(header)


def test_cross_field_rules_of_replies_and_results():
    header = TaskReply(task=OFFER, closed_epoch=0, grad=X).to_header()
    with pytest.raises(MessageError, match=r"TaskReply: a backward task carries tensors \['grad'\], not \[\]"):
        TaskReply.from_header(header)
    with pytest.raises(MessageError, match=r"TaskReply\.task\.forward_task: a backward task names its forward"):
        TaskReply.from_header({**header, "task": {**header["task"], "forward_task": None}}, {"grad": X})
    with pytest.raises(MessageError, match=r"TaskReply\.task\.kind: expected one of \['forward', 'backward', 'redo'\]"):
        TaskReply.from_header({**header, "task": {**header["task"], "kind": "sideways"}}, {"grad": X})
    outputs = EXAMPLES[8]
    with pytest.raises(MessageError, match="carries either a loss, or outputs and labels"):
        PushOutputs.from_header(outputs.to_header(), {"outputs": X, "labels": X, "loss": X})
    with pytest.raises(MessageError, match="carries either a loss, or outputs and labels"):
        PushOutputs.from_header(outputs.to_header(), {"outputs": X})
