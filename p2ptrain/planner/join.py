"""Which stage a joining client takes (paper §3.2.1 "Dynamic Client Participation", issue 7): pure, no I/O.

A client started without a stage measures its links to the servers of every stage and picks one by a rule:

- ``paper``: the paper's rule, the stage whose servers it reaches with the best average bandwidth;
- ``cost``: the stage where adding it gives the lowest predicted batch time under the docs/design.md §3 cost model
  (``cost.evaluate``, the contract), i.e. the stage where it lowers the batch time most. When the model cannot tell
  stages apart (equal times within a relative 1e-9), the paper's rule decides among them.

Either rule considers only the stages the client can work in: it reached every FS and BS of the stage, and it can
hold the stage's layers (``L_k·M <= mem``).

The swarm picture is what the client could read and measure; the cost model needs every link, so:

- a link i -> j that only j -> i was measured for is taken as symmetric;
- the client's link to a stage mate that is not a server (another client) is taken as its worst measured link to
  that stage's servers: its way into the stage, and what the all-reduce among that stage's workers would see;
- any other pair nobody measured gets the best link measured anywhere. Such pairs are the same in every candidate
  placement, and an optimistic guess keeps them from masking, through the model's maxima, the differences the
  client did measure; a pessimistic one can make every candidate predict the same time.
- a member whose memory is unknown is taken to hold its stage (it already runs there).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from p2ptrain.planner.cost import Network, StageLayout, Workload, evaluate, stage_bytes
from p2ptrain.planner.records import StagePlan

STAGE_CHOICES: tuple[str, ...] = ("cost", "paper")  # the default first
TIE_TOLERANCE = 1e-9  # relative: batch times this close are equal to the cost rule


@dataclass(frozen=True, kw_only=True)
class LinkEstimate:
    """A link i -> j: latency (s) and bandwidth (bytes/s)."""

    latency_s: float
    bandwidth_bps: float


@dataclass(frozen=True, kw_only=True)
class SwarmView:
    """The running swarm as a joining client reads it: each stage's layers, FS, BS and clients (``StagePlan``),
    every member's compute (FLOP/s; a server that does not compute gets a token figure, as live planning gives it),
    the memory of members that announced it (bytes), and the links that members measured."""

    stages: tuple[StagePlan, ...]
    flops: Mapping[str, float]
    memory: Mapping[str, float]
    links: Mapping[tuple[str, str], LinkEstimate]


@dataclass(frozen=True, kw_only=True)
class Joiner:
    """The joining client: its id, compute, memory and measured links to servers (a server it could not reach is
    absent)."""

    peer_id: str
    flops: float
    memory: float
    links: Mapping[str, LinkEstimate]


@dataclass(frozen=True, kw_only=True)
class StageOption:
    """One stage as a candidate: ``mean_bandwidth_bps`` over its servers (the paper's figure) and the predicted
    batch time with the client added to it (``inf`` when it is no candidate)."""

    stage: int
    reachable: bool  # the client reached every FS and BS of the stage
    fits: bool  # the client can hold the stage's layers
    mean_bandwidth_bps: float
    batch_time_s: float

    @property
    def candidate(self) -> bool:
        return self.reachable and self.fits


@dataclass(frozen=True, kw_only=True)
class StageChoice:
    """The stage picked by ``rule``, every stage's figures, and the predicted batch time without the client."""

    stage: int
    rule: str
    options: tuple[StageOption, ...]
    baseline_s: float

    @property
    def chosen(self) -> StageOption:
        return self.options[self.stage]


def choose_stage(view: SwarmView, joiner: Joiner, *, workload: Workload, rule: str) -> StageChoice:
    """The stage ``joiner`` should take by ``rule`` (one of ``STAGE_CHOICES``); ValueError if no stage is a
    candidate, a peer is named twice or a member's compute is missing. A view the cost model finds infeasible (a
    stage without FS or BS) predicts ``inf`` everywhere, which leaves the choice to the paper's rule."""
    if rule not in STAGE_CHOICES:
        raise ValueError(f"unknown stage choice {rule!r}; use one of {', '.join(STAGE_CHOICES)}")
    if not view.stages:
        raise ValueError("the swarm has no stage")
    members = [m for stage in view.stages for m in stage.workers]
    if len(set(members)) != len(members) or joiner.peer_id in members:
        raise ValueError("a peer is a member of two stages, or the joiner is already a member")
    missing = sorted(m for m in members if m not in view.flops)
    if missing:
        raise ValueError(f"no compute for {', '.join(missing)}")
    ids = [*members, joiner.peer_id]
    net = _network(view, joiner, ids, workload)
    where = {device: i for i, device in enumerate(ids)}
    layouts = [_layout(stage, where, ()) for stage in view.stages]
    baseline = evaluate(net, workload, layouts).batch_time_s
    options = []
    for k, stage in enumerate(view.stages):
        servers = stage.fs + stage.bs
        reachable = all(s in joiner.links for s in servers)
        fits = stage_bytes(workload, *stage.layers)[1] <= joiner.memory
        bandwidths = [joiner.links[s].bandwidth_bps for s in servers if s in joiner.links]
        predicted = math.inf
        if reachable and fits:
            joined = [*layouts[:k], _layout(stage, where, (joiner.peer_id,)), *layouts[k + 1:]]
            predicted = evaluate(net, workload, joined).batch_time_s
        # the paper averages over all the stage's servers; one it could not reach counts as no bandwidth
        mean = float(sum(bandwidths) / len(servers)) if servers else 0.0
        options.append(StageOption(stage=k, reachable=reachable, fits=fits, mean_bandwidth_bps=mean,
                                   batch_time_s=float(predicted)))
    candidates = [o for o in options if o.candidate]
    if not candidates:
        raise ValueError("no stage can take this client: it reached no stage's every FS and BS, or cannot hold "
                         "any stage's layers")
    if rule == "cost":
        best = min(o.batch_time_s for o in candidates)
        candidates = [o for o in candidates if o.batch_time_s <= best * (1 + TIE_TOLERANCE)]
    # the paper's rule: best average bandwidth; ties go to the first stage
    pick = max(candidates, key=lambda o: (o.mean_bandwidth_bps, -o.stage))
    return StageChoice(stage=pick.stage, rule=rule, options=tuple(options), baseline_s=float(baseline))


def _layout(stage: StagePlan, where: Mapping[str, int], extra: tuple[str, ...]) -> StageLayout:
    def index(peers: tuple[str, ...]) -> np.ndarray:
        return np.array([where[p] for p in peers], dtype=int)

    return StageLayout(fs=index(stage.fs), bs=index(stage.bs), clients=index(stage.clients + extra),
                       layers=stage.layers[1] - stage.layers[0])


def _network(view: SwarmView, joiner: Joiner, ids: list[str], workload: Workload) -> Network:
    """The cost model's network over `ids` (the joiner last), filled in as the module docstring says."""
    n = len(ids)
    where = {device: i for i, device in enumerate(ids)}
    measured: dict[tuple[int, int], LinkEstimate] = {}
    for (a, b), link in view.links.items():
        if a in where and b in where and a != b and a != joiner.peer_id and b != joiner.peer_id:
            measured[(where[a], where[b])] = link
    me = where[joiner.peer_id]
    for server, link in joiner.links.items():
        if server in where and server != joiner.peer_id:
            measured[(me, where[server])] = link
    for stage in view.stages:
        reached = [joiner.links[s] for s in stage.fs + stage.bs if s in joiner.links]
        if reached:
            worst = LinkEstimate(latency_s=max(x.latency_s for x in reached),
                                 bandwidth_bps=min(x.bandwidth_bps for x in reached))
            for mate in stage.clients:
                measured.setdefault((me, where[mate]), worst)
    for (a, b), link in list(measured.items()):
        measured.setdefault((b, a), link)
    if measured:
        best_latency = min(x.latency_s for x in measured.values())
        best_bandwidth = max(x.bandwidth_bps for x in measured.values())
    else:  # nothing measured at all: a free network, so compute alone decides
        best_latency, best_bandwidth = 0.0, math.inf
    latency = np.full((n, n), best_latency)
    bandwidth = np.full((n, n), best_bandwidth)
    for (i, j), link in measured.items():
        latency[i, j], bandwidth[i, j] = link.latency_s, link.bandwidth_bps
    whole_model = stage_bytes(workload, 0, workload.model.layers)[1]
    memory = [joiner.memory if device == joiner.peer_id else view.memory.get(device, whole_model) for device in ids]
    flops = [joiner.flops if device == joiner.peer_id else view.flops[device] for device in ids]
    return Network.from_matrices(flops=np.array(flops, dtype=float), memory=np.array(memory, dtype=float),
                                     latency_s=latency, bandwidth_bytes_s=bandwidth)
