"""Baseline planners, each scored with the same cost model (``cost.evaluate``).

- ``random_layouts``: best of N random valid plans. A plan draws K uniformly from the feasible range, deals the
  reliable devices into K stages of >= 2 at random cut points, splits each into FS and BS at a random point, sends
  every client to a random stage, and spreads the layers at random (one at a time into a stage with memory to
  spare). Clients that cannot hold their stage's layers are idle; a draw whose servers cannot hold the model is
  discarded and does not count.
- ``swarm_layouts``: SWARM's layout: equal layers, devices dealt evenly (reliable and unreliable separately, in
  snake order of compute so every stage gets the same compute); the stage count with the lowest PT.
- ``dtfm_layouts``: DT-FM's hybrid genetic scheduler (Yuan et al. 2022, §3) on its own communication-only
  objective: balanced partitions (here balanced in reliable and in unreliable devices, so every stage can have an
  FS and a BS), crossover by swapping nodes between parents, its local search over the fastest intra-group links,
  the data-parallel cost of Eq. 2 plus the open-loop TSP over bottleneck matchings of Eq. 3-4. Layers are equal,
  as DT-FM assumes; FS/BS follow the paper's rule. DT-FM picks the pipeline degree from memory; here the degrees
  it can hold are each searched and the one with the lowest PT under the shared cost model is kept, which can
  only help it.
"""
from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from p2ptrain.planner.cost import StageLayout, evaluate, layers_that_fit
from p2ptrain.planner.paper import open_path, split_roles
from p2ptrain.planner.search import Engine, Group


def _caps(engine: Engine, members: np.ndarray) -> int:
    return int(layers_that_fit(engine.net.memory[members].min(), engine.wl.model))


def _with_clients(engine: Engine, groups: list[Group], layers: list[int]) -> list[StageLayout]:
    """Layouts, leaving idle every client that cannot hold its stage's layers."""
    fit = layers_that_fit(engine.net.memory, engine.wl.model)
    return [Group.of(g.fs, g.bs, [u for u in g.clients if fit[u] >= n]).layout(n) for g, n in zip(groups, layers)]


def random_layout(engine: Engine, rng: np.random.Generator) -> list[StageLayout] | None:
    reliable = rng.permutation(np.flatnonzero(engine.reliable))
    clients = np.flatnonzero(~engine.reliable)
    total = engine.layers
    k = int(rng.integers(1, min(len(reliable) // 2, total) + 1))
    spare = len(reliable) - 2 * k
    cuts = np.sort(rng.integers(0, spare + 1, size=k - 1))
    sizes = 2 + np.diff(np.concatenate([[0], cuts, [spare]]))
    parts = np.split(reliable, np.cumsum(sizes)[:-1])
    caps = np.array([_caps(engine, p) for p in parts])
    if caps.min() < 1 or caps.sum() < total:
        return None
    layers = np.ones(k, dtype=int)
    for _ in range(total - k):
        room = np.flatnonzero(layers < caps)
        layers[rng.choice(room)] += 1
    home = rng.integers(0, k, size=len(clients))
    groups = []
    for i, p in enumerate(parts):
        cut = int(rng.integers(1, len(p)))
        groups.append(Group.of(p[:cut], p[cut:], clients[home == i]))
    return _with_clients(engine, groups, [int(x) for x in layers])


def random_layouts(engine: Engine, *, samples: int, seed: int) -> tuple[list[StageLayout] | None, int]:
    """Best of ``samples`` random valid plans, and how many valid plans were drawn."""
    rng = np.random.default_rng(seed)
    best, best_pt, drawn = None, float("inf"), 0
    for _ in range(samples * 20):
        if drawn == samples:
            break
        layout = random_layout(engine, rng)
        if layout is None:
            continue
        drawn += 1
        pt = evaluate(engine.net, engine.wl, layout).batch_time_s
        if pt < best_pt:
            best, best_pt = layout, pt
    return best, drawn


def _snake(items: np.ndarray, k: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(k)]
    for i, x in enumerate(items):
        lap, pos = divmod(i, k)
        out[pos if lap % 2 == 0 else k - 1 - pos].append(int(x))
    return out


def equal_layers(total: int, k: int) -> list[int]:
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


def swarm_groups(engine: Engine, stages: int | None = None) -> list[Group] | None:
    """SWARM's layout at the stage count with the lowest PT (or at ``stages``), as memberships."""
    flops = engine.net.flops
    reliable = np.flatnonzero(engine.reliable)
    clients = np.flatnonzero(~engine.reliable)
    reliable = reliable[np.argsort(-flops[reliable], kind="stable")]
    clients = clients[np.argsort(-flops[clients], kind="stable")]
    best, best_pt = None, float("inf")
    options = range(1, min(len(reliable) // 2, engine.layers) + 1) if stages is None else [stages]
    for k in options:
        servers = _snake(reliable, k)
        layers = equal_layers(engine.layers, k)
        if any(_caps(engine, np.array(s)) < n for s, n in zip(servers, layers)):
            continue
        groups = [Group.of(s[0::2], s[1::2], c) for s, c in zip(servers, _snake(clients, k))]
        layout = _with_clients(engine, groups, layers)
        pt = evaluate(engine.net, engine.wl, layout).batch_time_s
        if pt < best_pt:
            best, best_pt = [Group.of(s.fs, s.bs, s.clients) for s in layout], pt
    return best


def swarm_layouts(engine: Engine) -> list[StageLayout] | None:
    groups = swarm_groups(engine)
    return None if groups is None else _with_clients(engine, groups, equal_layers(engine.layers, len(groups)))


class DTFM:
    """DT-FM's scheduler for one pipeline degree ``k`` over the devices that can hold ceil(L/k) layers."""

    def __init__(self, engine: Engine, k: int, devices: np.ndarray, rng: np.random.Generator):
        self.engine, self.k, self.rng = engine, k, rng
        self.devices = devices
        net, wl = engine.net, engine.wl
        stage_params = wl.model.param_bytes_per_layer * wl.model.layers / k + wl.model.held(0, wl.model.layers)[0]
        # pairwise, before dividing by D_DP; a round every H batches
        self.dp = 2 * (net.latency + stage_params * net.inv_bandwidth) / wl.average_every
        self.dp_lat = 2 * net.latency / wl.average_every
        self.pp = 2 * (net.latency + wl.message_bytes * net.inv_bandwidth)  # pipeline edge weight, Eq. 3
        self.classes = [devices[engine.reliable[devices]], devices[~engine.reliable[devices]]]

    def random_partition(self) -> np.ndarray:
        """Group label per device of ``self.devices``, balanced within each class."""
        label = np.empty(self.engine.net.size, dtype=int)
        for members in self.classes:
            label[self.rng.permutation(members)] = np.arange(len(members)) % self.k
        return label

    def groups(self, label: np.ndarray) -> list[np.ndarray]:
        return [self.devices[label[self.devices] == j] for j in range(self.k)]

    def data_parallel_cost(self, groups: list[np.ndarray]) -> float:
        worst = 0.0
        for g in groups:
            n = len(g)
            lat, dp = self.dp_lat[np.ix_(g, g)], self.dp[np.ix_(g, g)]
            worst = max(worst, float((lat + (dp - lat) / n).sum(axis=1).max()))
        return worst

    def bottleneck_matching(self, a: np.ndarray, b: np.ndarray) -> float:
        """min over matchings saturating the smaller side of the max edge weight (Eq. 3)."""
        w = self.pp[np.ix_(a, b)] if len(a) <= len(b) else self.pp[np.ix_(b, a)]
        values = np.unique(w)
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            match = maximum_bipartite_matching(csr_matrix(w <= values[mid]), perm_type="column")
            if (match >= 0).all():
                hi = mid
            else:
                lo = mid + 1
        return float(values[lo])

    def pipeline_cost(self, groups: list[np.ndarray]) -> tuple[float, list[int]]:
        k = len(groups)
        coarse = np.zeros((k, k))
        for i in range(k):
            for j in range(i + 1, k):
                coarse[i, j] = coarse[j, i] = self.bottleneck_matching(groups[i], groups[j])
        order = open_path(coarse, int(self.rng.integers(1 << 30)))
        return float(sum(coarse[a, b] for a, b in zip(order, order[1:]))), order

    def cost(self, label: np.ndarray) -> tuple[float, list[int]]:
        groups = self.groups(label)
        pipeline, order = self.pipeline_cost(groups)
        return self.data_parallel_cost(groups) + pipeline, order

    def crossover(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Swap nodes between parents: a's labels, with a random half of the devices taking b's, re-balanced."""
        child = a.copy()
        take = self.rng.random(len(self.devices)) < 0.5
        child[self.devices[take]] = b[self.devices[take]]
        for members in self.classes:
            target = np.bincount(np.arange(len(members)) % self.k, minlength=self.k)
            counts = np.bincount(child[members], minlength=self.k)
            for j in np.flatnonzero(counts > target):
                surplus = self.rng.permutation(members[child[members] == j])[:counts[j] - target[j]]
                for x in surplus:
                    short = np.flatnonzero(np.bincount(child[members], minlength=self.k) < target)
                    child[x] = int(self.rng.choice(short))
        return child

    def local_search(self, label: np.ndarray) -> np.ndarray:
        """DT-FM's swaps: the endpoints of each group's fastest internal link, judged by its gain function."""
        w = self.pp
        for i in range(self.k):
            for j in range(i + 1, self.k):
                gi, gj = self.devices[label[self.devices] == i], self.devices[label[self.devices] == j]
                if len(gi) < 2 or len(gj) < 2:
                    continue
                si, sj = w[np.ix_(gi, gi)] + np.diag(np.full(len(gi), np.inf)), \
                    w[np.ix_(gj, gj)] + np.diag(np.full(len(gj), np.inf))
                a1, a2 = np.unravel_index(int(np.argmin(si)), si.shape)
                b1, b2 = np.unravel_index(int(np.argmin(sj)), sj.shape)
                best_gain, best_pair = 0.0, None
                for d, partner in ((gi[a1], gi[a2]), (gi[a2], gi[a1])):
                    for e, e_partner in ((gj[b1], gj[b2]), (gj[b2], gj[b1])):
                        if self.engine.reliable[d] != self.engine.reliable[e]:
                            continue
                        gain = w[d, gj].mean() - w[d, partner] + w[e, gi].mean() - w[e, e_partner]
                        if gain > best_gain:
                            best_gain, best_pair = gain, (d, e)
                if best_pair is not None:
                    d, e = best_pair
                    label[d], label[e] = j, i
        return label

    def search(self, *, population: int, generations: int) -> tuple[list[np.ndarray], float]:
        pool = [self.local_search(self.random_partition()) for _ in range(population)]
        scored = [(self.cost(p), p) for p in pool]
        for _ in range(generations):
            i, j = self.rng.choice(len(scored), size=2, replace=False)
            child = self.local_search(self.crossover(scored[i][1], scored[j][1]))
            child_cost = self.cost(child)
            worst = max(range(len(scored)), key=lambda x: scored[x][0][0])
            if child_cost[0] < scored[worst][0][0]:
                scored[worst] = (child_cost, child)
        (cost, order), label = min(scored, key=lambda item: item[0][0])
        groups = self.groups(label)
        return [groups[o] for o in order], cost


def dtfm_layouts(engine: Engine, *, seed: int, population: int = 10, generations: int = 40,
                 degrees: int = 4) -> list[StageLayout] | None:
    rng = np.random.default_rng(seed)
    total, fit = engine.layers, layers_that_fit(engine.net.memory, engine.wl.model)
    reliable_count = int(engine.reliable.sum())
    feasible = []
    for k in range(1, min(reliable_count // 2, total) + 1):
        devices = np.flatnonzero(fit >= -(-total // k))
        if int(engine.reliable[devices].sum()) >= 2 * k:
            feasible.append((k, devices))
    if not feasible:
        return None
    # the least degree that fits (DT-FM's own choice) and a few larger ones, spread geometrically
    picks = sorted({feasible[min(len(feasible) - 1, (1 << i) - 1)][0] for i in range(degrees)})
    best, best_pt = None, float("inf")
    for k, devices in feasible:
        if k not in picks:
            continue
        ordered, _ = DTFM(engine, k, devices, rng).search(population=population, generations=generations)
        reliable = [g[engine.reliable[g]] for g in ordered]
        roles = split_roles(engine, reliable)
        groups = [Group.of(r.fs, r.bs, g[~engine.reliable[g]]) for r, g in zip(roles, ordered)]
        layout = _with_clients(engine, groups, equal_layers(total, k))
        pt = evaluate(engine.net, engine.wl, layout).batch_time_s
        if pt < best_pt:
            best, best_pt = layout, pt
    return best
