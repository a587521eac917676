"""Searches that end otherwise in the calling process than in the planner's spawned ones, to test which plan
``planner.portfolio`` keeps; a module of their own (light to import), as a spawned process imports them by name."""
from __future__ import annotations

import multiprocessing
from typing import Any

from p2ptrain.planner import Plan, PlanningError, make_plan


def random_here(**kwargs: Any) -> Plan:
    """``make_plan`` in a spawned search; in the calling process a random plan of one sample (a search that ends
    worse)."""
    if multiprocessing.parent_process() is not None:
        return make_plan(**kwargs)
    return make_plan(**{**kwargs, "planner": "random", "random_samples": 1})


def none_here(**kwargs: Any) -> Plan:
    """``make_plan`` in a spawned search; in the calling process no plan."""
    if multiprocessing.parent_process() is not None:
        return make_plan(**kwargs)
    raise PlanningError("no plan here")
