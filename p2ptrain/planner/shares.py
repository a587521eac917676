"""Row shares and layer counts by time: the last step of the refined planner.

Under the contract's compute-proportional shares every worker of a stage computes equally long, so a worker with
a slow link sets DT_k. Giving it fewer rows (and its fast peers more) equalises T_w instead; with each worker's
partner servers fixed, T_w = alpha_w + p_w·beta_w is linear in its share, and the shares that minimise the max
fill up to a common water level. The runtime's pull-based task pool ends near this split on its own.
"""
from __future__ import annotations

import numpy as np

from p2ptrain.planner.cost import StageLayout
from p2ptrain.planner.search import Engine, Group, allocate


def timed_layouts(engine: Engine, groups: list[Group]) -> list[StageLayout] | None:
    """Layer counts and shares minimising PT for fixed memberships, or None if they cannot hold the model."""
    d = engine.wl.microbatches
    steps = engine.steps
    edges = [0.0] + [engine.boundary(a, b) for a, b in zip(groups, groups[1:])] + [0.0]
    rows, all_shares = [], []
    averaging, caps = engine.averaging(groups)
    for k, g in enumerate(groups):
        level, shares = engine.levels(g)
        h = np.maximum(d * (edges[k] + edges[k + 1] + level), averaging[k])
        h[steps > caps[k]] = np.inf
        rows.append(h)
        all_shares.append(shares)
    pt, counts = allocate(np.array(rows), engine.layers)
    if not np.isfinite(pt):
        return None
    return [g.layout(int(c), shares[int(c) - 1]) for g, c, shares in zip(groups, counts, all_shares)]
