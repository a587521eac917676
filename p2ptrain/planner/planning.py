"""One seed's planning (``make_plan`` on one core), kept between runs of the refined planner's anytime phase, so that
a portfolio's heat goes on from where it stopped (``portfolio``)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

from threadpoolctl import threadpool_limits

from p2ptrain.planner.anytime import Anytime
from p2ptrain.planner.baselines import dtfm_layouts, random_layouts, swarm_layouts
from p2ptrain.planner.cost import StageLayout, Workload
from p2ptrain.planner.paper import paper_plan
from p2ptrain.planner.presets import ModelSpec
from p2ptrain.planner.records import Plan, PlanningError, build_plan
from p2ptrain.planner.refine import SEARCH_SHARE, SEARCHES, RefinedSearch, better
from p2ptrain.planner.search import Engine, Group
from p2ptrain.planner.swarmfile import Swarm


class Budget(NamedTuple):
    """What the refined search asks of its time budget (``budget``)."""

    out_of_time: Callable[[], bool]  # whether it is spent
    may_search: Callable[[], bool]  # whether its first ``SEARCH_SHARE`` lasts (``refine``)
    time_left: Callable[[], float]  # seconds


def budget(clock: Callable[[], float], start: float, end: float) -> Budget:
    """The budget from ``start`` to ``end`` on ``clock``."""
    return Budget(out_of_time=lambda: clock() >= end, may_search=lambda: clock() < start + SEARCH_SHARE * (end - start),
                  time_left=lambda: end - clock())


UNBOUNDED = Budget(out_of_time=lambda: False, may_search=lambda: True, time_left=lambda: math.inf)  # a replay's
RANDOM_SAMPLES = 2000  # the random baseline's plans


class Planning:
    """``planner``'s plan for one seed: made up to the refined planner's anytime phase when constructed, which each
    ``run`` goes on with (``refine.RefinedSearch``); ``plan`` is the plan so far. One BLAS thread throughout
    (``make_plan``). ``limit``: the refined planner's budget, where it has one (``UNBOUNDED`` where rounds bound it).
    """

    def __init__(self, swarm: Swarm, model: ModelSpec, *, batch_tokens: int, microbatches: int, seed: int,
                 planner: str = "refined", stages: int | None = None, random_samples: int = RANDOM_SAMPLES,
                 average_every: int = 1, searches: int = SEARCHES, patience: int | None = None,
                 limit: Budget | None = None) -> None:
        self.swarm, self.planner, self.seed, self.limit = swarm, planner, seed, limit
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
                    self.refined = RefinedSearch(
                        self.engine, paper, seed=seed, stages=stages, anytime=limit is not None,
                        anytime_patience=patience, searches=searches, out_of_time=(limit or UNBOUNDED).out_of_time,
                        may_search=None if limit is None else limit.may_search,
                        time_left=None if limit is None else limit.time_left)
            elif stages is not None:
                raise ValueError(f"--stages applies to the paper and refined planners, not {planner}")
            elif planner == "random":
                self.layouts = random_layouts(self.engine, samples=random_samples, seed=seed)[0]
            elif planner == "swarm":
                self.layouts = swarm_layouts(self.engine)
            else:
                self.layouts = dtfm_layouts(self.engine, seed=seed)

    def run(self, *, out_of_time: Callable[[], bool] | None = None, max_rounds: int | None = None) -> None:
        """The refined planner's anytime rounds until ``out_of_time()`` (default: the budget's end) or ``max_rounds``
        in all (none for the other planners, or without a budget)."""
        if self.refined is not None and self.limit is not None:
            with threadpool_limits(limits=1, user_api="blas"):
                self.refined.run(out_of_time=out_of_time or self.limit.out_of_time, max_rounds=max_rounds)

    @property
    def _phase(self) -> Anytime | None:
        """The refined planner's anytime phase, where there is one."""
        return None if self.refined is None else self.refined.phase

    @property
    def best(self) -> tuple[float, list[Group], int] | None:
        """The refined planner's anytime phase's best plan so far: its PT, its stages and the rounds run; None where
        there is no such phase."""
        phase = self._phase
        return None if phase is None else (phase.best_score.pt, phase.best, phase.rounds)

    def adopt(self, groups: list[Group], *, seed: int, rounds: int) -> bool:
        """The anytime phase goes on from ``groups``, another search's best plan (of ``seed`` after ``rounds``
        rounds), where it is better than its own (``Anytime.adopt``); whether it was."""
        phase = self._phase
        if phase is None:
            return False
        with threadpool_limits(limits=1, user_api="blas"):
            return phase.adopt(groups, seed=seed, rounds=rounds)

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
