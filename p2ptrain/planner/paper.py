"""The paper's planner (§3.3.3), step by step, with the one adaptation memory forces.

1. Divisive hierarchical clustering of the reliable devices on the communication graph (edge label: the delay
   a + A/b averaged over both directions). Each level splits the cluster with the largest mean internal delay in
   two: a spectral (Fiedler vector) sweep cut minimising the normalised cut, refined by networkx's Kernighan-Lin
   bisection. Clusters keep at least two devices (one FS, one BS).
2. Stopping rule, Eq. 2 with Eq. 3: ``PT_p = d·(max_k (C_k + C_{k+1}) + m·L·f / (p·Σ c_s))`` with the clusters
   ordered as below; the first level whose PT_p exceeds the previous one's ends the search, the previous wins.
3. Order: open travelling-salesman path over the coarse graph (mean delay between clusters), by networkx's
   simulated annealing; the path is closed through a dummy node with free edges.
4. FS/BS: each device joins the side (previous or next stage) with the smaller mean delay; a stage with an empty
   side gets its slowest device from the other.
5. Clients: each to the stage whose servers have the smallest mean delay.
6. Layers in proportion to each stage's total compute.
Adaptation: the paper ignores memory. Layers go in proportion to compute but never above what a stage's servers
hold, clients that cannot hold their stage's layers stay idle, and if the servers cannot hold the model at the
chosen level the clustering goes on splitting until they can.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
from networkx.algorithms.approximation import simulated_annealing_tsp
from networkx.algorithms.community import kernighan_lin_bisection

from p2ptrain.planner.cost import layers_that_fit
from p2ptrain.planner.search import Engine, Group

KL_LIMIT = 96  # Kernighan-Lin in pure Python is quadratic per pass; bigger clusters keep the spectral cut


@dataclass(frozen=True, kw_only=True)
class PaperResult:
    groups: list[Group]
    layers: list[int]
    levels: list[list[np.ndarray]]   # the clustering at every level computed, levels[p-1] has p clusters
    chosen: int                      # K from the stopping rule (before the memory adaptation)


EIGEN_TIE = 1e-8  # normalised-Laplacian eigenvalues lie in [0, 2]; kernels differ near 1e-15


def fiedler_vector(laplacian: np.ndarray) -> np.ndarray:
    """The Laplacian's second eigenvector, the same on every machine.

    LAPACK kernels (OpenBLAS picks one per CPU) return it with either sign and last bits of their own, and where
    the second eigenvalue is repeated (devices of one site are alike) any vector of its eigenspace; sorting that
    put the cut, and every plan after it, where the kernel chose. So the eigenspace's projection of a fixed ramp
    is taken, rounded, with the sign that makes its first non-zero entry positive."""
    values, vectors = np.linalg.eigh(laplacian)
    space = vectors[:, np.abs(values - values[1]) <= EIGEN_TIE]
    vector = space @ (space.T @ np.arange(len(laplacian), dtype=float))
    if np.abs(vector).max() <= EIGEN_TIE:
        vector = vectors[:, 1]
    rounded = np.round(vector / np.abs(vector).max(), 9)
    first = np.flatnonzero(rounded)
    return -rounded if len(first) and rounded[first[0]] < 0 else rounded


def spectral_bisection(delay: np.ndarray, members: np.ndarray, seed: int,
                       even: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Split ``members`` in two parts of >= 2 devices (of even sizes if ``even``) with a small normalised cut of
    the 1/delay similarity."""
    sub = delay[np.ix_(members, members)]
    with np.errstate(divide="ignore"):
        w = 1.0 / np.maximum(sub, 1e-12)
    np.fill_diagonal(w, 0.0)
    w /= w.max()
    degree = w.sum(axis=1)
    scale = 1.0 / np.sqrt(degree)
    laplacian = np.eye(len(members)) - scale[:, None] * w * scale[None, :]
    order = np.argsort(np.round(fiedler_vector(laplacian) * scale, 9), kind="stable")
    wp = w[np.ix_(order, order)]
    inner = wp.cumsum(axis=0).cumsum(axis=1).diagonal()
    volume = degree[order].cumsum()
    total = volume[-1]
    cut = volume - inner
    sizes = np.arange(1, len(members) + 1)
    ok = (sizes >= 2) & (sizes <= len(members) - 2) & ((sizes % 2 == 0) | (not even))
    with np.errstate(divide="ignore", invalid="ignore"):
        ncut = np.where(ok, cut / volume + cut / (total - volume), np.inf)
    split = int(np.argmin(ncut)) + 1
    left, right = members[order[:split]], members[order[split:]]
    if len(members) <= KL_LIMIT:
        graph = nx.Graph()
        graph.add_weighted_edges_from((int(members[i]), int(members[j]), float(w[i, j]))
                                      for i in range(len(members)) for j in range(i + 1, len(members)))
        # Kernighan-Lin swaps pairs, so the sizes of the spectral cut are kept
        a, b = kernighan_lin_bisection(graph, partition=({int(x) for x in left}, {int(x) for x in right}),
                                       weight="weight", seed=seed)
        if len(a) >= 2 and len(b) >= 2:
            left, right = np.array(sorted(a)), np.array(sorted(b))
    return left, right


def divisive_levels(engine: Engine, reliable: np.ndarray, max_clusters: int, seed: int,
                    reach: bool = False) -> list[list[np.ndarray]]:
    """Clusterings with 1, 2, ... clusters; each level splits the cluster with the largest mean internal delay.

    Clusters need two devices each, so splitting an even cluster into two odd halves loses room for a stage; with
    ``reach`` (a forced stage count) such splits are ruled out while they would make ``max_clusters`` unreachable.
    """
    clusters = [np.asarray(reliable, dtype=int)]
    levels = [clusters]
    while len(clusters) < max_clusters:
        splittable = [i for i, c in enumerate(clusters) if len(c) >= 4]
        if not splittable:
            break
        spread = [(float(engine.delay[np.ix_(clusters[i], clusters[i])].mean()), len(clusters[i]), -i)
                  for i in splittable]
        target = -max(spread)[2]
        room = sum(len(c) // 2 for c in clusters)
        even = reach and len(clusters[target]) % 2 == 0 and room - 1 < max_clusters
        left, right = spectral_bisection(engine.delay, clusters[target], seed + len(levels), even)
        clusters = clusters[:target] + [left, right] + clusters[target + 1:]
        levels.append(clusters)
    return levels


def coarse_delay(engine: Engine, clusters: list[np.ndarray]) -> np.ndarray:
    p = len(clusters)
    out = np.zeros((p, p))
    for i in range(p):
        for j in range(i + 1, p):
            out[i, j] = out[j, i] = float(engine.delay[np.ix_(clusters[i], clusters[j])].mean())
    return out


def open_path(weights: np.ndarray, seed: int) -> list[int]:
    """An open travelling-salesman path through all nodes, by simulated annealing over a dummy-closed cycle."""
    p = len(weights)
    if p <= 2:
        return list(range(p))
    graph = nx.complete_graph(p)
    for i, j in graph.edges:
        graph[i][j]["weight"] = float(weights[i, j])
    dummy = p
    graph.add_weighted_edges_from((dummy, i, 0.0) for i in range(p))
    cycle = simulated_annealing_tsp(graph, "greedy", weight="weight", source=dummy, seed=seed)
    return [node for node in cycle[1:-1]]


def stopping_estimate(engine: Engine, clusters: list[np.ndarray], order: list[int]) -> float:
    """Eq. 2 with Eq. 3's DT_k: d·(max_k (C_k + C_{k+1}) + m·L·f / (p·Σ c_s))."""
    wl, net = engine.wl, engine.net
    coarse = coarse_delay(engine, clusters)
    edges = [0.0] + [coarse[a, b] for a, b in zip(order, order[1:])] + [0.0]
    p = len(clusters)
    reliable_speed = sum(float(net.flops[c].sum()) for c in clusters)
    dt = wl.microbatch_tokens * wl.model.layers * wl.model.flops_per_token_per_layer / (p * reliable_speed)
    return wl.microbatches * (max(edges[k] + edges[k + 1] for k in range(p)) + dt)


def split_roles(engine: Engine, ordered: list[np.ndarray]) -> list[Group]:
    """FS if the previous stage is nearer on average, else BS; an empty side takes the slowest of the other."""
    groups = []
    flops = engine.net.flops
    for k, members in enumerate(ordered):
        prev = engine.delay[np.ix_(members, ordered[k - 1])].mean(axis=1) if k > 0 else None
        nxt = engine.delay[np.ix_(members, ordered[k + 1])].mean(axis=1) if k + 1 < len(ordered) else None
        if prev is None and nxt is None:
            ranked = members[np.argsort(-flops[members], kind="stable")]
            fs, bs = list(ranked[0::2]), list(ranked[1::2])
        else:
            prev = np.full(len(members), np.inf) if prev is None else prev
            nxt = np.full(len(members), np.inf) if nxt is None else nxt
            fs = [int(x) for x, a, b in zip(members, prev, nxt) if a < b]
            bs = [int(x) for x, a, b in zip(members, prev, nxt) if a >= b]
        if not fs:
            slowest = min(bs, key=lambda x: flops[x])
            bs.remove(slowest)
            fs.append(slowest)
        if not bs:
            slowest = min(fs, key=lambda x: flops[x])
            fs.remove(slowest)
            bs.append(slowest)
        groups.append(Group.of(fs, bs))
    return groups


def order_clusters(engine: Engine, clusters: list[np.ndarray], seed: int) -> list[np.ndarray]:
    return [clusters[i] for i in open_path(coarse_delay(engine, clusters), seed)]


def proportional_layers(speeds: np.ndarray, caps: np.ndarray, total: int) -> list[int] | None:
    """Layers in proportion to compute, at least one and at most ``caps[k]`` each (largest remainders)."""
    k = len(speeds)
    if k > total or caps.min() < 1 or caps.sum() < total:
        return None
    layers = np.ones(k, dtype=int)
    for _ in range(total):
        if layers.sum() == total:
            break
        open_ = layers < caps
        share = np.where(open_, speeds, 0.0)
        target = share / share.sum() * (total - layers[~open_].sum())
        gap = np.where(open_, target - layers, -np.inf)
        layers[int(np.argmax(gap))] += 1
    return [int(x) for x in layers]


def place_clients(engine: Engine, groups: list[Group], clients: np.ndarray) -> list[Group]:
    """Each client to the stage whose servers are nearest on average (paper §3.3.3)."""
    parts = [list(g.clients) for g in groups]
    near = engine.nearness(groups)
    for u in clients:
        parts[int(np.argmin(near[u]))].append(int(u))
    return [Group.of(g.fs, g.bs, c) for g, c in zip(groups, parts)]


def fit_memory(engine: Engine, groups: list[Group]) -> tuple[list[Group], list[int]] | None:
    """Proportional layers within the servers' memory; clients that cannot hold them are dropped (idle)."""
    wl, net = engine.wl, engine.net
    fit = layers_that_fit(net.memory, wl.model)
    server_caps = np.array([int(fit[list(g.servers)].min()) for g in groups])
    speeds = np.array([net.flops[list(g.workers)].sum() for g in groups])
    layers = proportional_layers(speeds, server_caps, wl.model.layers)
    if layers is None:
        return None
    kept = [Group.of(g.fs, g.bs, [u for u in g.clients if fit[u] >= n]) for g, n in zip(groups, layers)]
    return kept, layers


def paper_plan(engine: Engine, *, seed: int = 0, stages: int | None = None) -> PaperResult | None:
    """The paper's plan; ``stages`` skips the stopping rule and takes that level. None if no level fits memory."""
    reliable = np.flatnonzero(engine.reliable)
    clients = np.flatnonzero(~engine.reliable)
    most = min(len(reliable) // 2, engine.layers)
    levels = divisive_levels(engine, reliable, most if stages is None else stages, seed, reach=stages is not None)
    if stages is not None:
        chosen = min(stages, len(levels))
    else:
        chosen, previous = 1, float("inf")
        for p, clusters in enumerate(levels, start=1):
            ordered = open_path(coarse_delay(engine, clusters), seed)
            estimate = stopping_estimate(engine, clusters, ordered)
            if estimate > previous:
                break
            chosen, previous = p, estimate
    for p in range(chosen, len(levels) + 1):
        if stages is not None and p != stages:
            break
        groups = split_roles(engine, order_clusters(engine, levels[p - 1], seed))
        fitted = fit_memory(engine, place_clients(engine, groups, clients))
        if fitted is not None:
            return PaperResult(groups=fitted[0], layers=fitted[1], levels=levels, chosen=chosen)
    return None
