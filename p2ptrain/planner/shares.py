"""Row shares and layer counts by time: the last step of the refined planner.

Under the contract's compute-proportional shares every worker of a stage computes equally long, so a worker with
a slow link sets DT_k. Giving it fewer rows (and its fast peers more) equalises T_w instead; with each worker's
partner servers fixed, T_w = alpha_w + p_w·beta_w is linear in its share, and the shares that minimise the max
fill up to a common water level. The runtime's pull-based task pool ends near this split on its own.
"""
from __future__ import annotations

import numpy as np

from p2ptrain.planner.cost import StageLayout, compute_shares
from p2ptrain.planner.search import Engine, Group, allocate


def _partners(engine: Engine, group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alpha, per-row link cost, workers): latency and bytes-per-share terms with partners chosen at compute shares."""
    net, a = engine.net, engine.wl.message_bytes
    workers = np.array(group.workers, dtype=int)
    p0 = compute_shares(net, workers)
    fs, bs, clients = (np.array(x, dtype=int) for x in (group.fs, group.bs, group.clients))
    alpha, link = np.zeros(len(workers)), np.zeros(len(workers))
    for start, own, other in ((0, fs, bs), (len(fs), bs, fs)):
        cost = net.latency[np.ix_(own, other)] + (p0[start:start + len(own)] * a)[:, None] * \
            net.inv_bandwidth[np.ix_(own, other)]
        best = other[cost.argmin(axis=1)]
        alpha[start:start + len(own)] = net.latency[own, best]
        link[start:start + len(own)] = a * net.inv_bandwidth[own, best]
    if len(clients):
        start = len(fs) + len(bs)
        pc = p0[start:] * a
        f = fs[(net.latency[np.ix_(fs, clients)] + pc[None, :] * net.inv_bandwidth[np.ix_(fs, clients)]).argmin(0)]
        b = bs[(net.latency[np.ix_(clients, bs)] + pc[:, None] * net.inv_bandwidth[np.ix_(clients, bs)]).argmin(1)]
        alpha[start:] = net.latency[f, clients] + net.latency[clients, b]
        link[start:] = a * (net.inv_bandwidth[f, clients] + net.inv_bandwidth[clients, b])
    return alpha, link, workers


def water_fill(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``beta`` (one per layer count): the least level T with Σ max(0, (T-α)/β) >= 1 (and T >=
    every α, since a worker's latency counts even with few rows), and the shares at that level."""
    lo = np.full(beta.shape[0], alpha.max())
    hi = lo + beta.max(axis=1)
    for _ in range(60):
        mid = (lo + hi) / 2
        enough = np.maximum(0.0, (mid[:, None] - alpha[None, :]) / beta).sum(axis=1) >= 1
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid)
    shares = np.maximum(0.0, (hi[:, None] - alpha[None, :]) / beta)
    return hi, shares / shares.sum(axis=1, keepdims=True)


def timed_layouts(engine: Engine, groups: list[Group]) -> list[StageLayout] | None:
    """Layer counts and shares minimising PT for fixed memberships, or None if they cannot hold the model."""
    wl, d = engine.wl, engine.wl.microbatches
    steps = engine.steps
    per_layer = wl.microbatch_tokens * wl.model.flops_per_token_per_layer
    edges = [0.0] + [engine.boundary(a, b) for a, b in zip(groups, groups[1:])] + [0.0]
    rows, all_shares = [], []
    averaging, caps = engine.averaging(groups)
    for k, g in enumerate(groups):
        alpha, link, workers = _partners(engine, g)
        beta = link[None, :] + steps[:, None] * per_layer / engine.net.flops[workers][None, :]
        level, shares = water_fill(alpha, beta)
        h = np.maximum(d * (edges[k] + edges[k + 1] + level), averaging[k])
        h[steps > caps[k]] = np.inf
        rows.append(h)
        all_shares.append(shares)
    pt, counts = allocate(np.array(rows), engine.layers)
    if not np.isfinite(pt):
        return None
    return [g.layout(int(c), shares[int(c) - 1]) for g, c, shares in zip(groups, counts, all_shares)]
