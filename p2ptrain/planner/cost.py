"""The cost model of DESIGN §3 (the contract), as pure functions over device indices.

Nothing here does I/O or reads a clock. Devices are indices into the arrays of a ``Network``; a stage is a
``StageLayout`` of index arrays. Every planner and baseline is scored by ``evaluate``.

Shares: the contract gives worker w the row share ``c_w / sum(c)``. A stage may instead carry explicit shares
(the refined planner sets them by time, as the runtime's pull-based task pool does in effect); ``evaluate`` then
uses those, and everything else is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from p2ptrain.planner.presets import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Network:
    """Devices' compute (FLOP/s), memory (bytes) and the latency (s) and inverse bandwidth (s/byte) of every link.

    ``latency[i, j]`` and ``inv_bandwidth[i, j]`` describe the link i -> j; the diagonal is 0 (no link to oneself).
    """

    flops: np.ndarray
    memory: np.ndarray
    latency: np.ndarray
    inv_bandwidth: np.ndarray

    @classmethod
    def from_matrices(cls, *, flops: np.ndarray, memory: np.ndarray, latency_s: np.ndarray,
                      bandwidth_bytes_s: np.ndarray) -> "Network":
        latency = np.array(latency_s, dtype=float)
        with np.errstate(divide="ignore"):
            inv = 1.0 / np.asarray(bandwidth_bytes_s, dtype=float)
        np.fill_diagonal(latency, 0.0)
        np.fill_diagonal(inv, 0.0)
        return cls(flops=np.asarray(flops, dtype=float), memory=np.asarray(memory, dtype=float), latency=latency,
                   inv_bandwidth=inv)

    @property
    def size(self) -> int:
        return len(self.flops)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and a global batch: ``D`` tokens in ``d`` microbatches of ``m = D/d`` tokens, messages ``A = t·m``."""

    model: ModelSpec
    batch_tokens: int
    microbatches: int

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or self.microbatches < 1 or self.microbatches > self.batch_tokens:
            raise ValueError(f"need 1 <= microbatches ({self.microbatches}) <= batch tokens ({self.batch_tokens})")

    @property
    def microbatch_tokens(self) -> float:
        return self.batch_tokens / self.microbatches

    @property
    def message_bytes(self) -> float:
        return self.model.activation_bytes_per_token * self.microbatch_tokens


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """One stage by device index: FS, BS and clients, its number of layers, optional shares over fs+bs+clients."""

    fs: np.ndarray
    bs: np.ndarray
    clients: np.ndarray
    layers: int
    shares: np.ndarray | None = None

    @property
    def workers(self) -> np.ndarray:
        return np.concatenate([self.fs, self.bs, self.clients]).astype(int)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """PT and its parts. ``stage_times_s[k] = d·(C_k + C_{k+1} + DT_k)``; ``PT = max(stage times, averaging)``."""

    batch_time_s: float
    lower_bound_s: float
    stage_times_s: tuple[float, ...]
    averaging_s: tuple[float, ...]
    feasible: bool
    problems: tuple[str, ...] = field(default=())

    @property
    def efficiency(self) -> float:
        return self.lower_bound_s / self.batch_time_s if np.isfinite(self.batch_time_s) else 0.0


def compute_shares(net: Network, workers: np.ndarray) -> np.ndarray:
    """The contract's row shares: proportional to compute."""
    c = net.flops[workers]
    return c / c.sum()


def server_link_time(net: Network, wl: Workload, servers: np.ndarray, others: np.ndarray,
                     shares: np.ndarray) -> np.ndarray:
    """For each server j: min over x in ``others`` of a_{j,x} + p_j·A/b_{j,x} (its best server of the other role)."""
    lat = net.latency[np.ix_(servers, others)]
    inv = net.inv_bandwidth[np.ix_(servers, others)]
    return (lat + (shares * wl.message_bytes)[:, None] * inv).min(axis=1)


def client_link_time(net: Network, wl: Workload, fs: np.ndarray, bs: np.ndarray, clients: np.ndarray,
                     shares: np.ndarray) -> np.ndarray:
    """For each client u: its best FS -> u transfer plus its best u -> BS transfer."""
    load = (shares * wl.message_bytes)[None, :]
    inbound = (net.latency[np.ix_(fs, clients)] + load * net.inv_bandwidth[np.ix_(fs, clients)]).min(axis=0)
    outbound = (net.latency[np.ix_(clients, bs)].T + load * net.inv_bandwidth[np.ix_(clients, bs)].T).min(axis=0)
    return inbound + outbound


def link_times(net: Network, wl: Workload, stage: StageLayout, shares: np.ndarray) -> np.ndarray:
    """Communication part of T_w for every worker of the stage (order: fs, bs, clients)."""
    nf, nb = len(stage.fs), len(stage.bs)
    parts = [server_link_time(net, wl, stage.fs, stage.bs, shares[:nf]),
             server_link_time(net, wl, stage.bs, stage.fs, shares[nf:nf + nb])]
    if len(stage.clients):
        parts.append(client_link_time(net, wl, stage.fs, stage.bs, stage.clients, shares[nf + nb:]))
    return np.concatenate(parts)


def worker_times(net: Network, wl: Workload, stage: StageLayout) -> np.ndarray:
    """T_w of DESIGN §3 for every worker of the stage (order: fs, bs, clients)."""
    workers = stage.workers
    shares = compute_shares(net, workers) if stage.shares is None else np.asarray(stage.shares, dtype=float)
    work = shares * wl.microbatch_tokens * stage.layers * wl.model.flops_per_token_per_layer
    return link_times(net, wl, stage, shares) + work / net.flops[workers]


def data_parallel_time(net: Network, wl: Workload, stage: StageLayout) -> float:
    """DT_k = max_w T_w (paper Eq. 1)."""
    return float(worker_times(net, wl, stage).max())


def inter_stage_time(net: Network, wl: Workload, bs_prev: np.ndarray, fs_next: np.ndarray) -> float:
    """C_k: mean over (b in B_{k-1}, f in F_k) of a_bf + A/b_bf."""
    lat = net.latency[np.ix_(bs_prev, fs_next)]
    inv = net.inv_bandwidth[np.ix_(bs_prev, fs_next)]
    return float((lat + wl.message_bytes * inv).mean())


def link_extremes(net: Network, workers: np.ndarray) -> tuple[float, float]:
    """(largest latency, largest inverse bandwidth) over links between two distinct workers."""
    sub = np.ix_(workers, workers)
    return float(net.latency[sub].max()), float(net.inv_bandwidth[sub].max())


def averaging_time(net: Network, wl: Workload, workers: np.ndarray, layers: int) -> float:
    """AR_k = 2(n-1)/n · L_k·P / b_min + 2(n-1)·a_max; 0 for a single worker."""
    n = len(workers)
    if n <= 1:
        return 0.0
    a_max, inv_b_min = link_extremes(net, workers)
    return 2 * (n - 1) / n * layers * wl.model.param_bytes_per_layer * inv_b_min + 2 * (n - 1) * a_max


def layer_capacity(net: Network, wl: Workload, workers: np.ndarray) -> int:
    """Most layers every worker of the set can hold (L_k·M <= mem_w)."""
    return int(np.floor(net.memory[workers].min() / wl.model.memory_bytes_per_layer))


def lower_bound(net: Network, wl: Workload) -> float:
    """LB = D·L·f / Σ_all c: all compute perfectly balanced, free network, no memory limit."""
    work = wl.batch_tokens * wl.model.layers * wl.model.flops_per_token_per_layer
    return float(work / net.flops.sum())


def layout_problems(net: Network, wl: Workload, stages: Sequence[StageLayout]) -> list[str]:
    """Why a layout is not a valid plan (empty if it is)."""
    problems = []
    if not stages:
        return ["no stage"]
    if sum(s.layers for s in stages) != wl.model.layers:
        problems.append(f"stages hold {sum(s.layers for s in stages)} layers, the model has {wl.model.layers}")
    seen = np.concatenate([s.workers for s in stages])
    if len(np.unique(seen)) != len(seen):
        problems.append("a device is placed twice")
    for k, s in enumerate(stages):
        if len(s.fs) == 0 or len(s.bs) == 0:
            problems.append(f"stage {k} needs at least one FS and one BS")
        if s.layers < 1:
            problems.append(f"stage {k} has no layer")
        elif s.layers > layer_capacity(net, wl, s.workers):
            problems.append(f"stage {k}: {s.layers} layers exceed a worker's memory")
        if s.shares is not None and (len(s.shares) != len(s.workers) or np.any(np.asarray(s.shares) < 0)
                                     or not np.isclose(np.sum(s.shares), 1.0)):
            problems.append(f"stage {k}: shares must be >= 0, one per worker, and sum to 1")
    return problems


def evaluate(net: Network, wl: Workload, stages: Sequence[StageLayout]) -> Evaluation:
    """Predicted time per global batch (paper Eq. 2 with memory and averaging), in pipeline order."""
    lb = lower_bound(net, wl)
    problems = layout_problems(net, wl, stages)
    if problems:
        return Evaluation(batch_time_s=float("inf"), lower_bound_s=lb, stage_times_s=(), averaging_s=(),
                          feasible=False, problems=tuple(problems))
    boundary = [0.0] + [inter_stage_time(net, wl, a.bs, b.fs) for a, b in zip(stages, stages[1:])] + [0.0]
    d = wl.microbatches
    times = tuple(d * (boundary[k] + boundary[k + 1] + data_parallel_time(net, wl, s)) for k, s in enumerate(stages))
    averaging = tuple(averaging_time(net, wl, s.workers, s.layers) for s in stages)
    return Evaluation(batch_time_s=max(max(times), max(averaging)), lower_bound_s=lb, stage_times_s=times,
                      averaging_s=averaging, feasible=True)
