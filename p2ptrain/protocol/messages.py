"""The typed messages of every RPC between peers: one dataclass per request and per reply.

A message is a header (plain values: ints, floats, strings, row ranges, a layout) plus named tensors. On the wire
the header is a msgpack map and the tensors travel beside it (see `p2ptrain.transport`); here, a message is a
frozen dataclass whose fields say what may arrive. `from_header` checks every field's type and range, refuses
missing and unknown fields and tensors, then the message's own cross-field rules (`check`), and raises one error
type, `MessageError`, whose text names the field. Tensors stay opaque here (this module needs no torch): their
shapes and dtypes depend on the run's recipe, so the receiving server checks them.

Each request names the RPC method that takes it and the type of its reply; which service (frontal or backward
server, link probe) answers is the caller's choice, since both kinds of stage server take tasks and reports.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Annotated, Any, Callable, ClassVar, Self

from p2ptrain.protocol.layout import Layout, StageServers
from p2ptrain.protocol.rows import Rows
from p2ptrain.protocol.taskpool import Kind

# Bounds of what a peer may send: far above any real run, low enough that no value can blow up a server.
MAX_EPOCH = 2**40
MAX_MICROBATCHES = 2**20
MAX_ROWS = 2**24  # rows of one microbatch
MAX_STAGES = 256
MAX_SERVERS = 256  # FS (or BS) of one stage
MAX_GROUP = 4096  # workers averaging one stage
MAX_CLOSURES = 64
MAX_MICROBATCHES_DROPPED = 1024  # per epoch, in an FS's answer about the microbatches it dropped
MAX_ID = 128  # characters of a peer id (base58 peer ids have about 52)
MAX_TASK_ID = 64
MAX_WAIT_S = 60.0  # a task poll may wait this long for work
MAX_FLOPS = 1e21
MAX_LAYERS = 2**16  # layers of a whole model


# The services peers call: the stage servers, and the probe every joining peer answers (`transport.Service`).
FRONTAL_SERVER = "FrontalServer"
BACKWARD_SERVER = "BackwardServer"
LINK_PROBE = "LinkProbe"
STAGE_STATE = "StageState"  # a worker's parameters and optimizer state, for a stage mate that joins
STAGE_EVAL = "StageEval"  # a server's forward pass on held-out data, stage after stage (evaluation)
GRADIENT_DEPOSITS = "GradientDeposits"  # a server keeps each worker's gradients of an epoch while its stage averages


class MessageError(ValueError):
    """A message that does not follow the protocol; the text names the message and the field."""


@dataclass(frozen=True)
class Between:
    """A numeric field's inclusive range."""

    low: float
    high: float


@dataclass(frozen=True)
class Length:
    """A string field's length range."""

    low: int
    high: int


class _TensorSlot:
    """Marks a field that travels as a tensor beside the header."""


TENSOR = _TensorSlot()
Tensor = Annotated[object, TENSOR]

Epoch = Annotated[int, Between(0, MAX_EPOCH)]
ClosedEpoch = Annotated[int, Between(-1, MAX_EPOCH)]  # -1: none closed yet
Microbatch = Annotated[int, Between(0, MAX_MICROBATCHES - 1)]
RowCount = Annotated[int, Between(1, MAX_ROWS)]
PeerId = Annotated[str, Length(1, MAX_ID)]
TaskId = Annotated[str, Length(1, MAX_TASK_ID)]
Flops = Annotated[float, Between(1e-9, MAX_FLOPS)]
WaitSeconds = Annotated[float, Between(0.0, MAX_WAIT_S)]
ByteCount = Annotated[int, Between(0, 2**62)]
Timestamp = Annotated[float, Between(0.0, 1e12)]  # seconds since the epoch of Unix time
Stage = Annotated[int, Between(0, MAX_STAGES - 1)]
Layer = Annotated[int, Between(0, MAX_LAYERS)]
Norm = Annotated[float, Between(0.0, 1e300)]  # a norm or a squared norm
SharedKey = Annotated[str, Length(1, 256)]  # the checkpoint key of a tensor several stages hold


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message: the header fields are the dataclass fields that are not tensors."""

    def to_header(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name)) for f in _fields(type(self)) if not f.tensor}

    def tensors(self) -> dict[str, Any]:
        """The tensors that travel beside the header (optional ones only when present)."""
        return {f.name: value for f in _fields(type(self)) if f.tensor and (value := getattr(self, f.name)) is not None}

    def traffic_kind(self) -> str | None:
        """The kind (`p2ptrain.traffic.KINDS`) its bytes count as, where it is not that of the request it answers."""
        return None

    @classmethod
    def from_header(cls, header: object, tensors: Mapping[str, Any] | None = None) -> Self:
        """Decode and check a received header and its tensors; raises MessageError naming the field."""
        return cls._decode(header, dict(tensors or {}), path=cls.__name__)

    @classmethod
    def _decode(cls, header: object, tensors: dict[str, Any], *, path: str) -> Self:
        if not isinstance(header, Mapping):
            raise MessageError(f"{path}: expected a map of fields, got {_kind(header)}")
        fields = _fields(cls)
        header_names = {f.name for f in fields if not f.tensor}
        tensor_names = {f.name for f in fields if f.tensor}
        unknown = sorted(str(key) for key in header if key not in header_names)
        if unknown:
            raise MessageError(f"{path}: unknown field {unknown[0]!r}")
        extra = sorted(str(name) for name in tensors if name not in tensor_names)
        if extra:
            raise MessageError(f"{path}: unexpected tensor {extra[0]!r}")
        values = {}
        for f in fields:
            where = f"{path}.{f.name}"
            if f.tensor:
                if f.name in tensors:
                    values[f.name] = tensors[f.name]
                elif not f.optional:
                    raise MessageError(f"{where}: missing tensor")
            elif f.name in header:
                values[f.name] = f.decode(header[f.name], where)
            elif not f.has_default:
                raise MessageError(f"{where}: missing field")
        message = cls(**values)
        message.check(path)
        return message

    def check(self, path: str) -> None:
        """Cross-field rules of this message; raise MessageError naming the field (`path` is the message's)."""


@dataclass(frozen=True, kw_only=True)
class Request(Message):
    """A message that opens an RPC: `method` is the servicer's handler, `reply` the type of its answer."""

    method: ClassVar[str]
    reply: ClassVar[type[Message]]
    traffic: ClassVar[str] = "control"  # the kind (`p2ptrain.traffic.KINDS`) its bytes and its reply's count as


def _within(rows: Rows, total_rows: int, where: str) -> None:
    if rows.end > total_rows:
        raise MessageError(f"{where}: rows {rows} run past the microbatch's {total_rows} rows")


# -- values that nest in headers -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GroupMember(Message):
    """One worker of a stage's averaging group; a client-mode worker sends and receives but reduces no part. `rows`:
    the rows of the epoch whose parameter gradients it hands in (0 for a server that only holds the state)."""

    peer_id: PeerId
    client_mode: bool
    rows: Annotated[int, Between(0, MAX_ROWS)] = 0


@dataclass(frozen=True, kw_only=True)
class MicrobatchRef(Message):
    """One microbatch of one epoch."""

    epoch: Epoch
    microbatch: Microbatch


@dataclass(frozen=True, kw_only=True)
class Closure(Message):
    """An FS's record of a closed epoch: the stage's FS in that epoch's layout, and the group that averages it;
    or, `abandoned`, that the epoch ended without a step (a server lost its rows): its workers drop its gradients."""

    epoch: Epoch
    fs: tuple[PeerId, ...]
    group: tuple[GroupMember, ...]
    abandoned: bool = False

    def check(self, path: str) -> None:
        if not 1 <= len(self.fs) <= MAX_SERVERS:
            raise MessageError(f"{path}.fs: expected 1 to {MAX_SERVERS} servers, got {len(self.fs)}")
        if len(self.group) > MAX_GROUP:
            raise MessageError(f"{path}.group: more than {MAX_GROUP} workers")


@dataclass(frozen=True, kw_only=True)
class TaskOffer(Message):
    """A task handed to a worker: its rows of one microbatch, the servers to send results to, and for a backward
    task the forward task whose activations it needs."""

    task: TaskId
    kind: Kind
    epoch: Epoch
    microbatch: Microbatch
    rows: Rows
    total_rows: RowCount
    fs: PeerId
    bs: PeerId
    layout: Layout
    forward_task: TaskId | None = None

    def check(self, path: str) -> None:
        _within(self.rows, self.total_rows, f"{path}.rows")
        if (self.kind == Kind.BACKWARD) != (self.forward_task is not None):
            raise MessageError(f"{path}.forward_task: a backward task names its forward task, a forward task none")


# -- requests and replies ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    """A pushed message was accepted; `again`: it had been accepted before (a retry after a lost reply)."""

    again: bool = False


@dataclass(frozen=True, kw_only=True)
class PushRows(Request):
    """Rows of a microbatch for a frontal server: from the data source (stage 0) or a BS of the previous stage."""

    method: ClassVar[str] = "rpc_push_rows"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = Ack

    epoch: Epoch
    microbatch: Microbatch
    rows: Rows
    total_rows: RowCount
    layout: Layout
    inputs: Tensor
    labels: Tensor

    def check(self, path: str) -> None:
        _within(self.rows, self.total_rows, f"{path}.rows")


@dataclass(frozen=True, kw_only=True)
class TaskReply(Message):
    """A task and its tensors (inputs and labels of a forward task, output gradients of a backward one), or none;
    an FS also tells its last closed epoch and, with no task, its recent closures (`protocol.closure.judge`).
    `deposit_to`: every row of the worker's epoch is back at this FS, which counts a worker holding some of them
    ready to average only once its gradients are deposited with this server of the stage (`DepositGrads`)."""

    task: TaskOffer | None = None
    closed_epoch: ClosedEpoch
    closures: tuple[Closure, ...] = ()
    deposit_to: PeerId | None = None
    # with no task: nothing of the worker's epoch was out at this FS, so no backward task of the stage can be waiting
    # either until it hands out rows, and it held the poll up to the poll's `idle_wait_s` (`StageServer.quiet`)
    quiet: bool = False
    inputs: Tensor | None = None
    labels: Tensor | None = None
    grad: Tensor | None = None

    def traffic_kind(self) -> str | None:
        return "activations" if self.tensors() else None  # a poll answered with a task and its tensors

    def check(self, path: str) -> None:
        if len(self.closures) > MAX_CLOSURES:
            raise MessageError(f"{path}.closures: more than {MAX_CLOSURES}")
        carried = {name for name in ("inputs", "labels", "grad") if getattr(self, name) is not None}
        wanted: set[str] = set()
        if self.task is not None:
            wanted = {Kind.FORWARD: {"inputs", "labels"}, Kind.BACKWARD: {"grad"},
                      # a redo outside the last stage also carries the output gradients of its rows
                      Kind.REDO: {"inputs", "labels"} | ({"grad"} & carried)}[self.task.kind]
        if carried != wanted:
            raise MessageError(f"{path}: a {self.task.kind.value if self.task else 'missing'} task carries tensors "
                               f"{sorted(wanted)}, not {sorted(carried)}")


@dataclass(frozen=True, kw_only=True)
class TakeTask(Request):
    """A worker asks a server for a task of its epoch, waiting up to `wait_s` for one, or up to `idle_wait_s` while
    the server knows nothing can come but by news (`StageServer.quiet`)."""

    method: ClassVar[str] = "rpc_take_task"
    reply: ClassVar[type[Message]] = TaskReply

    worker: PeerId
    compute: Flops
    epoch: Epoch
    client_mode: bool = False
    wait_s: WaitSeconds = 0.0
    idle_wait_s: WaitSeconds = 0.0
    # a reliable server that holds the stage's state (the paper's parameter server): it averages with the stage's
    # workers and steps alike, but takes no tasks; its polls only keep it in the averaging group
    holds_state: bool = False
    # the rows of `epoch` that the gradients this worker deposited cover, as they stand (0: none deposited, or it
    # computed more rows since)
    deposited: Annotated[int, Between(0, MAX_ROWS)] = 0
    # it may take a task of the next epoch where none of `epoch` is left for it (`RunConfig.overlap_epochs`)
    ahead: bool = False


@dataclass(frozen=True, kw_only=True)
class Inputs(Message):
    """The stored inputs and labels of some rows."""

    inputs: Tensor
    labels: Tensor


@dataclass(frozen=True, kw_only=True)
class FetchInputs(Request):
    """A worker that recomputes a forward pass asks the FS for the inputs it keeps."""

    method: ClassVar[str] = "rpc_fetch_inputs"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = Inputs

    epoch: Epoch
    microbatch: Microbatch
    rows: Rows


@dataclass(frozen=True, kw_only=True)
class OutputGrads(Message):
    """The output gradients a BS received for some rows."""

    grad: Tensor


@dataclass(frozen=True, kw_only=True)
class FetchOutputGrads(Request):
    """An FS that redoes rows of a vanished worker asks the BS for their output gradients, which the BS keeps for
    a few epochs after it closed them."""

    method: ClassVar[str] = "rpc_fetch_output_grads"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = OutputGrads

    epoch: Epoch
    microbatch: Microbatch
    rows: Rows


@dataclass(frozen=True, kw_only=True)
class PushOutputs(Request):
    """A forward task's result for a BS: output rows with their labels, or in the last stage their summed loss."""

    method: ClassVar[str] = "rpc_push_outputs"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = Ack

    task: TaskId
    worker: PeerId
    epoch: Epoch
    microbatch: Microbatch
    rows: Rows
    total_rows: RowCount
    layout: Layout
    fs: PeerId  # the FS that issued the task
    client_mode: bool = False
    outputs: Tensor | None = None
    labels: Tensor | None = None
    loss: Tensor | None = None

    def check(self, path: str) -> None:
        _within(self.rows, self.total_rows, f"{path}.rows")
        if (self.loss is None) == (self.outputs is None) or (self.outputs is None) != (self.labels is None):
            raise MessageError(f"{path}: carries either a loss, or outputs and labels")


@dataclass(frozen=True, kw_only=True)
class PushInputGrads(Request):
    """A backward task's result for the FS: gradients of the stage inputs (none at stage 0)."""

    method: ClassVar[str] = "rpc_push_input_grads"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = Ack

    task: TaskId
    worker: PeerId
    epoch: Epoch
    microbatch: Microbatch
    rows: Rows
    issuer: PeerId  # the server whose pool holds the task: a BS, or in the last stage the FS itself
    client_mode: bool = False
    grad: Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class PushOutputGrads(Request):
    """Gradients of a stage's outputs, from an FS of the next stage to a BS."""

    method: ClassVar[str] = "rpc_push_output_grads"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = Ack

    epoch: Epoch
    microbatch: Microbatch
    rows: Rows
    grad: Tensor


@dataclass(frozen=True, kw_only=True)
class ReportTask(Request):
    """Between the servers of a stage: the result of a task the other issued was accepted (`ok`: complete it in
    your pool; the reply confirms it) or refused (give the task to another worker)."""

    method: ClassVar[str] = "rpc_task_result"
    reply: ClassVar[type[Message]] = Ack

    task: TaskId
    worker: PeerId
    epoch: Epoch
    ok: bool


@dataclass(frozen=True, kw_only=True)
class DropResult(Request):
    """From an FS of the last stage to the BS that records the loss of these rows (fault policy swarm): the result
    of `task` by `worker`, a worker now gone, is dropped rather than redone, so if its loss never came the BS counts
    its rows through without one."""

    method: ClassVar[str] = "rpc_drop_result"
    reply: ClassVar[type[Message]] = Ack

    task: TaskId
    worker: PeerId
    epoch: Epoch
    microbatch: Microbatch
    rows: Rows
    total_rows: RowCount
    layout: Layout

    def check(self, path: str) -> None:
        _within(self.rows, self.total_rows, f"{path}.rows")


@dataclass(frozen=True, kw_only=True)
class Leave(Request):
    """A worker that stops (SIGTERM) tells the servers of its stage: its leases go back to the pool at once, and
    the rows whose parameter gradients it holds are redone without waiting for it to fall silent."""

    method: ClassVar[str] = "rpc_leave"
    reply: ClassVar[type[Message]] = Ack

    worker: PeerId


@dataclass(frozen=True, kw_only=True)
class EpochState(Message):
    """Whether a server has every row of its segment of an epoch back (or closed the epoch already), and where it
    stands: the last epoch it closed, whether that one was abandoned, the last epoch it holds rows of, (an FS) the
    global batch of data of the last epoch committed to it, and (a server that keeps the stage's state) the epoch its
    replica's state is current for; -1 for none."""

    complete: bool
    closed_epoch: ClosedEpoch = -1
    abandoned: bool = False
    held_epoch: ClosedEpoch = -1
    batch: ClosedEpoch = -1
    state_epoch: ClosedEpoch = -1
    # fault policy swarm, an FS: the microbatches of its recent epochs whose rows it dropped with a vanished worker
    dropped: tuple[MicrobatchRef, ...] = ()

    def check(self, path: str) -> None:
        if len(self.dropped) > MAX_CLOSURES * MAX_MICROBATCHES_DROPPED:
            raise MessageError(f"{path}.dropped: more than {MAX_CLOSURES * MAX_MICROBATCHES_DROPPED} microbatches")


@dataclass(frozen=True, kw_only=True)
class AskEpoch(Request):
    """The data source asks a stage-0 FS whether its segment of `epoch` is complete, before it commits the epoch; a
    restarted data source asks every server where the swarm stands."""

    method: ClassVar[str] = "rpc_ask_epoch"
    reply: ClassVar[type[Message]] = EpochState

    epoch: Epoch


@dataclass(frozen=True, kw_only=True)
class EndEpoch(Request):
    """From the data source to the stage servers of an epoch's `layout`: the epoch is committed (every row came back
    at stage 0, so every FS may close it once its own rows are back, and it is never abandoned after), or
    `abandoned` (a server of the layout restarted or was lost first: every server drops what it holds of it, its
    workers drop their gradients of it, and its data is fed again as the next epoch), or `caught_up` (a server
    restored from an older checkpoint than its stage mates', or restarted after the epoch: the stage stands past every
    epoch through this one in their state, so the server closes them without a step, and its replica and workers
    catch up by loading a mate's state)."""

    method: ClassVar[str] = "rpc_end_epoch"
    reply: ClassVar[type[Message]] = Ack

    epoch: Epoch
    abandoned: bool
    layout: Layout
    batch: ClosedEpoch = -1  # committed: the global batch of data the epoch trained on
    caught_up: bool = False

    def check(self, path: str) -> None:
        if self.abandoned and self.caught_up:
            raise MessageError(f"{path}: an epoch is either abandoned or caught up, not both")


@dataclass(frozen=True, kw_only=True)
class GlobalNorm(Message):
    """The norm of the whole model's averaged gradient of an epoch, over all stages, and whether any stage's
    gradients overflowed (fp16: every stage then skips the step); None until every stage reported its part."""

    norm: Norm | None = None
    overflow: bool = False


@dataclass(frozen=True, kw_only=True)
class ReportNorm(Request):
    """A worker hands the data source the squared norm of its stage's averaged gradient of `epoch`, and asks for
    the global norm to clip by (`protocol.optimization.NormBook`); it asks again until every stage reported. With fp16,
    also whether the stage's averaged gradients overflowed, and every stage skips the epoch if one did."""

    method: ClassVar[str] = "rpc_report_norm"
    reply: ClassVar[type[Message]] = GlobalNorm

    epoch: Epoch
    stage: Stage
    squared_norm: Norm
    overflow: bool = False


@dataclass(frozen=True, kw_only=True)
class StageGroup(Message):
    """A stage's averaging group of an epoch and the tensors of its that other stages may hold too, by checkpoint key
    (`protocol.sharing`)."""

    stage: Stage
    group: tuple[GroupMember, ...]
    shared: tuple[SharedKey, ...]

    def check(self, path: str) -> None:
        if len(set(self.shared)) != len(self.shared):
            raise MessageError(f"{path}.shared: a key is listed twice")


@dataclass(frozen=True, kw_only=True)
class StageGroups(Message):
    """Every stage's group of an epoch, once every stage reported its own; None until then."""

    stages: tuple[StageGroup, ...] | None = None

    def check(self, path: str) -> None:
        if self.stages is not None and [entry.stage for entry in self.stages] != list(range(len(self.stages))):
            raise MessageError(f"{path}.stages: not one group per stage, in order")


@dataclass(frozen=True, kw_only=True)
class ReportGroup(Request):
    """A worker of a run whose stages share tensors hands the data source its stage's group of `epoch`, and asks
    for every stage's (`protocol.sharing.GroupBook`); it asks again until every stage reported."""

    method: ClassVar[str] = "rpc_report_group"
    reply: ClassVar[type[Message]] = StageGroups

    epoch: Epoch
    group: StageGroup


@dataclass(frozen=True, kw_only=True)
class DepositGrads(Request):
    """A worker hands its stage's first FS the gradients it brings to `epoch`'s all-reduce (its mean gradient over
    its `rows`, all of the stage's trainable parameters flattened into one float32 vector) once every row of the
    epoch is back, before the FS counts it ready to average, so that if it dies in the round the server brings them
    in its place (`client.averaging`)."""

    method: ClassVar[str] = "rpc_deposit_grads"
    traffic: ClassVar[str] = "averaging"
    reply: ClassVar[type[Message]] = Ack

    epoch: Epoch
    rows: RowCount
    grads: Tensor
    overflow: bool = False  # fp16: some of its rows' gradients overflowed (they hand in zeros), so the stage skips


@dataclass(frozen=True, kw_only=True)
class StageMean(Message):
    """The mean of a stage's deposited gradients of an epoch (`TakeStageMean`): over `rows`, in the deposits' flat
    float32 layout."""

    rows: RowCount
    grads: Tensor


@dataclass(frozen=True, kw_only=True)
class TakeStageMean(Request):
    """A worker asks the server it deposited its gradients of `epoch` with for the mean of `peers`' deposits there,
    weighted by their rows: where it looks ahead to while its stage's round and step run (DPU with a look-ahead,
    `client.worker`)."""

    method: ClassVar[str] = "rpc_stage_mean"
    traffic: ClassVar[str] = "averaging"
    reply: ClassVar[type[Message]] = StageMean

    epoch: Epoch
    peers: tuple[PeerId, ...]

    def check(self, path: str) -> None:
        if not 1 <= len(self.peers) <= MAX_GROUP:
            raise MessageError(f"{path}.peers: expected 1 to {MAX_GROUP} workers, got {len(self.peers)}")


@dataclass(frozen=True, kw_only=True)
class EvalLoss(Message):
    """The summed token loss of held-out rows and how many tokens it sums over."""

    loss_sum: Norm
    tokens: ByteCount


@dataclass(frozen=True, kw_only=True)
class EvalForward(Request):
    """Held-out rows for a server of `stage` to run forward on the parameters of `epoch` (those its stage holds
    after stepping through epoch - 1) and hand on to the next stage; the last stage answers with their loss."""

    method: ClassVar[str] = "rpc_eval_forward"
    traffic: ClassVar[str] = "activations"
    reply: ClassVar[type[Message]] = EvalLoss

    epoch: Epoch
    stage: Stage
    inputs: Tensor
    labels: Tensor


@dataclass(frozen=True, kw_only=True)
class Echo(Message):
    """How many payload bytes arrived, and when the answering process started (a restart changes it)."""

    received: ByteCount
    started: Timestamp = 0.0


@dataclass(frozen=True, kw_only=True)
class Probe(Request):
    """A link measurement: a tiny message, or one with a payload to time the transfer."""

    method: ClassVar[str] = "rpc_echo"
    traffic: ClassVar[str] = "probes"
    reply: ClassVar[type[Message]] = Echo

    payload: Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class StageStateReply(Message):
    """A worker's stage state: its parameters and optimizer state as one uint8 `blob` (encoded by
    `p2ptrain.client.state_sync`), current for `epoch`, the epoch the sender computes next."""

    epoch: Epoch
    blob: Tensor


@dataclass(frozen=True, kw_only=True)
class DownloadState(Request):
    """A joining or restarted worker asks a stage mate for its state; it names the layers [start, end) of its stage
    so that a peer holding other layers refuses before it sends anything."""

    method: ClassVar[str] = "rpc_download_state"
    traffic: ClassVar[str] = "state"
    reply: ClassVar[type[Message]] = StageStateReply

    stage: Stage
    start: Layer
    end: Layer
    # the epoch the asker computes next: a state from before it would leave the asker a step behind its mates, so
    # a peer whose step of it is still in flight answers once the step lands, and one further behind refuses
    at_least: Epoch = 0

    def check(self, path: str) -> None:
        if self.start >= self.end:
            raise MessageError(f"{path}.end: layers [{self.start}, {self.end}) are not a non-empty range")


# -- field codecs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    tensor: bool
    optional: bool
    has_default: bool
    decode: Callable[[object, str], Any] | None  # None for a tensor


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _int(bounds: Between | None) -> Callable[[object, str], int]:
    def decode(value: object, where: str) -> int:
        if type(value) is not int:
            raise MessageError(f"{where}: expected an integer, got {_kind(value)}")
        if bounds is not None and not bounds.low <= value <= bounds.high:
            raise MessageError(f"{where}: {value} is outside {bounds.low:.15g}..{bounds.high:.15g}")
        return value
    return decode


def _float(bounds: Between | None) -> Callable[[object, str], float]:
    def decode(value: object, where: str) -> float:
        if type(value) not in (int, float):
            raise MessageError(f"{where}: expected a number, got {_kind(value)}")
        number = float(value)
        if not math.isfinite(number):
            raise MessageError(f"{where}: {number} is not finite")
        if bounds is not None and not bounds.low <= number <= bounds.high:
            raise MessageError(f"{where}: {number:g} is outside {bounds.low:.15g}..{bounds.high:.15g}")
        return number
    return decode


def _str(length: Length | None) -> Callable[[object, str], str]:
    def decode(value: object, where: str) -> str:
        if not isinstance(value, str):
            raise MessageError(f"{where}: expected a string, got {_kind(value)}")
        if length is not None and not length.low <= len(value) <= length.high:
            raise MessageError(f"{where}: a string of {len(value)} characters, expected {length.low}..{length.high}")
        return value
    return decode


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise MessageError(f"{where}: expected true or false, got {_kind(value)}")
    return value


def _list(value: object, where: str, *, low: int, high: int) -> list:
    if not isinstance(value, (list, tuple)):
        raise MessageError(f"{where}: expected a list, got {_kind(value)}")
    if not low <= len(value) <= high:
        raise MessageError(f"{where}: a list of {len(value)} items, expected {low}..{high}")
    return list(value)


def _rows(value: object, where: str) -> Rows:
    start, end = (_int(Between(0, MAX_ROWS))(x, where) for x in _list(value, where, low=2, high=2))
    if start >= end:
        raise MessageError(f"{where}: [{start}, {end}) is not a non-empty row range")
    return Rows(start, end)


def _servers(value: object, where: str) -> tuple[str, ...]:
    ids = tuple(_str(Length(1, MAX_ID))(x, where) for x in _list(value, where, low=1, high=MAX_SERVERS))
    if len(set(ids)) != len(ids):
        raise MessageError(f"{where}: a server is listed twice")
    return ids


def _layout(value: object, where: str) -> Layout:
    stages = []
    for k, stage in enumerate(_list(value, where, low=1, high=MAX_STAGES)):
        fs, bs = _list(stage, f"{where}[{k}]", low=2, high=2)
        stages.append(StageServers(fs=_servers(fs, f"{where}[{k}].fs"), bs=_servers(bs, f"{where}[{k}].bs")))
    return Layout(tuple(stages))


def _encode(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_header()
    if isinstance(value, Rows):
        return [value.start, value.end]
    if isinstance(value, Layout):
        return [[list(s.fs), list(s.bs)] for s in value.stages]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _decoder(hint: Any) -> Callable[[object, str], Any]:
    extras = ()
    if typing.get_origin(hint) is Annotated:
        hint, *extras = typing.get_args(hint)
    bounds = next((x for x in extras if isinstance(x, (Between, Length))), None)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        decode_inner = _decoder(inner)
        return lambda value, where: None if value is None else decode_inner(value, where)
    if origin is tuple:  # the longest list any message holds; messages check tighter bounds themselves
        item = _decoder(args[0])
        return lambda value, where: tuple(item(x, f"{where}[{i}]")
                                          for i, x in enumerate(_list(value, where, low=0, high=MAX_GROUP)))
    if hint is bool:
        return _bool
    if hint is int:
        return _int(bounds)
    if hint is float:
        return _float(bounds)
    if hint is str:
        return _str(bounds)
    if hint is Rows:
        return _rows
    if hint is Layout:
        return _layout
    if isinstance(hint, type) and issubclass(hint, Enum):
        def decode_enum(value: object, where: str) -> Enum:
            try:
                return hint(value)
            except ValueError:
                raise MessageError(f"{where}: expected one of {[m.value for m in hint]}, got {value!r}") from None
        return decode_enum
    if isinstance(hint, type) and issubclass(hint, Message):
        return lambda value, where: hint._decode(value, {}, path=where)
    raise TypeError(f"no wire codec for {hint!r}")


@cache
def _fields(cls: type[Message]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        tensor = hint == Tensor or (type(None) in args and Tensor in args)
        optional = type(None) in args
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        out.append(_Field(name=f.name, tensor=tensor, optional=optional, has_default=has_default,
                          decode=None if tensor else _decoder(hint)))
    return tuple(out)
