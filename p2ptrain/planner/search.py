"""The engine the planners share: stage memberships, their cost curves, optimal layer counts, local search.

A stage's batch-time terms are linear in its layer count L_k under the contract's compute-proportional shares:
``d·(C_k + C_{k+1} + comm_k) + L_k·d·m·f/Σc_k`` and ``AR_k = 2(n-1)·a_max + L_k·2(n-1)/n·P/b_min``, with
``L_k <= cap_k`` from memory. So for fixed memberships the layer counts that minimise PT are found exactly
(``allocate``), and a local search only has to move devices. A continuous relaxation of PT breaks ties between
memberships whose integer PT is equal, so the search can cross plateaus.

Shared tensors (``ModelSpec.shared``) add to a stage's memory and averaging what it holds, which depends on where
its layers lie. The first and the last stage's layers are known from their counts; a middle stage is priced at the
most any window of its count could hold, and a round across stages among every stage that might hold its tensors.
That is exact for ALBERT's single block group and for tied embeddings, an upper bound for several block groups;
plans are scored exactly (``cost.evaluate``) afterwards.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Iterator, Sequence

import numpy as np

from p2ptrain.planner.cost import Network, StageLayout, Workload, block, compute_shares, round_time
from p2ptrain.planner.presets import ModelSpec

FS, BS, CLIENT = 0, 1, 2
CACHED = 100_000  # entries of a per-membership cache, cleared when full: a long search must not grow without bound
# partners `stats` found and `levels` has not taken yet: it asks next in a timed score, while a score at compute
# shares never does, so a few suffice
PENDING = 1_000
CACHED_VALUES = 10_000_000  # floats a cache of per-device columns holds (80 MB), whatever the swarm's size


def _make_room(cache: dict, limit: int = CACHED) -> None:
    if len(cache) >= limit:
        cache.clear()


@dataclass(frozen=True)
class Group:
    """A stage's members by device index, each role sorted, so equal memberships compare and hash equal."""

    fs: tuple[int, ...]
    bs: tuple[int, ...]
    clients: tuple[int, ...] = ()
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # groups are dictionary keys on the search's hot path: hash the member tuples once
        object.__setattr__(self, "_hash", hash((self.fs, self.bs, self.clients)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, fs: Iterable[int], bs: Iterable[int], clients: Iterable[int] = ()) -> "Group":
        return cls(tuple(sorted(int(x) for x in fs)), tuple(sorted(int(x) for x in bs)),
                   tuple(sorted(int(x) for x in clients)))

    @property
    def workers(self) -> tuple[int, ...]:
        return self.fs + self.bs + self.clients

    @property
    def servers(self) -> tuple[int, ...]:
        return self.fs + self.bs

    @property
    def valid(self) -> bool:
        return bool(self.fs) and bool(self.bs)

    def role(self, device: int) -> int:
        return FS if device in self.fs else BS if device in self.bs else CLIENT

    def without(self, device: int) -> "Group":
        if device not in self.fs and device not in self.bs and device not in self.clients:
            return self  # moves ask it of every stage: the others stay the same objects, cheap to hash and compare
        return Group(tuple(x for x in self.fs if x != device), tuple(x for x in self.bs if x != device),
                     tuple(x for x in self.clients if x != device))

    def adding(self, device: int, role: int) -> "Group":
        parts = [self.fs, self.bs, self.clients]
        part = parts[role]
        at = bisect.bisect_left(part, device)
        parts[role] = part[:at] + (int(device),) + part[at:]
        return Group(*parts)

    def layout(self, layers: int, shares: np.ndarray | None = None) -> StageLayout:
        return StageLayout(fs=np.array(self.fs, dtype=int), bs=np.array(self.bs, dtype=int),
                           clients=np.array(self.clients, dtype=int), layers=layers, shares=shares)


def merge_stages(groups: list[Group], k: int) -> list[Group]:
    """Stages k and k+1 as one stage; every server keeps its role (the local search flips roles as needed)."""
    a, b = groups[k], groups[k + 1]
    return groups[:k] + [Group.of(a.fs + b.fs, a.bs + b.bs, a.clients + b.clients)] + groups[k + 2:]


@dataclass(frozen=True)
class GroupStats:
    comm: float            # max over workers of the link part of T_w, compute-proportional shares
    speed: float           # Σ c over workers
    ar_fixed: float        # 2(n-1)·a_max / H
    ar_per_byte: float     # 2(n-1)/n / b_min / H
    ar_per_layer: float    # 2(n-1)/n · P / b_min / H
    memory: float          # the least memory of a worker
    cap: int               # layers every worker can hold, shared tensors aside
    worst: int             # worker with the largest link time
    far: tuple[int, ...]   # workers at the ends of the highest-latency and of the lowest-bandwidth link
    weakest: int           # worker with the least memory


@dataclass(frozen=True)
class Held:
    """Shared tensors' (averaged bytes, memory bytes) a stage of l = 1..L layers holds, by its place: ``only`` (one
    stage), ``first``, ``last`` and ``middle`` (the most any window of l layers strictly inside holds), each an
    (L, 2) array; and which stages may hold each tensor."""

    only: np.ndarray
    first: np.ndarray
    last: np.ndarray
    middle: np.ndarray

    @classmethod
    def of(cls, model: ModelSpec) -> "Held":
        n = model.layers
        window = np.array([[model.held(start, end) for end in range(n + 1)] for start in range(n + 1)])
        steps = np.arange(1, n + 1)
        middle = np.array([window[np.arange(1, n - count), np.arange(1 + count, n)].max(axis=0) if n - count > 1 else window[0, n]
                           for count in steps])
        return cls(only=np.tile(window[0, n], (n, 1)), first=window[0, steps], last=window[n - steps, n],
                   middle=middle)

    def place(self, stage: int, stages: int) -> np.ndarray:
        if stages == 1:
            return self.only
        return self.first if stage == 0 else self.last if stage == stages - 1 else self.middle


def holders(model: ModelSpec, stages: int) -> list[tuple[tuple[int, ...], float]]:
    """Rounds across stages as the engine prices them: for each set of stages that may hold the same shared tensors
    (layer 0's stage, the last layer's, or any stage for a tensor an inner layer applies), the bytes they average."""
    rounds: dict[tuple[int, ...], float] = {}
    last = model.layers - 1
    for tensors in model.shared:
        if any(0 < layer < last for layer in tensors.layers):
            may = tuple(range(stages))
        else:
            may = tuple(sorted({0 if layer == 0 else stages - 1 for layer in tensors.layers}))
        if len(may) > 1:
            rounds[may] = rounds.get(may, 0.0) + tensors.param_bytes
    return sorted(rounds.items())


@dataclass(frozen=True)
class Curves:
    """Per stage: pipeline intercept and slope, averaging intercept and slope (s, s per layer), memory cap."""

    intercept: np.ndarray
    slope: np.ndarray
    ar0: np.ndarray
    ar1: np.ndarray
    cap: np.ndarray
    averaging: np.ndarray | None = None  # stages x L: AR_k by layer count, where shared tensors make it non-linear


@dataclass(eq=False)
class Score:
    pt: float                   # PT with the best integer layer counts
    curves: Curves | None = None
    total: int = 0
    table: np.ndarray | None = None  # stage x layer-count times the counts come from
    load: float | None = None   # timed scores: the mean of the ``total`` least entries of ``table``
    groups: tuple[Group, ...] | None = None  # timed scores: the plan, whose moves ``Engine.score`` scores against it

    @property
    def reach(self) -> float:
        """The highest PT that may still beat this score (``better_than``)."""
        return self.pt * (1 + 1e-12)

    @cached_property
    def within(self) -> np.ndarray:
        """Per stage, how many of its ``table``'s entries are at most ``reach``: a plan made from this one by a move
        beats it only where the counts of its rows add up to ``total`` (``Engine.score``)."""
        return (self.table <= self.reach).sum(axis=1)

    @cached_property
    def layers(self) -> tuple[int, ...]:
        """The layer counts behind ``pt`` (computed only for the plans the search keeps)."""
        return () if self.table is None else tuple(int(x) for x in allocate(self.table, self.total)[1])

    @cached_property
    def smooth(self) -> float:
        """What breaks ties between equal integer PTs (computed only for ties): PT with fractional layer counts, or
        for a timed score its ``load``, which falls when any stage gets faster, not only the slowest."""
        if self.curves is None:
            return self.pt if self.load is None else self.load
        return smooth_time(self.pt, self.curves, self.total)

    def better_than(self, other: "Score") -> bool:
        if self.pt < other.pt * (1 - 1e-9):
            return True
        return self.pt <= other.reach and self.smooth < other.smooth * (1 - 1e-9)


INFEASIBLE = Score(float("inf"))


def smooth_time(hi: float, c: Curves, total: int) -> float:
    """Least T at which fractional layer counts (each within [0, cap]) add up to ``total``.

    The sum is piecewise linear in T with breaks where a stage's count leaves 0, reaches its cap, or changes from
    the pipeline to the averaging line; so evaluate it at every break and interpolate.
    """
    ar1 = np.maximum(c.ar1, 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = (c.intercept * ar1 - c.ar0 * c.slope) / (ar1 - c.slope)
    breaks = np.concatenate([c.intercept, c.ar0, c.intercept + c.slope * c.cap, c.ar0 + ar1 * c.cap, cross, [hi]])
    breaks = np.unique(breaks[np.isfinite(breaks) & (breaks >= 0) & (breaks <= hi)])
    fit = np.minimum((breaks[:, None] - c.intercept) / c.slope, (breaks[:, None] - c.ar0) / ar1)
    sums = np.clip(fit, 0, c.cap).sum(axis=1)
    i = int(np.searchsorted(sums, total - 1e-9))
    if i == 0:
        return float(breaks[0])
    if i >= len(breaks):
        return hi
    t0, t1, f0, f1 = breaks[i - 1], breaks[i], sums[i - 1], sums[i]
    return float(t0 + (t1 - t0) * (total - f0) / (f1 - f0))


def timed_time(h: np.ndarray, total: int) -> tuple[float, float]:
    """``best_time`` and the mean of the ``total`` least entries of ``h`` (the times of the layer counts that reach
    PT, roughly), from one partition."""
    if h.shape[0] > total:
        return float("inf"), float("inf")
    least = np.partition(h.ravel(), total - 1)[:total]
    return max(float(h[:, 0].max()), float(least[-1])), float(least.sum() / total)  # `mean`'s sum, less its overhead


def best_time(h: np.ndarray, total: int) -> float:
    """The PT of ``allocate`` alone (the search's hot path needs only this)."""
    return timed_time(h, total)[0]


def allocate(h: np.ndarray, total: int) -> tuple[float, np.ndarray]:
    """Integer layer counts (>= 1 each, summing to ``total``) minimising max_k h[k, L_k - 1].

    ``h[k, l-1]`` is stage k's time with l layers, non-decreasing in l, inf where memory forbids. Exact: PT is the
    larger of the worst one-layer stage and the total-th smallest entry of h; surplus counts are trimmed from the
    top.
    """
    t = best_time(h, total)
    if not np.isfinite(t):
        return t, np.zeros(h.shape[0], dtype=int)
    counts = (h <= t).sum(axis=1)
    excess = int(counts.sum()) - total
    if excess > 0:
        rows, cols = np.nonzero(h[:, 1:] <= t)
        values = h[:, 1:][rows, cols]
        for row in rows[np.argsort(-values, kind="stable")[:excess]]:
            counts[row] -= 1
    return t, counts


@dataclass(frozen=True, kw_only=True)
class Partners:
    """A membership's workers (fs, bs, clients) with, per worker, the latency (``alpha``) and bytes-per-share
    (``link``) terms of its links to the partners it has at compute shares, and the link part of its T_w there
    (``cost.link_times``: the cost those partners minimise)."""

    workers: np.ndarray
    alpha: np.ndarray
    link: np.ndarray
    times: np.ndarray


def partners(net: Network, wl: Workload, group: Group,
             blocks: tuple[np.ndarray, np.ndarray] | None = None) -> Partners:
    """Each worker's best partners at compute shares (``Partners``); ``blocks``: the latency and inverse-bandwidth
    matrices among the workers, where the caller has them. Written for the search's hot path, where stages hold a
    dozen workers and each numpy call costs more than its arithmetic: one cost matrix serves every role."""
    workers = np.array(group.workers, dtype=int)
    lat, inv = blocks if blocks is not None else (block(net.latency, workers, workers),
                                                  block(net.inv_bandwidth, workers, workers))
    a, nf, servers = wl.message_bytes, len(group.fs), len(group.fs) + len(group.bs)
    load = compute_shares(net, workers) * a
    cost = lat + load[:, None] * inv  # row w's link time to each column at w's share
    rows = np.arange(len(workers))
    cols = np.empty(len(workers), dtype=int)  # each server's partner of the other role
    cols[:nf] = cost[:nf, nf:servers].argmin(axis=1) + nf
    cols[nf:servers] = cost[nf:servers, :nf].argmin(axis=1)
    if len(workers) == servers:
        return Partners(workers=workers, alpha=lat[rows, cols], link=a * inv[rows, cols], times=cost[rows, cols])
    clients = rows[servers:]
    inbound = lat[:nf, servers:] + load[None, servers:] * inv[:nf, servers:]  # FS -> client, at the client's share
    f, b = inbound.argmin(axis=0), cost[servers:, nf:servers].argmin(axis=1) + nf
    cols[servers:] = b
    alpha, times = lat[rows, cols], cost[rows, cols]
    alpha[servers:] += lat[f, clients]
    times[servers:] += inbound[f, clients - servers]
    inverse = inv[rows, cols]
    inverse[servers:] += inv[f, clients]
    return Partners(workers=workers, alpha=alpha, link=a * inverse, times=times)


def water_level(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """For each row of ``beta`` (one per layer count): the least level T with Σ max(0, (T-α)/β) >= 1 and T >= every
    α (a worker's latency counts even with few rows). At T >= max α every term is positive, so the sum is linear in
    T: T = max(max α, (1 + Σ α/β) / Σ 1/β)."""
    inverse = 1.0 / beta
    return np.maximum(alpha.max(), (1.0 + (alpha[None, :] * inverse).sum(axis=1)) / inverse.sum(axis=1))


def water_fill(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``water_level`` and the shares at that level."""
    level = water_level(alpha, beta)
    shares = np.maximum(0.0, (level[:, None] - alpha[None, :]) * (1.0 / beta))
    return level, shares / shares.sum(axis=1, keepdims=True)


class Engine:
    """Caches stage statistics and scores memberships for one network and workload."""

    def __init__(self, net: Network, wl: Workload, reliable: np.ndarray):
        self.net, self.wl = net, wl
        self.reliable = np.asarray(reliable, dtype=bool)
        self.layers = wl.model.layers
        self._stats: dict[Group, GroupStats] = {}
        self.scored = 0  # plans scored so far: the searches' budgets count these, not seconds
        self._boundary: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
        a = net.latency + wl.message_bytes * net.inv_bandwidth
        self.delay = (a + a.T) / 2  # the paper's edge label, one way: a + A/b averaged over both directions
        self.steps = np.arange(1, self.layers + 1, dtype=float)
        self._step_flops = self.steps * (wl.microbatch_tokens * wl.model.flops_per_token_per_layer)  # 1..L layers
        self.held = Held.of(wl.model) if wl.model.shared else None
        self._rounds: dict[tuple[Group, ...], float] = {}
        self._levels: dict[Group, np.ndarray] = {}
        self._floors: dict[Group, np.ndarray] = {}
        self._partners: dict[Group, Partners] = {}  # computed by `stats`, not yet taken by `levels`
        self._rows: dict[tuple[Group | None, Group, Group | None], np.ndarray] = {}
        self._last: tuple[tuple[Group, ...], np.ndarray] = ((), np.empty((0, self.layers)))  # ``_timed_table``
        self._closest: dict[int, np.ndarray] = {}
        self._near: dict[Group, np.ndarray] = {}
        self.by_speed = [int(x) for x in np.argsort(-net.flops, kind="stable")]  # every device, the fastest first

    def stats(self, group: Group) -> GroupStats:
        cached = self._stats.get(group)
        if cached is not None:
            return cached
        _make_room(self._stats)
        net, wl = self.net, self.wl
        workers = np.array(group.workers, dtype=int)
        lat, inv = block(net.latency, workers, workers), block(net.inv_bandwidth, workers, workers)
        linked = partners(net, wl, group, (lat, inv))
        _make_room(self._partners, PENDING)
        self._partners[group] = linked
        links, n = linked.times, len(workers)
        # one argmax each, the maxima read at it: the calls, not their arithmetic, cost on stages this small
        slowest, i, u = int(links.argmax()), int(lat.argmax()), int(inv.argmax())
        weakest = int(net.memory[workers].argmin())
        a_max, inv_max = float(lat.flat[i]), float(inv.flat[u])
        ar_fixed = 2 * (n - 1) * a_max / wl.average_every  # `cost.averaging_time`'s parts
        ar_per_byte = 2 * (n - 1) / n * inv_max / wl.average_every if n > 1 else 0.0
        memory = float(net.memory[workers[weakest]])
        stats = GroupStats(
            comm=float(links[slowest]), speed=float(net.flops[workers].sum()), ar_fixed=ar_fixed,
            ar_per_byte=ar_per_byte, ar_per_layer=ar_per_byte * wl.model.param_bytes_per_layer,
            memory=memory, cap=int(np.floor(memory / wl.model.memory_bytes_per_layer)),
            worst=int(workers[slowest]),
            far=(int(workers[i // n]), int(workers[i % n]), int(workers[u // n]), int(workers[u % n])),
            weakest=int(workers[weakest]))
        self._stats[group] = stats
        return stats

    def boundary(self, prev: Group, nxt: Group) -> float:
        key = (prev.bs, nxt.fs)
        cached = self._boundary.get(key)
        if cached is None:
            bs, fs = np.array(prev.bs), np.array(nxt.fs)
            a = block(self.net.latency, bs, fs) + self.wl.message_bytes * block(self.net.inv_bandwidth, bs, fs)
            _make_room(self._boundary)
            cached = self._boundary[key] = float(a.sum() / a.size)
        return cached

    def curves(self, groups: Sequence[Group]) -> Curves:
        stats = [self.stats(g) for g in groups]
        edges = [0.0] + [self.boundary(a, b) for a, b in zip(groups, groups[1:])] + [0.0]
        d, wl = self.wl.microbatches, self.wl
        intercept = np.array([d * (edges[k] + edges[k + 1] + s.comm) for k, s in enumerate(stats)])
        slope = np.array([d * wl.microbatch_tokens * wl.model.flops_per_token_per_layer / s.speed for s in stats])
        ar0 = np.array([s.ar_fixed for s in stats])
        ar1 = np.array([s.ar_per_layer for s in stats])
        cap = np.array([s.cap for s in stats])
        if self.held is None:
            return Curves(intercept, slope, ar0, ar1, cap)
        rows, cap = self.averaging(groups)
        return Curves(intercept, slope, rows[:, 0] - ar1, ar1, cap, rows)

    def averaging(self, groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray]:
        """Per stage: AR_k for l = 1..L layers (a stages x L array) and the most layers that fit, what the stage's
        shared tensors (module doc) included."""
        wl, steps, count = self.wl, self.steps, len(groups)
        stats = [self.stats(g) for g in groups]
        across = np.zeros(count)
        for may, nbytes in holders(wl.model, count):
            key = tuple(groups[k] for k in may)
            time = self._rounds.get(key)
            if time is None:
                workers = np.array([w for g in key for w in g.workers], dtype=int)
                _make_room(self._rounds)
                time = self._rounds[key] = round_time(self.net, wl, workers, nbytes)
            across[list(may)] += time
        rows, caps = np.empty((count, self.layers)), np.empty(count, dtype=int)
        for k, st in enumerate(stats):
            held = self.held.place(k, count) if self.held is not None else np.zeros((self.layers, 2))
            rows[k] = st.ar_fixed + st.ar_per_byte * (steps * wl.model.param_bytes_per_layer + held[:, 0]) + across[k]
            caps[k] = int((steps * wl.model.memory_bytes_per_layer + held[:, 1] <= st.memory).sum())
        return rows, caps

    def _beta(self, linked: Partners) -> np.ndarray:
        """Each worker's seconds per row share (one row per layer count): its bytes-per-share and compute terms."""
        return linked.link[None, :] + self._step_flops[:, None] / self.net.flops[linked.workers][None, :]

    def levels(self, group: Group) -> np.ndarray:
        """DT_k of a membership for 1..L layers with its row shares set by time (``water_level``)."""
        cached = self._levels.get(group)
        if cached is None:
            linked = self._partners.pop(group, None) or partners(self.net, self.wl, group)
            _make_room(self._levels)
            cached = self._levels[group] = water_level(linked.alpha, self._beta(linked))
        return cached

    def shares(self, group: Group, layers: int) -> np.ndarray:
        """The row shares behind ``levels(group)[layers - 1]`` (only the final plan needs them: not cached)."""
        linked = partners(self.net, self.wl, group)
        return water_fill(linked.alpha, self._beta(linked))[1][layers - 1]

    def _floor(self, group: Group) -> np.ndarray:
        """A stage's averaging time for 1..L layers, inf beyond its memory: the least its timed row can be, whoever
        its neighbours (``_timed_row`` asks it once per pair of them)."""
        floor = self._floors.get(group)
        if floor is None:
            st = self.stats(group)
            floor = st.ar_fixed + st.ar_per_layer * self.steps
            floor[st.cap:] = np.inf
            _make_room(self._floors)
            self._floors[group] = floor
        return floor

    def _timed_row(self, prev: Group | None, group: Group, nxt: Group | None) -> np.ndarray:
        """A stage's times for 1..L layers with time-set shares (inf beyond its memory), given its neighbours: all
        a timed score needs of it when no shared tensors tie it to other stages, so a move rescores only the
        stages it touches and their neighbours."""
        key = (prev, group, nxt)
        row = self._rows.get(key)
        if row is None:
            _make_room(self._rows)
            edges = (self.boundary(prev, group) if prev is not None else 0.0) + \
                (self.boundary(group, nxt) if nxt is not None else 0.0)
            floor = self._floor(group)  # first: its `stats` leaves the partners `levels` takes
            row = self._rows[key] = np.maximum(self.wl.microbatches * (edges + self.levels(group)), floor)
        return row

    def _row_in(self, groups: Sequence[Group], k: int) -> np.ndarray:
        """``_timed_row`` of stage ``k`` between its neighbours in ``groups``."""
        return self._timed_row(groups[k - 1] if k else None, groups[k], groups[k + 1] if k < len(groups) - 1 else None)

    def _timed_table(self, groups: Sequence[Group]) -> np.ndarray | None:
        """The stages' ``_timed_row``s, one per row; None where a stage lacks a server role. A move changes a stage or
        two of the plan it was made from, and the search scores many moves of one plan in turn: so the rows of the
        last table pass on where a stage and its neighbours are the very objects they were there (every row of it
        came from the same cache), and only the others are looked up, which at a dozen stages and more cost more
        than their arithmetic."""
        last, table = self._last
        count = len(groups)
        same = len(last) == count
        kept = [same and g is last[k] for k, g in enumerate(groups)]
        if not all(g.valid for g, k in zip(groups, kept) if not k):  # the last plan's stages were valid
            return None
        kept = [same, *kept, same]  # the ends' missing neighbours are the same
        h = table.copy() if same else np.empty((count, self.layers))
        for k in range(count):
            if not (kept[k] and kept[k + 1] and kept[k + 2]):
                h[k] = self._row_in(groups, k)
        self._last = (tuple(groups), h)
        return h

    def _timed_move(self, groups: Sequence[Group], bar: Score) -> Score:
        """``score(groups, timed=True, bar=bar)`` where ``bar`` scored a plan of as many stages: only the rows of the
        stages that differ from its plan, and of their neighbours where the servers between them differ, are looked
        up, and the plan is rejected by their counts at ``bar.reach`` before its table is built, as most moves of a
        search are."""
        count, reach = len(groups), bar.reach
        changed = [k for k, (group, was) in enumerate(zip(groups, bar.groups)) if group is not was]
        if not all(groups[k].valid for k in changed):
            return INFEASIBLE
        stale = set(changed)
        for k in changed:  # a neighbour's row changes with the edge between them: their BS and FS sets
            if k and groups[k].fs != bar.groups[k].fs:
                stale.add(k - 1)
            if k < count - 1 and groups[k].bs != bar.groups[k].bs:
                stale.add(k + 1)
        within, rows = int(bar.within.sum()), {}
        for k in stale:
            row = rows[k] = self._row_in(groups, k)
            if row[0] > reach:  # PT is at least every stage's one-layer time
                return INFEASIBLE
            within += int(np.searchsorted(row, reach, side="right")) - int(bar.within[k])  # rows never fall
        if within < self.layers:
            return INFEASIBLE
        h = bar.table.copy()
        for k, row in rows.items():
            h[k] = row
        return self._timed_score(groups, h)

    def _timed_score(self, groups: Sequence[Group], h: np.ndarray) -> Score:
        """The timed score of ``groups`` from their table ``h``."""
        pt, load = timed_time(h, self.layers)  # inf where a stage holds no layer or all of them too few
        return Score(pt, None, self.layers, h, load, tuple(groups)) if np.isfinite(pt) else INFEASIBLE

    def score(self, groups: Sequence[Group], *, timed: bool = False, bar: Score | None = None) -> Score:
        """PT of the memberships with their best layer counts, under compute-proportional shares (the contract's)
        or, ``timed``, shares set by time (what the refined plan ends with); the latter scores no ties. ``bar``: a
        score the plan is to beat (``Score.better_than``); a timed plan that cannot may score INFEASIBLE, its
        table not built."""
        self.scored += 1
        if not groups or len(groups) > self.layers:
            return INFEASIBLE
        if timed and self.held is None:
            if bar is not None and bar.groups is not None and len(bar.groups) == len(groups):
                return self._timed_move(groups, bar)
            h = self._timed_table(groups)
            return INFEASIBLE if h is None else self._timed_score(groups, h)
        if not all(g.valid for g in groups):
            return INFEASIBLE
        c = self.curves(groups)
        if c.cap.min() < 1 or c.cap.sum() < self.layers:
            return INFEASIBLE
        steps = self.steps
        ar = c.ar0[:, None] + c.ar1[:, None] * steps if c.averaging is None else c.averaging
        if timed:
            d = self.wl.microbatches
            edges = [0.0] + [self.boundary(a, b) for a, b in zip(groups, groups[1:])] + [0.0]
            pipeline = np.array([d * (edges[k] + edges[k + 1] + self.levels(g)) for k, g in enumerate(groups)])
            h = np.maximum(pipeline, ar)
            h[steps[None, :] > c.cap[:, None]] = np.inf
            pt = best_time(h, self.layers)
            return Score(pt, None, self.layers, h) if np.isfinite(pt) else INFEASIBLE
        h = np.maximum(c.intercept[:, None] + c.slope[:, None] * steps, ar)
        h[steps[None, :] > c.cap[:, None]] = np.inf
        pt = best_time(h, self.layers)
        if not np.isfinite(pt):
            return INFEASIBLE
        return Score(pt, c, self.layers, h)

    def layouts(self, groups: Sequence[Group], score: Score | None = None) -> list[StageLayout]:
        score = score or self.score(groups)
        return [g.layout(n) for g, n in zip(groups, score.layers)]

    # --- local search -------------------------------------------------------------------------------------

    def _nearness(self, group: Group) -> np.ndarray:
        """Mean delay from every device to the stage's servers: cached, as a search asks it of the same stages over
        and over."""
        column = self._near.get(group)
        if column is None:
            _make_room(self._near, max(1, CACHED_VALUES // self.net.size))  # a column is a float per device
            column = self._near[group] = self.delay[:, list(group.servers)].mean(axis=1)
        return column

    def nearness(self, groups: Sequence[Group]) -> np.ndarray:
        """Mean delay from every device to each stage's servers (devices x stages)."""
        return np.stack([self._nearness(g) for g in groups], axis=1)

    def closest(self, device: int) -> np.ndarray:
        """Every device by its delay from ``device``, nearest first (itself first)."""
        order = self._closest.get(device)
        if order is None:
            order = self._closest[device] = np.argsort(self.delay[device], kind="stable")
        return order

    def near(self, groups: Sequence[Group], device: int) -> np.ndarray:
        """One device's row of ``nearness``: what a single move needs, at a stage count's cost, not a swarm's."""
        return np.array([self._nearness(g)[device] for g in groups])

    def targets(self, near: np.ndarray, exclude: int, count: int) -> list[int]:
        """Stages whose servers are closest to a device, given its ``near`` row (the paper's rule for placing
        clients)."""
        row = near.copy()
        if exclude >= 0:
            row[exclude] = np.inf
        return [int(k) for k in np.argsort(row, kind="stable")[:min(count, len(row) - (exclude >= 0))]]

    def relocations(self, groups: list[Group], device: int, home: int, near: np.ndarray,
                    fan: int) -> Iterator[list[Group]]:
        """Plans in which ``device`` leaves stage ``home`` (-1: idle) for idleness, a role flip, or a near stage
        (``near``: its row of ``nearness``)."""
        rest = groups[home].without(device) if home >= 0 else None
        if rest is not None and rest.valid:
            yield groups[:home] + [rest] + groups[home + 1:]
        if rest is not None and self.reliable[device]:
            flipped = rest.adding(device, BS if groups[home].role(device) == FS else FS)
            if flipped.valid:
                yield groups[:home] + [flipped] + groups[home + 1:]
        if rest is not None and not rest.valid:
            return
        for k in self.targets(near, home, fan):
            for role in ((FS, BS) if self.reliable[device] else (CLIENT,)):
                moved = list(groups)
                if rest is not None:
                    moved[home] = rest
                moved[k] = groups[k].adding(device, role)
                yield moved

    def neighbours(self, groups: list[Group], rng: np.random.Generator, fan: int, sample: int,
                   swaps: bool = False) -> Iterator[list[Group]]:
        """Moves of the devices that bind each stage (slowest link, farthest pair, least memory), of a few random
        and a few idle devices, and swaps of adjacent stages; with ``swaps``, also trades of a placed device with
        one of a near stage; in random order."""
        home = {x: k for k, g in enumerate(groups) for x in g.workers}
        idle = [x for x in range(self.net.size) if x not in home]
        movers: dict[int, int] = {}
        for k, g in enumerate(groups):
            st = self.stats(g)
            for x in (st.worst, *st.far, st.weakest):
                movers[x] = k
        placed = list(home)
        for x in rng.choice(placed, size=min(sample, len(placed)), replace=False):
            movers[int(x)] = home[int(x)]
        if idle:
            strong = self.idle(groups)[:sample]
            drawn = rng.choice(np.asarray(idle), size=min(sample, len(idle)), replace=False)
            for x in [*strong, *(int(v) for v in drawn)]:
                movers[x] = -1
        moves: list[tuple[int, int]] = [(x, k) for x, k in movers.items()] + \
            [(-1, k) for k in range(len(groups) - 1)]
        near = self.nearness(groups)
        for i in rng.permutation(len(moves)):
            x, k = moves[i]
            if x < 0:
                yield groups[:k] + [groups[k + 1], groups[k]] + groups[k + 2:]
            else:
                yield from self.relocations(groups, x, k, near[x], fan if k >= 0 else 2)
                if swaps and k >= 0:
                    yield from self.swaps(groups, x, k, near[x], fan, rng)

    def swaps(self, groups: list[Group], device: int, home: int, near: np.ndarray, fan: int,
              rng: np.random.Generator) -> Iterator[list[Group]]:
        """Plans in which ``device`` trades places (and roles) with a device of a near stage (``near``: its row of
        ``nearness``): the move that keeps both stages' sizes, which single moves reach only through a worse plan."""
        role = groups[home].role(device)
        for k in self.targets(near, home, fan):
            st = self.stats(groups[k])
            partners = {st.worst, st.weakest, int(rng.choice(groups[k].workers))}
            for other in partners:
                other_role = groups[k].role(other)
                if (other_role != CLIENT and not self.reliable[device]) or \
                        (role != CLIENT and not self.reliable[other]):
                    continue
                moved = list(groups)
                moved[home] = groups[home].without(device).adding(other, role)
                moved[k] = groups[k].without(other).adding(device, other_role)
                yield moved

    def improve(self, groups: list[Group], *, rng: np.random.Generator, rounds: int, budget: int, swaps: bool = False,
                fan: int = 3, sample: int = 6, timed: bool = False) -> tuple[list[Group], Score]:
        """First-improvement local search (scoring as ``score`` does, ``timed`` or not); stops after ``rounds``
        accepted moves, ``budget`` scored neighbours, or when no neighbour is better (a count, not a clock, so the
        result depends only on the seed)."""
        best = self.score(groups, timed=timed)
        for _ in range(rounds):
            for candidate in self.neighbours(groups, rng, fan, sample, swaps):
                budget -= 1
                s = self.score(candidate, timed=timed, bar=best)
                if s.better_than(best):
                    groups, best = candidate, s
                    break
                if budget <= 0:
                    return groups, best
            else:
                break
        return groups, best

    def idle(self, groups: Sequence[Group]) -> list[int]:
        """Every device in no stage, the fastest first."""
        placed = {x for g in groups for x in g.workers}
        return [x for x in self.by_speed if x not in placed]

    def admit(self, groups: list[Group], devices: Iterable[int], *, timed: bool,
              fan: int = 2) -> tuple[list[Group], Score]:
        """Greedy: each idle device of ``devices`` in turn joins whichever of its ``fan`` nearest stages, in whichever
        role it may take (a server's or a client's where it is reliable, a client's otherwise), lowers the score
        (``timed`` or not) most, else stays idle; the plan and its score."""
        best = self.score(groups, timed=timed)
        for device in devices:
            choice = None
            for k in self.targets(self.near(groups, device), -1, fan):
                for role in (FS, BS, CLIENT) if self.reliable[device] else (CLIENT,):
                    moved = list(groups)
                    moved[k] = groups[k].adding(device, role)
                    score = self.score(moved, timed=timed, bar=best)
                    if score.better_than(best):
                        choice, best = moved, score
            if choice is not None:
                groups = choice
        return groups, best
