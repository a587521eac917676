"""Offline planner: swarm files, the docs/design.md §3 cost model, model presets, the paper's planner, its refinement and
the baselines. ``make_plan`` is the entry point the CLI and the runtime share."""
from __future__ import annotations

from collections.abc import Callable

from p2ptrain.planner.planning import RANDOM_SAMPLES, UNBOUNDED, Planning, budget
from p2ptrain.planner.portfolio import SEARCHES_EACH, default_heats, plan_on_cores
from p2ptrain.planner.presets import ModelSpec, config_spec, model_spec
from p2ptrain.planner.records import Plan, PlanningError, Prediction, StagePlan, format_plan
from p2ptrain.planner.refine import SEARCHES
from p2ptrain.planner.swarmfile import Device, Swarm, SwarmFileError, load_swarm

PLANNERS: tuple[str, ...] = ("paper", "refined", "random", "swarm", "dtfm")

__all__ = ["PLANNERS", "Device", "ModelSpec", "Plan", "PlanningError", "Prediction", "StagePlan", "Swarm",
           "SwarmFileError", "config_spec", "format_plan", "load_swarm", "make_plan", "model_spec"]


def make_plan(swarm: Swarm, model: ModelSpec, *, batch_tokens: int, microbatches: int, planner: str = "refined",
              stages: int | None = None, seed: int = 0, random_samples: int = RANDOM_SAMPLES,
              average_every: int = 1, budget_s: float = 0.0, clock: Callable[[], float] | None = None,
              rounds: int | None = None, searches: int | None = None, patience: int | None = None,
              jobs: int = 1, heats: int | None = None, resume_heats: bool = False) -> Plan:
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
    budget, and the best seeds search again (default: ``portfolio.default_heats``), or with ``resume_heats`` each job's
    best heat goes on from where it stopped.

    Deterministic for a given seed (and, with a budget, the numbers of rounds and searches it completed, which the
    plan records with the seed of the search it kept: ``seed``, ``rounds`` and ``searches`` replay them) on the same
    numerics: another CPU's rounding (a BLAS kernel, a vector width) may lead the search elsewhere, as it decides on
    scores equal to the last bit. Raises ``PlanningError`` when no valid plan is found.
    """
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; use one of {', '.join(PLANNERS)}")
    limit = None
    if budget_s > 0:
        if clock is None:
            raise ValueError("a planning budget needs a clock")
        start = clock()
        limit = budget(clock, start, start + budget_s)
    elif rounds is not None:
        limit = UNBOUNDED
    reliable = swarm.reliable
    if stages is not None and not 1 <= stages <= min(int(reliable.sum()) // 2, model.layers):
        raise PlanningError(f"--stages {stages} needs 2 reliable devices per stage and a layer per stage: this swarm "
                            f"has {int(reliable.sum())} reliable devices and the model {model.layers} layers")
    if heats is None:
        heats = default_heats(len(swarm.devices))
    portfolio = (jobs > 1 or heats > 1) and planner == "refined" and rounds is None and limit is not None
    if searches is None:
        searches = SEARCHES_EACH if portfolio else SEARCHES
    if portfolio:
        assert clock is not None
        return plan_on_cores(jobs=jobs, heats=heats, resume_heats=resume_heats, seed=seed, budget_s=budget_s,
                             clock=clock, plan=make_plan,
                             swarm=swarm, model=model, batch_tokens=batch_tokens, microbatches=microbatches,
                             planner=planner, stages=stages, random_samples=random_samples,
                             average_every=average_every, searches=searches, patience=patience)
    # one BLAS thread (numpy's and scipy's OpenBLAS; ``Planning``): the planner's matrices are small, and OpenBLAS
    # gives a process a thread per core whose waits spin, so a portfolio's jobs would take turns on the cores
    # (``portfolio``); and a replay on one core (``jobs`` 1) runs the same BLAS as the portfolio's search it replays
    planning = Planning(swarm, model, batch_tokens=batch_tokens, microbatches=microbatches, planner=planner,
                        stages=stages, seed=seed, random_samples=random_samples, average_every=average_every,
                        searches=searches, patience=patience, limit=limit)
    planning.run(max_rounds=rounds)
    return planning.plan()
