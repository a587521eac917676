"""Offline planner: swarm files, the docs/design.md §3 cost model, model presets, the paper's planner, its refinement and
the baselines. ``make_plan`` is the entry point the CLI and the runtime share."""
from __future__ import annotations

from collections.abc import Callable

from p2ptrain.planner.anytime import Donor
from p2ptrain.planner.planning import RANDOM_SAMPLES, UNBOUNDED, Planning, budget
from p2ptrain.planner.portfolio import SEARCHES_EACH, default_heats, default_share, plan_on_cores
from p2ptrain.planner.presets import ModelSpec, config_spec, model_spec
from p2ptrain.planner.records import Plan, PlanningError, Prediction, StagePlan, format_plan
from p2ptrain.planner.refine import SEARCHES
from p2ptrain.planner.swarmfile import Device, Swarm, SwarmFileError, load_swarm

PLANNERS: tuple[str, ...] = ("paper", "refined", "random", "swarm", "dtfm")

__all__ = ["PLANNERS", "Device", "Donor", "ModelSpec", "Plan", "PlanningError", "Prediction", "StagePlan", "Swarm",
           "SwarmFileError", "config_spec", "format_plan", "load_swarm", "make_plan", "model_spec"]


def make_plan(swarm: Swarm, model: ModelSpec, *, batch_tokens: int, microbatches: int, planner: str = "refined",
              stages: int | None = None, seed: int = 0, random_samples: int = RANDOM_SAMPLES,
              average_every: int = 1, budget_s: float = 0.0, clock: Callable[[], float] | None = None,
              rounds: int | None = None, searches: int | None = None, patience: int | None = None,
              jobs: int = 1, heats: int | None = None, resume_heats: bool = False, share: bool | None = None,
              donor: Donor | None = None) -> Plan:
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
    best heat goes on from where it stopped; ``share``: the jobs (heats 1) share their best plans once, at
    ``portfolio.SHARE_AT`` of the budget, and the worse go on from the best (default: ``portfolio.default_share``);
    ``donor``: with ``rounds``, the replay of a search that went on from another's plan so (its record's
    ``donor_seed``, ``donor_rounds`` and ``adopted_at``): that search runs its rounds first.

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
    if share is None:
        share = default_share(len(swarm.devices))
    if donor is not None and (rounds is None or planner != "refined" or donor.at > rounds):
        raise ValueError("a donor's plan replays in the refined planner's search of a number of rounds, no fewer than "
                         "the round it went on from it before")
    portfolio = (jobs > 1 or heats > 1) and planner == "refined" and rounds is None and limit is not None
    if searches is None:
        searches = SEARCHES_EACH if portfolio else SEARCHES
    if portfolio:
        assert clock is not None
        return plan_on_cores(jobs=jobs, heats=heats, resume_heats=resume_heats, share=share, seed=seed,
                             budget_s=budget_s,
                             clock=clock, plan=make_plan,
                             swarm=swarm, model=model, batch_tokens=batch_tokens, microbatches=microbatches,
                             planner=planner, stages=stages, random_samples=random_samples,
                             average_every=average_every, searches=searches, patience=patience)
    # one BLAS thread (numpy's and scipy's OpenBLAS; ``Planning``): the planner's matrices are small, and OpenBLAS
    # gives a process a thread per core whose waits spin, so a portfolio's jobs would take turns on the cores
    # (``portfolio``); and a replay on one core (``jobs`` 1) runs the same BLAS as the portfolio's search it replays
    settings = dict(batch_tokens=batch_tokens, microbatches=microbatches, planner=planner, stages=stages,
                    random_samples=random_samples, average_every=average_every, searches=searches, patience=patience,
                    limit=limit)
    given = None
    if donor is not None:
        giver = Planning(swarm, model, seed=donor.seed, **settings)
        giver.run(max_rounds=donor.rounds)
        given = giver.best
        del giver  # its engine and caches
    planning = Planning(swarm, model, seed=seed, **settings)
    if donor is not None:
        planning.run(max_rounds=donor.at)
        if given is None or not planning.adopt(given[1], seed=donor.seed, rounds=donor.rounds):
            raise PlanningError(f"seed {donor.seed}'s plan after {donor.rounds} rounds is no better than seed {seed}'s "
                                f"after {donor.at}: not the search it replays (another machine's numerics?)")
    planning.run(max_rounds=rounds)
    return planning.plan()
