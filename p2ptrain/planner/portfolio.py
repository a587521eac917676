"""Planning on several cores: the refined planner's search from several seeds at once, the best plan kept.

Within the default budget, which basin the refined search ends in turns on its seed more than on anything else it
does: on five 256-device swarms (500-503, 600), the plans of planner seeds 0-5 ended 1.051x the best known plans in
the mean and 16 of 30 within 5%, while the better of two seeds' plans (seeds 0 and 1, 2 and 3, 4 and 5) ended 1.027x
in the mean and 13 of 15 within 5%. So given ``jobs`` cores, ``make_plan`` searches with the planner's seed in its own
process and with ``jobs - 1`` seeds drawn from it in others (spawned: a fresh interpreter each, whatever threads the
caller runs), all until the same deadline, and keeps the plan with the lowest predicted batch time (the planner's own
seed's on ties). The plan records the seed of the search it kept (``SearchRecord.seed``): that seed with the rounds and
searches it records replays the plan on one core.
Measured on this 2-core machine at the default budget of then (14 s), on the same 30 plans: with 2 jobs (of 3 quick
searches each, as one job runs) the mean fell from
1.051x to 1.040x the best known, the worst from 1.129x to 1.101x, 20 ended within 5% against 16, and the other seed's
plan was kept in 13; each plan took 14.2-14.8 s as before. Where the planner's own seed's plan was kept, its search ran
4% fewer rounds beside the other (402 against 417 over 17 plans), and one of them ended worse (geo-256-seed503, seed 0:
146.92 -> 147.80 s, 21 rounds instead of 30).
The seeds give the searches other clusterings, as the extra quick searches of one process do (``refine.SEARCHES``),
and those leave its anytime phase less time. So each of several jobs runs one (``SEARCHES_EACH``): on the same 30
plans with 2 jobs the mean was 1.032x (1 quick search each), 1.031x (2) and 1.040x (3); the worst 1.083x, 1.102x and
1.101x; within 5% 22, 23 and 20; the planner's seed 0 within 5% on 4, 3 and 3 of the 5 swarms. On geo-480-seed500
(planner seeds 0-3, 2 jobs) the plans' mean PT was 108.5, 107.9 and 108.0 s, the worst 114.0, 114.0 and 117.4 s.
At the default budget of then (25.25 s at 256 devices) 2 each again measured no better than 1: on 22 plans (swarms
500-503, 600 and 700-704, planner seeds 0-2, 2 jobs) the PT of 2 over 1's was 1.002 in the geometric mean, lower on 4
(by up to 6.9%), higher on 10 (by up to 5.3%) and the same on 8.
Where the refined search races cores (over 500 devices, ``refine``), the jobs share their best plans once
(``default_share``): at ``SHARE_AT`` of the budget each job's anytime phase stops (the round cut short dropped), posts
its best plan on a board (a manager process's dict), waits for the others' (``SHARE_WAIT_S`` at most), and a job whose
plan is worse goes on from the best, with its own seed and round numbers (``anytime.Anytime.adopt``). The plan's
record names the donor's seed, its rounds then and the round of the adoption, which replay it (``make_plan``'s
``donor``). There a seed's search seldom leaves the basin its race picked, and a bad one stalls
(``benchmarks/results/planner-gap-history.md``). Measured at 1,024 devices (2 jobs, the default budget; before it was
built, by a patch of the same steps): PT 0.9915x one search a job's in the geometric mean over 23 plans (swarms
710-713, 720, 721, 500-503 and 600 with planner seeds 0 and 1, 601 with 0; lower on 9, higher on 3; 0.933x to 1.049x),
and all 23 within 5% of each swarm's best of these runs where 20; shared at 0.3 of the budget, 1.001x. As built, on 8
plans not used before (722-725 with seed 1, 726-729 with seed 0): 0.988x (lower on 4, by up to 4.8%; higher on 1, by
1.2%; the same on 3). It loses where the ranking at the share reverses later (720:1, 78.24 -> 82.07 s).
Elsewhere the jobs share nothing while they search. Sharing the best plan (each job, between rounds of its anytime
phase, going on from another's plan where that is better, so that every job kicks the best plan found) measured no
better at the default budget (44 s; swarms 600 and 700-704 of 256 devices, planner seed 0, a board in a manager
process): shared from half the budget on, PT 0.994x in the geometric mean (lower on 3, by up to 3.5%; higher on 1, by
2.1%; the same on 2); shared from the start, 0.999x (lower on 2, by up to 2.9%; higher on 3, by up to 1.2%). The jobs
give up the other seeds' basins, where one would have gone further, and ran 6% and 20% fewer rounds in all.
Which seed's search ends best shows early where the rounds are descents (``refine``): of 8 seeds of one job on
geo-256-seed710 and 711 (44 s each), the seed with the best plan at 8 s ended best on both. So ``heats``: each job first
searches several seeds in turn, each for ``HEAT_ROUNDS`` rounds of the anytime phase within a share of the first
``HEAT_SHARE`` of the budget, and the best seeds (as many as jobs) search again from the start until the deadline; the
best plan of all is kept, one seed's whole search, which its seed and rounds replay. On swarms 710, 711, 712 and 720 of
256 devices (planner seeds 0-2, 2 jobs, the default budget of 44 s; ``planner-gap-unseen-timed-r`` and ``-s`` in
``benchmarks/results``) 4 heats ended 1.036x the best known in the mean where one search a job ended 1.049x, the worst
1.060x where 1.074x, 11 of 12 within 5% where 4, and seed 0's plans 1.048, 1.036, 1.038 and 1.043x where 1.057, 1.061,
1.020 and 1.020x; each plan took 43.7-44.7 s as before. Run again with seed 0 (``-t``): 1.048, 1.036, 1.074 and 1.038x:
heats of 5.5 s ran 10-25 rounds as the other job's load let them, so which seeds went on varied from run to run. So a
heat runs ``HEAT_ROUNDS`` rounds (within its time, which it seldom needs at 256 devices): then (``-u``) 1.033x in the
mean, the worst 1.060x, 10 of 12 within 5%, seed 0's plans 1.038, 1.036, 1.038 and 1.038x. Tried by hand, 2 seeds a job
for 30% of the budget ended 1.042x, 1.068x and 5 of 12. ``HEATS`` holds where the rounds descend (``default_heats``): on
smaller swarms one search walks far enough, and a race of cores replaces steps 1-3 on larger ones.
Heats that resume (``resume_heats``, not the default): each job's best heat goes on from where it stopped (its search
kept in the job, ``planning.Planning``), so a finalist keeps its heat's rounds and does not run its steps before the
anytime phase again, which at 1,024 devices take 5.2 s of the 44 s. Measured there (2 jobs, the default budget, planner
seeds 0 and 1, one run after the other per plan; swarms 710-712, 720, 500 and 501, then 713, 721, 502, 503, 600 and
601), 2 heats a job against one search a job: PT 0.985x in the geometric mean on the first 12 plans (lower on 5, higher
on 3), 1.005x on the next 11 (lower on 2, higher on 7), 0.994x on all 23 (0.851x to 1.123x); 3 heats (first 12 only)
0.980x (lower on 4, higher on 6). Against the best plan of each swarm among these runs, the worst fell from 1.31x to
1.155x, but 15 of 23 ended within 5% where 17: the heats find the better seeds where one is far better, and the
finalist's fewer rounds (108-171 where 133-205) cost it elsewhere. So it stays off by default. Heats of 20 rounds
(resumed, the same 23 plans) measured no better: 0.997x one search a job's PT, the worst 1.202x the best, 12 of 23
within 5% (``benchmarks/results/planner-gap-history.md``).
Each search runs its BLAS on one thread (``make_plan``). With OpenBLAS's thread per core in each job, on
geo-1024-seed710 two planning processes at once took 22 s to reach the large swarm's race (``refine``; 2.2 s with one
thread each), and `python -m p2ptrain.plan` there (2 jobs, default budget) ran 102 rounds of the anytime phase, where
149 with one thread each (69.99 s of PT where 69.62 s).
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import numpy as np

from p2ptrain.planner.anytime import CORE_COVER, WALK_COVER, thinly_walked
from p2ptrain.planner.planning import Planning, budget
from p2ptrain.planner.records import Plan, PlanningError

DEFAULT_JOBS = 2  # searches at once by default, where there are the cores: the measured setting (module doc)
SEARCHES_EACH = 1  # runs of the refined search's first steps in each of several jobs (``refine.SEARCHES`` alone)
HEATS = 4  # seeds each job searches in turn before the best search again, where rounds descend (module doc)
HEAT_SHARE = 0.5  # the budget's share the heats take at most
HEAT_ROUNDS = 10  # rounds of the anytime phase a heat runs, so that the other job's load moves no heat's plan
SHARE_AT = 0.5  # the budget's share after which jobs that share post their best plans (module doc)
SHARE_WAIT_S = 3.0  # how long a job waits for the others' plans at most
POLL_S = 0.02  # between looks at the board while it waits


def default_jobs() -> int:
    """``DEFAULT_JOBS``, or fewer where the process may run on fewer cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(DEFAULT_JOBS, cores))


def portfolio_seeds(seed: int, jobs: int) -> list[int]:
    """The planner's seed, then ``jobs - 1`` seeds drawn from it (distinct from it for every seed)."""
    drawn = np.random.SeedSequence([seed, jobs]).generate_state(4 * jobs)
    seeds = [seed]
    for value in (int(v) for v in drawn):
        if len(seeds) == jobs:
            break
        if value not in seeds:
            seeds.append(value)
    return seeds


def default_share(devices: int) -> bool:
    """Whether several jobs share their best plans (``SHARE_AT``): where the refined search races cores (over 500
    devices, ``refine``), whose seeds' searches stay in the basins their races picked (module doc)."""
    return thinly_walked(devices, CORE_COVER)


def default_heats(devices: int) -> int:
    """``HEATS`` where the refined search's rounds are descents and no race of cores replaces its first steps (from
    167 to 500 devices: ``refine``), one elsewhere."""
    descends = thinly_walked(devices, WALK_COVER) and not thinly_walked(devices, CORE_COVER)
    return HEATS if descends else 1


def plan_on_cores(*, jobs: int, seed: int, budget_s: float, clock: Callable[[], float],
                  plan: Callable[..., Plan], heats: int = 1, resume_heats: bool = False, share: bool = False,
                  **kwargs: Any) -> Plan:
    """The best of ``plan(seed=s, budget_s=..., ...)`` over ``portfolio_seeds(seed, jobs * heats)``, ``jobs`` at once:
    the first of them in this process on ``clock``, the others in spawned processes until the same deadlines
    (``time.monotonic``'s, which every process shares). With ``heats`` over one, each job first searches ``heats`` seeds
    in turn, each for ``HEAT_ROUNDS`` rounds within its share of ``HEAT_SHARE`` of the budget, then the ``jobs`` seeds
    whose plans were best search again from the start until the budget ends (module doc); with ``resume_heats``, each
    job's best heat goes on from where it stopped instead (``_resumed_lane``; ``plan`` is not called). With ``share``
    (and one heat), the jobs post their best plans at ``SHARE_AT`` of the budget and the worse go on from the best
    (``_shared_lane``; ``plan`` is not called). The plan's search
    record says which seed found it, how many searched at once and in how many heats. Raises what this process's first
    search raises where no search finds a plan."""
    start = time.monotonic()
    seeds = portfolio_seeds(seed, jobs * heats)
    outcomes: dict[tuple[int, int], Plan | PlanningError] = {}  # by heat (0: the last search) and seed's index
    pool = (ProcessPoolExecutor(max_workers=jobs - 1, mp_context=multiprocessing.get_context("spawn")) if jobs > 1
            else None)
    with pool or contextlib.nullcontext():
        finalists = list(range(jobs))
        if share and heats == 1 and jobs > 1:
            assert pool is not None
            with multiprocessing.get_context("spawn").Manager() as manager:
                board, share_at, end = manager.dict(), start + SHARE_AT * budget_s, start + budget_s
                others = [pool.submit(_shared_lane, seed=s, share_at=share_at, end=end, clock=time.monotonic,
                                      board=board, jobs=jobs, **kwargs) for s in seeds[1:]]
                here = _shared_lane(seed=seeds[0], share_at=share_at, end=end, clock=clock, board=board, jobs=jobs,
                                    **kwargs)
                outcomes |= {(0, i): o for i, o in enumerate([here, *(future.result() for future in others)])}
            finalists = []
        elif heats > 1:
            lanes = [list(range(job, jobs * heats, jobs)) for job in range(jobs)]
            ends = [start + (k + 1) * HEAT_SHARE * budget_s / heats for k in range(heats)]
            if resume_heats:
                others = [pool.submit(_resumed_lane, seeds=[seeds[i] for i in lane], ends=ends, end=start + budget_s,
                                      clock=time.monotonic, **kwargs) for lane in lanes[1:]] if pool else []
                here = _resumed_lane(seeds=[seeds[i] for i in lanes[0]], ends=ends, end=start + budget_s, clock=clock,
                                     **kwargs)
                for lane, (heated, (k, final)) in zip(lanes, [here, *(future.result() for future in others)]):
                    outcomes |= {(1, i): o for i, o in zip(lane, heated)} | {(0, lane[k]): final}
                finalists = []
            else:
                outcomes |= {(1, i): o for i, o in _run(pool, plan, seeds, lanes, ends, clock=clock,
                                                         rounds=HEAT_ROUNDS, **kwargs)}
                ranked = sorted((o.predicted.batch_time_s, i) for (_, i), o in outcomes.items() if isinstance(o, Plan))
                finalists = [i for _, i in ranked[:jobs]]
        if finalists:
            outcomes |= {(0, i): o for i, o in _run(pool, plan, seeds, [[i] for i in finalists], [start + budget_s],
                                                     clock=clock, rounds=None, **kwargs)}
    found = [(o.predicted.batch_time_s, heat, i) for (heat, i), o in outcomes.items() if isinstance(o, Plan)]
    if not found:  # this process's first search's error
        raise next(o for o in outcomes.values() if isinstance(o, PlanningError))
    _, heat, i = min(found)
    best = outcomes[heat, i]
    assert isinstance(best, Plan)
    if best.search is None:
        return best
    return dataclasses.replace(best, search=dataclasses.replace(
        best.search, seed=seeds[i], jobs=jobs, heats=heats, resumed=resume_heats and heats > 1,
        shared=share and heats == 1 and jobs > 1))


def _run(pool: ProcessPoolExecutor | None, plan: Callable[..., Plan], seeds: list[int], lanes: list[list[int]],
         ends: list[float], *, clock: Callable[[], float], rounds: int | None,
         **kwargs: Any) -> list[tuple[int, Plan | PlanningError]]:
    """Each lane's seeds (by index) searched in turn, each until its end on ``time.monotonic`` or ``rounds`` rounds:
    the first lane in this process on ``clock``, the others in ``pool``; each search's seed index and outcome, the
    first lane's first."""
    others = [pool.submit(_lane, plan, seeds=[seeds[i] for i in lane], ends=ends, clock=time.monotonic,
                          rounds=rounds, **kwargs) for lane in lanes[1:]] if pool is not None else []
    here = _lane(plan, seeds=[seeds[i] for i in lanes[0]], ends=ends, clock=clock, rounds=rounds, **kwargs)
    return [(i, outcome) for lane, outcomes in zip(lanes, [here, *(future.result() for future in others)])
            for i, outcome in zip(lane, outcomes)]


def _lane(plan: Callable[..., Plan], *, seeds: list[int], ends: list[float], clock: Callable[[], float],
          rounds: int | None, **kwargs: Any) -> list[Plan | PlanningError]:
    """One job's searches of the portfolio, in turn, each until its end on ``time.monotonic`` and each a single search
    (where heats are the default, ``plan`` would run heats of its own) (in a spawned process ``plan`` goes there by
    name, as pickle sends functions): each one's plan, or why it found none."""
    return [_heat(lambda: plan(seed=seed, budget_s=max(0.0, end - time.monotonic()), clock=clock, rounds=rounds,
                               jobs=1, heats=1, **kwargs), end=end if rounds is not None else None)
            for seed, end in zip(seeds, ends)]


def _resumed_lane(*, seeds: list[int], ends: list[float], end: float, clock: Callable[[], float],
                  **kwargs: Any) -> tuple[list[Plan | PlanningError], tuple[int, Plan | PlanningError]]:
    """One job's heats that go on (``plan_on_cores`` with ``resume_heats``): each seed's search (``Planning``, its
    budget ending at ``end``) runs ``HEAT_ROUNDS`` rounds of the anytime phase or until its heat's end, all on
    ``time.monotonic``; then the search whose plan was best (the first on ties) goes on until ``end``. Each heat's plan
    (or why it found none), and which heat went on with the plan it ended with. A search that goes on ends where one
    search of its seed that ran all its rounds at once would (``anytime.Anytime``), so its seed and rounds replay it."""
    def heat(seed: int, heat_end: float) -> tuple[Planning, Plan]:
        planning = Planning(seed=seed, limit=budget(clock, clock(), _on_clock(clock, end)), **kwargs)
        planning.run(out_of_time=budget(clock, clock(), _on_clock(clock, heat_end)).out_of_time, max_rounds=HEAT_ROUNDS)
        return planning, planning.plan()

    heats = [_heat(lambda: heat(seed, heat_end), end=heat_end) for seed, heat_end in zip(seeds, ends)]
    heated = [o if isinstance(o, PlanningError) else o[1] for o in heats]
    ranked = sorted((o.predicted.batch_time_s, k) for k, o in enumerate(heated) if isinstance(o, Plan))
    if not ranked:
        return heated, (0, heated[0])
    best = ranked[0][1]
    finalist = heats[best]
    assert not isinstance(finalist, PlanningError)
    del heats  # the other heats' engines and caches
    finalist[0].run()
    return heated, (best, finalist[0].plan())


def _shared_lane(*, seed: int, share_at: float, end: float, clock: Callable[[], float], board: MutableMapping[int, Any],
                 jobs: int, **kwargs: Any) -> Plan | PlanningError:
    """One job's search when the jobs share (``plan_on_cores`` with ``share``): its rounds (``Planning``, its budget
    ending at ``end``) until ``share_at``, then it posts its best plan on ``board`` (by seed: PT, stages, rounds),
    waits for the other jobs' (``SHARE_WAIT_S`` at most) and goes on from the best of theirs where better than its
    own (``Planning.adopt``), until ``end``; times on ``time.monotonic``. Its plan, or why it found none. The plan's
    record names the search it went on from, so ``make_plan``'s ``donor`` replays it."""
    def search() -> Plan:
        planning = Planning(seed=seed, limit=budget(clock, clock(), _on_clock(clock, end)), **kwargs)
        planning.run(out_of_time=budget(clock, clock(), _on_clock(clock, share_at)).out_of_time)
        own = planning.best
        if own is not None:
            board[seed] = own
            deadline = time.monotonic() + SHARE_WAIT_S
            while len(board) < jobs and time.monotonic() < deadline:
                time.sleep(POLL_S)
            posts = [(pt, rounds, other, groups) for other, (pt, groups, rounds) in dict(board).items()
                     if other != seed]
            if posts:
                pt, rounds, other, groups = min(posts, key=lambda post: post[0])
                if pt < own[0]:
                    planning.adopt(groups, seed=other, rounds=rounds)
        planning.run()
        return planning.plan()

    return _heat(search, end=None)


def _on_clock(clock: Callable[[], float], at: float) -> float:
    """``at``, a time on ``time.monotonic``, on ``clock``."""
    return clock() + at - time.monotonic()


Outcome = TypeVar("Outcome")


def _heat(search: Callable[[], Outcome], *, end: float | None) -> Outcome | PlanningError:
    """``search()``, or why it found no plan: it raised ``PlanningError`` (another seed may find one), or ``end`` on
    ``time.monotonic`` has passed (a heat's rounds alone would overrun the budget)."""
    if end is not None and end <= time.monotonic():
        return PlanningError("no time left for this heat")
    try:
        return search()
    except PlanningError as error:
        return error
