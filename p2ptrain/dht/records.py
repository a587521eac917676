"""The records peers publish in the DHT: dataclasses for the code, strict pydantic (v1) models for the wire.

hivemind's SchemaValidator runs pydantic v1 and rejects any value that pydantic would have to convert
(an int where a float is declared, a tuple for a list), so every dataclass normalizes its fields on
construction and `to_value` checks the result against the same model before anything is sent: a record
that would be dropped by the DHT fails here instead, with pydantic's message.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Dict, List, Literal, Optional, Self, Tuple

import pydantic.v1 as pydantic

from p2ptrain.protocol.layout import PeerRole, ServerRole

StageRole = Literal["fs", "bs", "worker"]
PeerState = Literal["joining", "online", "offline"]

# per_epoch is a window, not a history: a DHT value travels in one RPC and must stay small
MAX_EPOCHS_KEPT = 256

_NonNegFloat = pydantic.confloat(strict=True, ge=0.0)
_NonNegInt = pydantic.conint(strict=True, ge=0)


class _Strict(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid


class LinkModel(_Strict):
    latency_s: _NonNegFloat
    bandwidth_bps: _NonNegFloat


class PeerInfoModel(_Strict):
    peer_id: pydantic.StrictStr
    role: PeerRole
    server_role: Optional[ServerRole]
    stage: Optional[_NonNegInt]
    reliable: pydantic.StrictBool
    computes: pydantic.StrictBool
    compute: _NonNegFloat
    memory: _NonNegInt
    maddrs: List[pydantic.StrictStr]
    state: PeerState
    started: pydantic.StrictFloat
    links: Dict[pydantic.StrictStr, LinkModel]


class MembershipModel(_Strict):
    peer_id: pydantic.StrictStr
    role: StageRole
    compute: _NonNegFloat
    load: _NonNegFloat
    holds_state: pydantic.StrictBool = False
    client_mode: pydantic.StrictBool = False
    certificate: Optional[pydantic.constr(strict=True, max_length=1024)] = None
    data_source: pydantic.StrictBool = False
    layers: Optional[Tuple[_NonNegInt, _NonNegInt]] = None


class EpochMetricsModel(_Strict):
    epoch: _NonNegInt
    rows_in_batch: _NonNegInt
    rows_averaged: _NonNegInt
    tasks_redone: _NonNegInt
    loss: Optional[pydantic.StrictFloat]
    tokens: _NonNegInt
    seconds: _NonNegFloat
    rows_recomputed: _NonNegInt = 0
    workers_lost: _NonNegInt = 0
    workers_joined: _NonNegInt = 0
    abandoned: pydantic.StrictBool = False
    rows_dropped: _NonNegInt = 0
    microbatches_retrained: _NonNegInt = 0
    digest: Optional[pydantic.conlist(pydantic.StrictFloat, max_items=8)] = None
    round_failed: pydantic.StrictBool = False
    lr: Optional[_NonNegFloat] = None
    grad_norm: Optional[_NonNegFloat] = None
    eval_loss: Optional[pydantic.StrictFloat] = None
    rows_lost: _NonNegInt = 0
    unclipped: pydantic.StrictBool = False
    averaging_bytes: _NonNegInt = 0
    overflow: pydantic.StrictBool = False
    loss_scale: Optional[_NonNegFloat] = None


class MetricsModel(_Strict):
    peer_id: pydantic.StrictStr
    stage: Optional[_NonNegInt]
    role: pydantic.StrictStr
    epoch: _NonNegInt
    loss: Optional[pydantic.StrictFloat]
    tokens_per_s: _NonNegFloat
    rows_in_batch: _NonNegInt
    rows_averaged: _NonNegInt
    tasks_redone: _NonNegInt
    updated: pydantic.StrictFloat
    epochs_planned: Optional[_NonNegInt]
    finished: pydantic.StrictBool
    condition: pydantic.constr(strict=True, max_length=64) = ""
    holds_state: pydantic.StrictBool = False
    client_mode: pydantic.StrictBool = False
    bytes_sent: Dict[pydantic.constr(strict=True, max_length=16), _NonNegInt] = {}
    calls_served: Dict[pydantic.constr(strict=True, max_length=40), _NonNegInt] = {}
    complete_from: Optional[_NonNegInt] = None
    per_epoch: pydantic.conlist(EpochMetricsModel, max_items=MAX_EPOCHS_KEPT)
    worker_epochs: pydantic.conlist(EpochMetricsModel, max_items=MAX_EPOCHS_KEPT)
    source_epochs: pydantic.conlist(EpochMetricsModel, max_items=MAX_EPOCHS_KEPT)


class PlanModel(_Strict):
    plan: Dict[pydantic.StrictStr, Any]
    version: _NonNegInt
    created: pydantic.StrictFloat


class RecipeModel(_Strict):
    peer_id: pydantic.StrictStr
    recipe: Dict[pydantic.StrictStr, Any]
    created: pydantic.StrictFloat


def check_value(model: type[pydantic.BaseModel], value: dict[str, Any]) -> None:
    """Raise ValueError unless `value` passes `model` the way hivemind's SchemaValidator requires."""
    try:
        parsed = model.parse_obj(value).dict()
    except pydantic.ValidationError as e:
        raise ValueError(f"{model.__name__}: {e}") from e
    if parsed != value:
        raise ValueError(f"{model.__name__}: {value} needs type conversions ({parsed}); the DHT would reject it")


def _opt_float(x: float | None) -> float | None:
    return None if x is None else float(x)


class _Record:
    """A DHT value: a dataclass that turns into a plain dict the schema accepts as it is, and back."""

    schema: ClassVar[type[pydantic.BaseModel]]

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        check_value(self.schema, value)
        return value

    @classmethod
    def from_value(cls, value: dict[str, Any]) -> Self:
        check_value(cls.schema, value)
        return cls(**value)


@dataclass(kw_only=True)
class Link:
    """A measured link from the announcing peer to another peer."""

    latency_s: float
    bandwidth_bps: float  # bytes per second

    def __post_init__(self) -> None:
        self.latency_s, self.bandwidth_bps = float(self.latency_s), float(self.bandwidth_bps)


@dataclass(kw_only=True)
class PeerInfo(_Record):
    schema: ClassVar[type[pydantic.BaseModel]] = PeerInfoModel
    """Who a peer is and what it offers; key `{run_id}_peers`."""

    peer_id: str
    role: PeerRole
    server_role: ServerRole | None = None
    stage: int | None = None
    reliable: bool
    computes: bool = True  # False for a parameter server that only serves its stage, without computing layers
    compute: float  # measured FLOP/s
    memory: int = 0  # bytes available for layers; 0 when unknown
    maddrs: list[str] = field(default_factory=list)
    state: PeerState = "joining"
    started: float
    links: dict[str, Link] = field(default_factory=dict)  # peer id -> measured link to it

    def __post_init__(self) -> None:
        self.compute, self.started = float(self.compute), float(self.started)
        self.maddrs = [str(m) for m in self.maddrs]  # accepts Multiaddr objects
        self.links = {str(k): v if isinstance(v, Link) else Link(**v) for k, v in self.links.items()}



@dataclass(kw_only=True)
class Membership(_Record):
    schema: ClassVar[type[pydantic.BaseModel]] = MembershipModel
    """A peer's place in one stage; key `{run_id}_stage{k}`."""

    peer_id: str
    role: StageRole
    compute: float  # FLOP/s the FS uses to size this worker's tasks
    load: float = 0.0  # fraction of the peer's time busy, for rebalancing
    holds_state: bool = False  # a server that holds the stage's state (and serves it); every worker does
    client_mode: bool = False  # a worker that dials out only: nobody can download its state
    certificate: str | None = None  # a server: the owner's signature of its place (`live.authority`)
    data_source: bool = False  # ...which names it the data source
    layers: tuple[int, int] | None = None  # the layers [start, end) it holds or computes

    def __post_init__(self) -> None:
        self.compute, self.load = float(self.compute), float(self.load)
        if self.layers is not None:
            self.layers = (self.layers[0], self.layers[1])



@dataclass(kw_only=True)
class EpochMetrics:
    """What one peer saw of one closed epoch (docs/design.md §5 counts)."""

    epoch: int
    rows_in_batch: int
    rows_averaged: int
    tasks_redone: int
    loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0  # wall time of the epoch as this peer saw it
    rows_recomputed: int = 0  # rows redone because the worker that held their gradients vanished (an FS)
    workers_lost: int = 0  # workers that vanished holding gradients of the epoch (an FS)
    workers_joined: int = 0  # workers first seen while the epoch was open (an FS)
    abandoned: bool = False  # the data source abandoned the epoch (a server lost its rows); its batch came again
    rows_dropped: int = 0  # rows whose gradients went with a vanished worker, not redone (an FS, fault policy swarm)
    microbatches_retrained: int = 0  # microbatches of data fed again after a stage dropped rows (the data source)
    digest: list[float] | None = None  # of the parameters the worker stepped to (`protocol.optimization.Digest`)
    round_failed: bool = False  # the worker's all-reduce round failed or averaged nothing (a worker)
    lr: float | None = None  # the learning rate of the step (a worker)
    grad_norm: float | None = None  # the global gradient norm (a worker, with clip_norm or fp16; clip_norm clips by it)
    eval_loss: float | None = None  # held-out loss of the parameters after the epoch's step (the data source)
    rows_lost: int = 0  # rows of groupmates that died in the worker's round, missing from its average (a worker)
    unclipped: bool = False  # with clip_norm: no global norm came in time, the worker stepped unclipped (a worker)
    averaging_bytes: int = 0  # what the worker's process sent for the epoch's averaging: its deposit, its parts and
    # the averages it reduced (`p2ptrain.traffic`), so far (a worker)
    overflow: bool = False  # fp16: the epoch's gradients overflowed somewhere and the worker skipped its step
    loss_scale: float | None = None  # fp16: the loss scale the worker computed the epoch's gradients at

    def __post_init__(self) -> None:
        self.loss, self.seconds = _opt_float(self.loss), float(self.seconds)
        self.lr, self.grad_norm, self.eval_loss = _opt_float(self.lr), _opt_float(self.grad_norm), _opt_float(
            self.eval_loss)
        self.loss_scale = _opt_float(self.loss_scale)
        self.digest = None if self.digest is None else [float(x) for x in self.digest]


def join_epochs(before: list[EpochMetrics], now: list[EpochMetrics]) -> list[EpochMetrics]:
    """One peer's entries of two reads (or two processes) as one list, oldest first: `now`'s entry of an epoch wins."""
    merged = {entry.epoch: entry for entry in before} | {entry.epoch: entry for entry in now}
    return [merged[epoch] for epoch in sorted(merged)]


EPOCH_LISTS = ("per_epoch", "worker_epochs", "source_epochs")  # a metrics record's lists of epochs


@dataclass(kw_only=True)
class Metrics(_Record):
    schema: ClassVar[type[pydantic.BaseModel]] = MetricsModel
    """A peer's training progress; key `{run_id}_metrics`. Counters describe the latest epoch `epoch`."""

    peer_id: str
    stage: int | None
    role: str  # "fs", "bs", "worker", "client", ...
    epoch: int
    loss: float | None = None
    tokens_per_s: float = 0.0
    rows_in_batch: int = 0
    rows_averaged: int = 0
    tasks_redone: int = 0
    updated: float
    epochs_planned: int | None = None  # set by the data source only
    finished: bool = False  # the data source fed all its epochs and they closed
    condition: str = ""  # a server's view of its stage (`StageServer.condition`)
    holds_state: bool = False  # a server that computes nothing: its worker_epochs are its steps as a state holder
    client_mode: bool = False  # a worker that dials out only (behind NAT): it reduces no part of its stage's rounds
    bytes_sent: dict[str, int] = field(default_factory=dict)  # what its process has sent, by kind (p2ptrain.traffic)
    calls_served: dict[str, int] = field(default_factory=dict)  # requests its process served, by method (the same)
    # the oldest epoch from which the lists below hold every epoch the peer recorded; None: none was ever cut from them
    # (a record keeps its newest epochs only: `node.metrics.fit`)
    complete_from: int | None = None
    per_epoch: list[EpochMetrics] = field(default_factory=list)  # at most MAX_EPOCHS_KEPT, oldest first
    worker_epochs: list[EpochMetrics] = field(default_factory=list)  # a server that also computes
    source_epochs: list[EpochMetrics] = field(default_factory=list)  # the data source: tokens and wall time

    def __post_init__(self) -> None:
        self.loss, self.updated = _opt_float(self.loss), float(self.updated)
        self.tokens_per_s = float(self.tokens_per_s)
        self.per_epoch, self.worker_epochs, self.source_epochs = (
            [e if isinstance(e, EpochMetrics) else EpochMetrics(**e) for e in epochs]
            for epochs in (self.per_epoch, self.worker_epochs, self.source_epochs)
        )

    def newest(self, keep: int) -> Metrics:
        """This record with each of its lists of epochs cut to its newest ``keep`` entries, ``complete_from`` moved
        past what was cut."""
        lists = {name: getattr(self, name) for name in EPOCH_LISTS}
        cut = [entries[-keep].epoch if keep else entries[-1].epoch + 1
               for entries in lists.values() if len(entries) > keep]
        if not cut:
            return self
        if self.complete_from is not None:
            cut.append(self.complete_from)
        return replace(self, complete_from=max(cut),
                       **{name: entries[max(len(entries) - keep, 0):] for name, entries in lists.items()})



@dataclass(kw_only=True)
class PlanRecord(_Record):
    schema: ClassVar[type[pydantic.BaseModel]] = PlanModel
    """The planner's plan; key `{run_id}_plan`, subkey = the planner's public key only."""

    plan: dict[str, Any]  # msgpack-friendly (the planner's JSON form)
    version: int
    created: float

    def __post_init__(self) -> None:
        self.created = float(self.created)


@dataclass(kw_only=True)
class RecipeRecord(_Record):
    schema: ClassVar[type[pydantic.BaseModel]] = RecipeModel
    """The run's recipe as a stage-0 FS has it (`p2ptrain.recipe.Recipe.to_value`); key `{run_id}_recipe`. Readers
    take the data source's."""

    peer_id: str
    recipe: dict[str, Any]
    created: float

    def __post_init__(self) -> None:
        self.created = float(self.created)
