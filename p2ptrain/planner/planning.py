"""One seed's planning (``make_plan`` on one core), kept between runs of the refined planner's anytime phase, so that
a portfolio's heat goes on from where it stopped (``portfolio``)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from threadpoolctl import threadpool_limits

from p2ptrain.planner.baselines import dtfm_layouts, random_layouts, swarm_layouts
from p2ptrain.planner.cost import StageLayout, Workload
from p2ptrain.planner.paper import paper_plan
from p2ptrain.planner.presets import ModelSpec
from p2ptrain.planner.records import Plan, PlanningError, build_plan
from p2ptrain.planner.refine import SEARCH_SHARE, SEARCHES, RefinedSearch, better
from p2ptrain.planner.search import Engine
from p2ptrain.planner.swarmfile import Swarm

Checks = tuple[Callable[[], bool], Callable[[], bool], Callable[[], float]]


def budget_checks(clock: Callable[[], float], start: float, end: float) -> Checks:
    """What the refined search asks of a budget from ``start`` to ``end`` on ``clock``: whether it is spent, whether
    its first ``SEARCH_SHARE`` lasts (``refine``), and the seconds left."""
    return (lambda: clock() >= end, lambda: clock() < start + SEARCH_SHARE * (end - start),
            lambda: end - clock())


UNBOUNDED: Checks = (lambda: False, lambda: True, lambda: math.inf)  # a replay's: its rounds bound it
RANDOM_SAMPLES = 2000  # the random baseline's plans


class Planning:
    """``planner``'s plan for one seed: made up to the refined planner's anytime phase when constructed, which each
    ``run`` goes on with (``refine.RefinedSearch``); ``plan`` is the plan so far. One BLAS thread throughout
    (``make_plan``). ``checks``: the budget's (``budget_checks``), where the refined planner has one."""

    def __init__(self, swarm: Swarm, model: ModelSpec, *, batch_tokens: int, microbatches: int, seed: int,
                 planner: str = "refined", stages: int | None = None, random_samples: int = RANDOM_SAMPLES,
                 average_every: int = 1, searches: int = SEARCHES, patience: int | None = None,
                 checks: Checks | None = None) -> None:
        self.swarm, self.planner, self.seed = swarm, planner, seed
        self.refined: RefinedSearch | None = None
        self.layouts: list[StageLayout] | None = None
        with threadpool_limits(limits=1, user_api="blas"):
            self.net = swarm.network()
            self.engine = Engine(self.net, Workload(model=model, batch_tokens=batch_tokens, microbatches=microbatches,
                                                    average_every=average_every), swarm.reliable)
            if planner in ("paper", "refined"):
                paper = paper_plan(self.engine, seed=seed, stages=stages)
                self.layouts = None if paper is None else [g.layout(n) for g, n in zip(paper.groups, paper.layers)]
                if planner == "refined":
                    out_of_time, may_search, time_left = checks or (None, None, None)
                    self.refined = RefinedSearch(self.engine, paper, seed=seed, stages=stages,
                                                 anytime=checks is not None, out_of_time=out_of_time or UNBOUNDED[0],
                                                 anytime_patience=patience, searches=searches,
                                                 may_search=may_search, time_left=time_left)
            elif stages is not None:
                raise ValueError(f"--stages applies to the paper and refined planners, not {planner}")
            elif planner == "random":
                self.layouts = random_layouts(self.engine, samples=random_samples, seed=seed)[0]
            elif planner == "swarm":
                self.layouts = swarm_layouts(self.engine)
            else:
                self.layouts = dtfm_layouts(self.engine, seed=seed)

    def run(self, *, out_of_time: Callable[[], bool], max_rounds: int | None = None) -> None:
        """The refined planner's anytime rounds until ``out_of_time()`` or ``max_rounds`` in all (none for the other
        planners, or without a budget)."""
        if self.refined is not None:
            with threadpool_limits(limits=1, user_api="blas"):
                self.refined.run(out_of_time=out_of_time, max_rounds=max_rounds)

    def plan(self) -> Plan:
        """The plan so far (the refined planner's: the better of its search's and the paper's); raises
        ``PlanningError`` where none is valid."""
        layouts, search = self.layouts, None
        with threadpool_limits(limits=1, user_api="blas"):
            if self.refined is not None:
                refined, search = self.refined.layouts()
                layouts = better(self.engine, refined, layouts)
            if layouts is None:
                model = self.engine.wl.model
                shared = sum(t.memory_bytes for t in model.shared)
                raise PlanningError(f"the {self.planner} planner found no plan whose servers can hold {model.layers} "
                                    f"layers of {model.memory_bytes_per_layer / 2**30:.3g} GiB each"
                                    + (f" beside {shared / 2**30:.3g} GiB of shared tensors" if shared else ""))
            search = None if search is None else dataclasses.replace(search, seed=self.seed)
            return build_plan(self.swarm.ids, self.net, self.engine.wl, layouts, planner=self.planner,
                              reliable=self.swarm.reliable, search=search)
