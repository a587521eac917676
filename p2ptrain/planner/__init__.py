"""Offline planner: swarm files, the docs/design.md §3 cost model, model presets, the paper's planner, its refinement and
the baselines. ``make_plan`` is the entry point the CLI and the runtime share."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from threadpoolctl import threadpool_limits

from p2ptrain.planner.baselines import dtfm_layouts, random_layouts, swarm_layouts
from p2ptrain.planner.cost import Workload
from p2ptrain.planner.paper import paper_plan
from p2ptrain.planner.portfolio import SEARCHES_EACH, default_heats, plan_on_cores
from p2ptrain.planner.presets import ModelSpec, config_spec, model_spec
from p2ptrain.planner.records import Plan, PlanningError, Prediction, StagePlan, build_plan, format_plan
from p2ptrain.planner.refine import SEARCH_SHARE, SEARCHES, better, refined_layouts
from p2ptrain.planner.search import Engine
from p2ptrain.planner.swarmfile import Device, Swarm, SwarmFileError, load_swarm

PLANNERS: tuple[str, ...] = ("paper", "refined", "random", "swarm", "dtfm")
RANDOM_SAMPLES = 2000

__all__ = ["PLANNERS", "Device", "ModelSpec", "Plan", "PlanningError", "Prediction", "StagePlan", "Swarm",
           "SwarmFileError", "config_spec", "format_plan", "load_swarm", "make_plan", "model_spec"]


def make_plan(swarm: Swarm, model: ModelSpec, *, batch_tokens: int, microbatches: int, planner: str = "refined",
              stages: int | None = None, seed: int = 0, random_samples: int = RANDOM_SAMPLES,
              average_every: int = 1, budget_s: float = 0.0, clock: Callable[[], float] | None = None,
              rounds: int | None = None, searches: int | None = None, patience: int | None = None,
              jobs: int = 1, heats: int | None = None) -> Plan:
    """Plan ``swarm`` for ``model``; ``stages`` forces the stage count (paper and refined planners only);
    ``average_every``: the run's rounds come once every that many global batches (`--average-every`); ``budget_s``:
    the refined planner keeps improving its plan until that many seconds of ``clock`` passed since the call (its
    anytime phase; 0: none); ``rounds``: it runs at most that many rounds of it (without a budget, that many or until
    they stop improving: the replay of a plan);
    ``searches``: on a large swarm, the anytime phase starts from the best of up to that many runs of the refined
    search's first steps (``refine``), with a budget those that start in its first ``SEARCH_SHARE`` (default:
    ``SEARCHES``, or ``portfolio.SEARCHES_EACH`` in each of several ``jobs``); ``patience``:
    the anytime phase ends once that many rounds in a row found no better plan (or goes on from another start; default:
    ``anytime.PATIENCE``, and no bound where a large swarm's race leaves it a single start, ``refine``);
    ``jobs``: with a budget, the refined planner searches from that many seeds at once, in as many processes, and
    keeps the best plan (``portfolio``); ``heats``: each of them first searches that many seeds in turn for part of the
    budget, and the best seeds search again (default: ``portfolio.default_heats``).

    Deterministic for a given seed (and, with a budget, the numbers of rounds and searches it completed, which the
    plan records with the seed of the search it kept: ``seed``, ``rounds`` and ``searches`` replay them) on the same
    numerics: another CPU's rounding (a BLAS kernel, a vector width) may lead the search elsewhere, as it decides on
    scores equal to the last bit. Raises ``PlanningError`` when no valid plan is found.
    """
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; use one of {', '.join(PLANNERS)}")
    out_of_time = may_search = time_left = None
    if budget_s > 0:
        if clock is None:
            raise ValueError("a planning budget needs a clock")
        start = clock()
        out_of_time = lambda: clock() >= start + budget_s  # noqa: E731
        may_search = lambda: clock() < start + SEARCH_SHARE * budget_s  # noqa: E731
        time_left = lambda: start + budget_s - clock()  # noqa: E731
    elif rounds is not None:
        out_of_time, may_search, time_left = (lambda: False), (lambda: True), (lambda: math.inf)
    reliable = swarm.reliable
    if stages is not None and not 1 <= stages <= min(int(reliable.sum()) // 2, model.layers):
        raise PlanningError(f"--stages {stages} needs 2 reliable devices per stage and a layer per stage: this swarm "
                            f"has {int(reliable.sum())} reliable devices and the model {model.layers} layers")
    if heats is None:
        heats = default_heats(len(swarm.devices))
    portfolio = (jobs > 1 or heats > 1) and planner == "refined" and rounds is None and out_of_time is not None
    if searches is None:
        searches = SEARCHES_EACH if portfolio else SEARCHES
    if portfolio:
        assert clock is not None
        return plan_on_cores(jobs=jobs, heats=heats, seed=seed, budget_s=budget_s, clock=clock, plan=make_plan,
                             swarm=swarm, model=model, batch_tokens=batch_tokens, microbatches=microbatches,
                             planner=planner, stages=stages, random_samples=random_samples,
                             average_every=average_every, searches=searches, patience=patience)
    # one BLAS thread (numpy's and scipy's OpenBLAS): the planner's matrices are small, and OpenBLAS gives a process
    # a thread per core whose waits spin, so a portfolio's jobs would take turns on the cores (``portfolio``); and a
    # replay on one core (``jobs`` 1) runs the same BLAS as the portfolio's search it replays
    with threadpool_limits(limits=1, user_api="blas"):
        net, search = swarm.network(), None
        engine = Engine(net, Workload(model=model, batch_tokens=batch_tokens, microbatches=microbatches,
                                       average_every=average_every), reliable)
        if planner in ("paper", "refined"):
            paper = paper_plan(engine, seed=seed, stages=stages)
            paper_layouts = None if paper is None else [g.layout(n) for g, n in zip(paper.groups, paper.layers)]
            if planner == "paper":
                layouts = paper_layouts
            else:
                refined, search = refined_layouts(engine, paper, seed=seed, stages=stages, out_of_time=out_of_time,
                                                  may_search=may_search, time_left=time_left, searches=searches,
                                                  max_rounds=rounds, anytime_patience=patience)
                layouts = better(engine, refined, paper_layouts)
        elif stages is not None:
            raise ValueError(f"--stages applies to the paper and refined planners, not {planner}")
        elif planner == "random":
            layouts = random_layouts(engine, samples=random_samples, seed=seed)[0]
        elif planner == "swarm":
            layouts = swarm_layouts(engine)
        else:
            layouts = dtfm_layouts(engine, seed=seed)
        if layouts is None:
            shared = sum(t.memory_bytes for t in model.shared)
            raise PlanningError(f"the {planner} planner found no plan whose servers can hold {model.layers} layers of "
                                f"{model.memory_bytes_per_layer / 2**30:.3g} GiB each"
                                + (f" beside {shared / 2**30:.3g} GiB of shared tensors" if shared else ""))
        search = None if search is None else dataclasses.replace(search, seed=seed)
        return build_plan(swarm.ids, net, engine.wl, layouts, planner=planner, reliable=reliable, search=search)
