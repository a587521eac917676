"""Row shares and layer counts by time: the last step of the refined planner.

Under the contract's compute-proportional shares every worker of a stage computes equally long, so a worker with
a slow link sets DT_k. Giving it fewer rows (and its fast peers more) equalises T_w instead; with each worker's
partner servers fixed, T_w = alpha_w + p_w·beta_w is linear in its share, and the shares that minimise the max
fill up to a common water level. The runtime's pull-based task pool ends near this split on its own.
"""
from __future__ import annotations

from p2ptrain.planner.cost import StageLayout
from p2ptrain.planner.search import Engine, Group, allocate


def timed_layouts(engine: Engine, groups: list[Group]) -> list[StageLayout] | None:
    """Layer counts and shares minimising PT for fixed memberships, or None if they cannot hold the model."""
    score = engine.score(groups, timed=True)
    if score.table is None:
        return None
    _, counts = allocate(score.table, engine.layers)
    return [g.layout(int(c), engine.shares(g, int(c))) for g, c in zip(groups, counts)]
