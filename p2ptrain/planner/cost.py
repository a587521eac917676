"""The cost model of docs/design.md §3 (the contract), as pure functions over device indices.

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
    """A model and a global batch: ``D`` tokens in ``d`` microbatches of ``m = D/d`` tokens, messages ``A = t·m``;
    each stage averages once every ``H`` global batches (`--average-every`), so a batch carries ``1/H`` of a round."""

    model: ModelSpec
    batch_tokens: int
    microbatches: int
    average_every: int = 1

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or self.microbatches < 1 or self.microbatches > self.batch_tokens:
            raise ValueError(f"need 1 <= microbatches ({self.microbatches}) <= batch tokens ({self.batch_tokens})")
        if self.average_every < 1:
            raise ValueError(f"average_every must be >= 1, got {self.average_every}")

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


def block(matrix: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``matrix[np.ix_(rows, cols)]`` without ``np.ix_``'s checks, which dominate on the planners' hot path."""
    return matrix[np.asarray(rows)[:, None], cols]


def compute_shares(net: Network, workers: np.ndarray) -> np.ndarray:
    """The contract's row shares: proportional to compute."""
    c = net.flops[workers]
    return c / c.sum()


def server_link_time(net: Network, wl: Workload, servers: np.ndarray, others: np.ndarray,
                     shares: np.ndarray) -> np.ndarray:
    """For each server j: min over x in ``others`` of a_{j,x} + p_j·A/b_{j,x} (its best server of the other role)."""
    lat = block(net.latency, servers, others)
    inv = block(net.inv_bandwidth, servers, others)
    return (lat + (shares * wl.message_bytes)[:, None] * inv).min(axis=1)


def client_link_time(net: Network, wl: Workload, fs: np.ndarray, bs: np.ndarray, clients: np.ndarray,
                     shares: np.ndarray) -> np.ndarray:
    """For each client u: its best FS -> u transfer plus its best u -> BS transfer."""
    load = (shares * wl.message_bytes)[None, :]
    inbound = (block(net.latency, fs, clients) + load * block(net.inv_bandwidth, fs, clients)).min(axis=0)
    outbound = (block(net.latency, clients, bs).T + load * block(net.inv_bandwidth, clients, bs).T).min(axis=0)
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
    """T_w of docs/design.md §3 for every worker of the stage (order: fs, bs, clients)."""
    workers = stage.workers
    shares = compute_shares(net, workers) if stage.shares is None else np.asarray(stage.shares, dtype=float)
    work = shares * wl.microbatch_tokens * stage.layers * wl.model.flops_per_token_per_layer
    return link_times(net, wl, stage, shares) + work / net.flops[workers]


def data_parallel_time(net: Network, wl: Workload, stage: StageLayout) -> float:
    """DT_k = max_w T_w (paper Eq. 1)."""
    return float(worker_times(net, wl, stage).max())


def inter_stage_time(net: Network, wl: Workload, bs_prev: np.ndarray, fs_next: np.ndarray) -> float:
    """C_k: mean over (b in B_{k-1}, f in F_k) of a_bf + A/b_bf."""
    lat = block(net.latency, bs_prev, fs_next)
    inv = block(net.inv_bandwidth, bs_prev, fs_next)
    return float((lat + wl.message_bytes * inv).mean())


def link_extremes(net: Network, workers: np.ndarray) -> tuple[float, float]:
    """(largest latency, largest inverse bandwidth) over links between two distinct workers."""
    return float(block(net.latency, workers, workers).max()), float(block(net.inv_bandwidth, workers, workers).max())


def round_time(net: Network, wl: Workload, workers: np.ndarray, nbytes: float) -> float:
    """An all-reduce of ``nbytes`` among ``workers``: (2(n-1)/n · bytes / b_min + 2(n-1)·a_max) / H, a round's time
    over the H batches between rounds; 0 for a single worker."""
    n = len(workers)
    if n <= 1:
        return 0.0
    a_max, inv_b_min = link_extremes(net, workers)
    return (2 * (n - 1) / n * nbytes * inv_b_min + 2 * (n - 1) * a_max) / wl.average_every


def stage_bytes(wl: Workload, start: int, end: int) -> tuple[float, float]:
    """(bytes in the stage's averaging round, bytes of memory on each worker) of a stage of layers [start, end):
    ``L_k·P`` and ``L_k·M``, plus the shared tensors it holds (``ModelSpec.shared``)."""
    held_param, held_memory = wl.model.held(start, end)
    layers = end - start
    return layers * wl.model.param_bytes_per_layer + held_param, layers * wl.model.memory_bytes_per_layer + held_memory


def shared_rounds(wl: Workload, ranges: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, ...], float]]:
    """The rounds across stages that keep shared tensors equal (`protocol.sharing`): one per set of stages holding
    the same shared tensors, with the bytes it averages; a tensor only one stage holds needs none."""
    rounds: dict[tuple[int, ...], float] = {}
    for tensors in wl.model.shared:
        stages = tuple(k for k, (start, end) in enumerate(ranges) if tensors.held_by(start, end))
        if len(stages) > 1:
            rounds[stages] = rounds.get(stages, 0.0) + tensors.param_bytes
    return sorted(rounds.items())


def layer_ranges(stages: Sequence[StageLayout]) -> list[tuple[int, int]]:
    """Each stage's layers [start, end), in pipeline order."""
    ends = np.cumsum([s.layers for s in stages])
    return [(int(end) - s.layers, int(end)) for s, end in zip(stages, ends)]


def averaging_times(net: Network, wl: Workload, stages: Sequence[StageLayout]) -> tuple[float, ...]:
    """AR_k: stage k's round over ``L_k·P`` plus its shared tensors' bytes, then every round across stages it takes
    part in (their members wait for each holding stage's round, so a stage's averaging ends no earlier)."""
    ranges = layer_ranges(stages)
    times = [round_time(net, wl, s.workers, stage_bytes(wl, start, end)[0]) for s, (start, end) in zip(stages, ranges)]
    for holders, nbytes in shared_rounds(wl, ranges):
        across = round_time(net, wl, np.concatenate([stages[k].workers for k in holders]), nbytes)
        for k in holders:
            times[k] += across
    return tuple(times)


def layers_that_fit(memory: float | np.ndarray, model: ModelSpec) -> np.ndarray:
    """Most layers a device of ``memory`` bytes can hold with every shared tensor besides (a stage may hold them
    all), so a layer count within it fits wherever the stage sits in the pipeline."""
    room = (np.asarray(memory, dtype=float) - sum(t.memory_bytes for t in model.shared)) / model.memory_bytes_per_layer
    return np.maximum(np.floor(room), 0).astype(int)


def lower_bound(net: Network, wl: Workload) -> float:
    """LB = D·L·f / Σ_all c: all compute perfectly balanced, free network, no memory limit."""
    work = wl.batch_tokens * wl.model.layers * wl.model.flops_per_token_per_layer
    return float(work / net.flops.sum())


def memory_lower_bound(net: Network, wl: Workload, reliable: np.ndarray) -> float:
    """A lower bound on PT that, unlike LB, counts memory and the two reliable servers every stage needs.

    Any plan has PT >= D·f·L_k / C_k for every stage k (C_k: its workers' compute; even time-set shares give some
    worker at least its compute's share). Split the stages at a layer count c: the j stages holding at most c
    layers hold at most j·c layers; the others hold more than c, so none of their workers has room for only c
    layers or fewer, and they lack the reliable servers of the j small stages. Hence, for the plan's own j,
    L - j·c <= PT/(D·f) · (compute of devices with room for more than c layers, minus the 2j least computing
    reliable ones among them that the small stages may need). The bound takes, for each c, the j that favours
    the plan most, and the largest result over c; c = 0 counts only devices that can hold a layer at all.
    Free network and perfect balance otherwise, so it is never above the PT of a valid plan.
    """
    layers, per_layer = wl.model.layers, wl.batch_tokens * wl.model.flops_per_token_per_layer
    caps = np.floor(net.memory / wl.model.memory_bytes_per_layer).astype(int)
    reliable = np.asarray(reliable, dtype=bool)
    k_max = min(int(reliable.sum()) // 2, layers)
    worst = 0.0  # the largest lower bound on PT/(D·f) over the split points c
    for c in [0, *sorted({int(x) for x in caps if 0 < x < layers})]:
        high = caps > c
        spare = np.sort(net.flops[reliable & high])  # reliable servers a small stage might take, least first
        reliable_low = int((reliable & ~high).sum())
        best = float("inf")  # the smallest bound over the plan's possible j
        for j in range(k_max + 1 if c else 1):
            rest = layers - j * c
            if rest <= 0:
                best = 0.0
                break
            taken = max(0, 2 * j - reliable_low)
            if len(spare) - taken < 2:  # the big stages need a reliable FS and BS too
                continue
            best = min(best, rest / (net.flops[high].sum() - spare[:taken].sum()))
        worst = max(worst, best)
    return max(lower_bound(net, wl), float(per_layer * worst))


def link_lower_bound(net: Network, wl: Workload, reliable: np.ndarray) -> float:
    """A lower bound on PT that counts each device's links, the inter-stage transfer and averaging as well as its
    compute and memory.

    A worker w with row share p in a stage of L_k layers has T_w = link + p·L_k·m·f/c_w, its link at least
    ``lat_w + p·A·inv_w``: for a server, the least latency and inverse bandwidth to any other reliable device; for a
    client, the least from one plus the least to one. A plan of PT = d·T has, in every stage, DT_k <= T - e with e
    the least inter-stage transfer C of any two reliable devices when there are several stages (each stage has a
    boundary), 0 for one stage (then only devices with room for every layer can serve). Its averaging AR_k <= PT,
    and AR_k >= (L_k·P·ib_w + 2·a_w)/H for each of its workers (n >= 2 workers; ib_w, a_w: w's least inverse
    bandwidth and latency to any other device), which caps L_k. So p·L_k <= g_w(T) = min(l_w, l_w·(T - e - lat_w) /
    (A·inv_w + l_w·m·f/c_w)), l_w the least of the layers w has room for and the averaging cap (g grows with L_k).
    Every stage's shares sum to 1, so the layers sum: L = Σ_k L_k = Σ_w p_w·L_{k(w)} <= Σ_w g_w(T), which grows with
    T; d times the least T at which it reaches L (by bisection, the lower end kept) bounds PT, the least over one
    stage and several. Beside it, some stage holds ceil(L / K_max) layers (K_max: half the reliable devices) and
    averages them. With no link costs it is the compute bound LB.
    """
    reliable = np.asarray(reliable, dtype=bool)
    if reliable.sum() < 2:
        return 0.0
    eye = np.eye(net.size, dtype=bool)
    others = np.where(reliable[None, :] & ~eye, 0.0, np.inf)  # reliable, not oneself
    out_lat, out_inv = (net.latency + others).min(axis=1), (net.inv_bandwidth + others).min(axis=1)
    in_lat, in_inv = (net.latency.T + others).min(axis=1), (net.inv_bandwidth.T + others).min(axis=1)
    lat, inv = in_lat + out_lat, in_inv + out_inv  # a client's
    lat[reliable] = np.minimum(lat, out_lat)[reliable]  # a reliable device may serve: one transfer
    inv[reliable] = np.minimum(inv, out_inv)[reliable]
    anyone = np.where(eye, np.inf, 0.0)
    ib = np.maximum((net.inv_bandwidth + anyone).min(axis=1), (net.inv_bandwidth.T + anyone).min(axis=1))
    a = np.maximum((net.latency + anyone).min(axis=1), (net.latency.T + anyone).min(axis=1))
    layers, m, f = wl.model.layers, wl.microbatch_tokens, wl.model.flops_per_token_per_layer
    d, per_round = wl.microbatches, wl.model.param_bytes_per_layer / wl.average_every
    room = np.minimum(np.floor(net.memory / wl.model.memory_bytes_per_layer), layers)
    pairs = np.ix_(reliable, reliable)
    boundary = float((net.latency[pairs] + wl.message_bytes * net.inv_bandwidth[pairs] + np.where(eye[pairs], np.inf, 0.0)).min())

    def covered(t: float, room: np.ndarray, boundary: float) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            cap = np.minimum(room, np.floor(np.maximum(d * t - 2 * a / wl.average_every, 0.0) / (per_round * ib)))
            share = np.where(cap > 0, cap * np.maximum(t - boundary - lat, 0.0) /
                             (wl.message_bytes * inv + cap * m * f / net.flops), 0.0)
        return float(np.minimum(share, cap).sum())

    def least(room: np.ndarray, boundary: float) -> float:
        low, high = 0.0, 1.0
        while covered(high, room, boundary) < layers:
            low, high = high, 2 * high
            if high > 1e12:
                return float("inf")
        while high - low > 1e-12 * high:
            middle = (low + high) / 2
            low, high = (low, middle) if covered(middle, room, boundary) >= layers else (middle, high)
        return low

    several = least(room, boundary)
    whole = room >= layers
    one = least(np.where(whole, room, 0.0), 0.0) if (reliable & whole).sum() >= 2 else float("inf")
    # some stage holds at least ceil(L / K_max) layers and two reliable servers: its averaging is at least that much
    most = -(-layers // min(int(reliable.sum()) // 2, layers))
    averaging = (most * wl.model.param_bytes_per_layer * ib[reliable].min() + 2 * a[reliable].min()) / wl.average_every
    return float(max(d * min(several, one), averaging))


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
    for k, (s, (start, end)) in enumerate(zip(stages, layer_ranges(stages))):
        if len(s.fs) == 0 or len(s.bs) == 0:
            problems.append(f"stage {k} needs at least one FS and one BS")
        if s.layers < 1:
            problems.append(f"stage {k} has no layer")
        elif len(s.workers) and stage_bytes(wl, start, end)[1] > net.memory[s.workers].min():
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
    averaging = averaging_times(net, wl, stages)
    return Evaluation(batch_time_s=max(max(times), max(averaging)), lower_bound_s=lb, stage_times_s=times,
                      averaging_s=averaging, feasible=True)
