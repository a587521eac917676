"""The refined planner: the paper's search, then a search on the full cost model that the paper's lacks.

1. Candidates: the levels of the paper's own clustering hierarchy (not only the one its stopping rule picks),
   each ordered and split into FS/BS by the paper's rules and scored on its servers alone; the best few get
   clients admitted greedily (strongest first, into the nearer stage only where that lowers PT, else idle).
   SWARM's balanced layout and the paper's plan join them as starting points. Layers are always set by time
   (``search.allocate``).
2. The best three candidates go through a local search (a candidate's rank before it says little of where it ends:
   on a 1,024-device swarm a 24-stage candidate ranked behind a 5-stage one ended 40% faster) that moves single
   devices (to idle, to a near stage, FS <-> BS) and swaps adjacent stages, re-optimising all layer counts after
   every move; then stages are split or merged (K±1) and searched again while that helps. Work is bounded by
   counts of moves and scored plans, not by time.
3. Iterated local search from the best plan: a few random moves, then the local search again with swaps of two
   devices between near stages added (the move that keeps both stages' sizes), kept only if better; until a
   run of kicks finds nothing. Then every idle device, the fastest first, joins whichever of its two nearest stages,
   in whichever role, lowers PT most (``Engine.admit``), if any does: step 1 admits only unreliable devices, as
   clients and at compute shares, and the local searches try a handful of drawn idle devices at a time. Measured at
   the default budget (one job and one quick search each, two runs at once; planner seed 0), on swarms 701, 711, 712
   and 720 of 256 devices the plans ended 136.95, 123.81, 154.41 and 133.96 s of PT where 134.91, 128.81, 162.37 and
   142.82 s.
   Steps 2 and 3 score plans with row shares set by time, as the plan ends with and the anytime phase scores (step 1
   screens under the contract's compute shares). Scored at compute shares they ended with fewer stages than the phase's
   best plans hold: on geo-256-seed703 (planner seed 1) at 7 stages, and the phase took about 100 rounds of kicks, a
   stage at a time, to reach the 10 of its best plans (scored by time, planner seed 0's phase started from 9). Scored by
   time, at the default budget (2 jobs, planner seed 0) on swarms 700-704 of 256 devices, the plans ended 144.1, 134.3,
   141.5, 149.8 and 155.7 s of PT where 145.5, 137.2, 144.7, 153.6 and 156.1 s; on 128 devices (swarms 900, 901) 208.3
   and 225.1 s where 205.7 and 230.5; on 64 (900-902) 569.9, 436.8 and 437.2 where 580.8, 433.4 and 440.3; on 32
   (900-902) 1,174.4, 821.7 and 766.6 where 1,156.6, 821.7 and 766.6.
4. Given a time budget, the anytime phase (``anytime``): rounds of simulated annealing from the best plan while the
   budget lasts. Where its rounds are descents (``anytime.thinly_walked`` below ``WALK_COVER``), they seldom leave the
   basin of the plan they start from, and which basin steps 1-3 end in turns on the clustering's seed: on 256-device
   swarms (500, 503, 600; planner seeds 0-5) steps 1-3 ended 147-208 s of PT apart from seed to seed, and the final
   plans up to 1.19x the best known. So there steps 1-3 run from up to ``SEARCHES`` clusterings (the planner's seed's,
   then seeds drawn from it), each after the first only while the first ``SEARCH_SHARE`` of the budget lasts
   (``make_plan``: the anytime phase keeps time on a larger swarm or a slower machine), and the anytime phase starts
   from the best; where it stalls (``anytime.PATIENCE`` rounds find nothing), it goes on from the others, the better
   first, then from new clusterings' local optima, each searched at a stall while the budget left is ``RESTART_ROOM``
   times the first search's time, so a larger budget keeps searching where the phase used to end: at twice the default
   budget (50.5 s, 2 jobs, planner seed 0) both jobs stalled on geo-256-seed503 by 23.9 s and the plan stayed at 147.22
   s of PT; with the restarts the search went on to the end and the plan ended at 144.65 s; on swarms 500-502 and 600
   the plans were the same with and without restarts (on 500 they found nothing better). At the default budget stalls
   come too late for a restart (the same plans on 503 and 600). Over 30 plans at the default budget of then (14 s;
   swarms 500-503 and 600, planner seeds 0-5, against the best known, ``planner-gap-256*.md``) the mean ratio fell from
   1.069 to 1.051, the worst from 1.193 to 1.129, and 16 ended within 5% against 11; on 480 devices (seeds 0-3) the
   plans ended 112.4-114.0 s of PT where one search left them 109.8-126.4 s. What steps 1-3 end with says little of
   where the phase ends from there: of 8 clusterings of geo-256-seed600 (planner seed 0, 40 rounds from each), the
   best after steps 1-3 (175.2 s of PT) ended 6th (153.7 s), the 7th (186.4 s) ended 2nd (144.4 s). Measured at the
   default budget (2 jobs) against the plans of then, and not adopted: step 2 from the best candidate alone (steps 1-3
   take half as long: 2.6 s against 5.2 s on geo-256-seed503), the PT of 13 plans 1.005x theirs in the geometric mean
   (0.972x to 1.073x); two runs of steps 1-3 in each job, the phase going on from the better after 10 rounds from
   each, 12 plans 1.000x (0.933x to 1.022x).
On a large swarm (``anytime.thinly_walked`` below ``CORE_COVER``: over 500 devices) steps 1-3 give way to a race of
small starts. The clustering's stages hold every reliable device, but the good plans found there use few: on
1,024-device swarms about 300 devices in 12-24 stages. Local moves drop devices one at a time, each new stage costly
to score while stages are large: on geo-1024-seed502, 12 s of local search from a level's full clusters (5 to 32
stages) reached 169-402 s of PT, 4-6 s from the cores of 6, 12 or 24 servers of 12 clusters reached 118-138 s. And
no early score told which start ends best (the 6-stage start screened first; 18 stages ended twice as fast). So the
starts are each cluster's core (the ``CORES`` servers nearest its medoid; clients admitted as in step 1) at a few levels
of 2.5 to 4 layers a stage (``CORE_LAYERS``, ``CORE_LEVELS``), and successive halving picks one (``race``): every start
gets a local search, the better half goes on with twice the budget, until one is left, which the anytime phase takes
once idle devices joined it as in step 3. The starts hold about 140 devices, and the anytime phase's descents added a
few at a time: on geo-1024-seed710 (planner seed 0) 140 in the race's winner, 296 in the plan at the default budget, 310
after 95 s. Admitted at once (0.4 s there: 140 -> 371), measured as above, the plans ended 75.48 and 71.48 s of PT on
swarm 710 (planner seeds 0 and 1) and 74.26 s on 720 (seed 0) where 87.07, 84.42 and 85.77 s: below the best of the long
runs of before (75.76 and 76.19 s, 10 x the budget). The phase has no other start to go on from there, so no run of
rounds without a better plan ends it: of 7 plans (swarms 710-712 and 720, planner seed 0; 710, seed 1), two had stalled
(``PATIENCE`` rounds) at 22 and 30 s of the 44 and ended at 75.48 and 71.48 s of PT; going on, 74.67 and 71.44 s; the
other 5 the same. Going on instead from the race's runners-up, idle devices admitted, found nothing in the time left
(they started at 160 and 189 s). Levels of up to 5 layers a stage (12 stages of a 60-layer model) lost: at the default
budget (one job, 18 plans: swarms 711 and 712 of 1,024 devices, planner seeds 10-15; 710 and 713, seeds 0-2) the race
picked 12 stages in 6 and those ended at 89.9 s of PT in the mean, against 83.8 s for the 10 it took 16 stages in;
without them the plans' PT was 0.976x in the geometric mean (lower in 11, higher in 5, the same in 2; 0.794x to 1.102x,
so seeds decide more). Four levels of 2 to 4 layers a stage (15, 19, 24 and 30 stages of a 60-layer model) where there
were three of 2 to 3.75 (16, 22 and 30): at the default budget (2 jobs) on swarms 710-712 and 720 of 1,024 devices
(planner seeds 0 and 1) and 500-502 (seed 0), PT 0.950x in the geometric mean, lower in 7 (by up to 17.9%: 87.21 ->
71.64 s on 502; 70.76 -> 62.88 s on 710, seed 0), higher in 4 (by up to 8.7%: 64.59 -> 70.24 s on 712, seed 1). Three
levels of 2 to 4 (15, 21 and 30 stages; one job a plan, planner seeds 0 and 1) measured 0.961x in the geometric mean,
but the better of each swarm's two plans, what two jobs keep, higher on all 4; five (15, 18, 21, 25 and 30; 2 jobs, seed
0) higher on all 4. Four levels of 2.5 to 4 layers a stage (15, 18, 21 and 24 stages) where 2 to 4: at the default
budget (2 jobs) on 16 plans no run used before (swarms 746-761 of 1,024 devices, planner seeds 0 and 1 in turn), PT
0.955x in the geometric mean, lower on 9 (by up to 23.1%: 84.83 -> 65.25 s on 748), higher on 7 (by up to 6.4%), the
worst plan 79.64 s where 84.83 s (the level of 30 stages not measured apart from the spacing); at 600 and 768 devices
(swarms 762-767, planner seeds 0 and 1) 1.013x, lower on 4, higher on 5 (by up to 20.3%: 78.45 -> 94.38 s on 766, seed
0), the worst 94.38 s where 94.06 s: no gain there, and no loss beyond what seeds decide (``planner-gap-history.md``).
5. Row shares and layer counts by time (``shares.timed_layouts``).
The result is compared with the paper's plan under ``cost.evaluate`` and the better one is returned, so the
refined plan is never worse than the paper's.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from p2ptrain.planner.anytime import CORE_COVER, PATIENCE, WALK_COVER, Anytime, SearchRecord, thinly_walked
from p2ptrain.planner.baselines import swarm_groups
from p2ptrain.planner.cost import StageLayout, evaluate
from p2ptrain.planner.paper import PaperResult, divisive_levels, order_clusters, spectral_bisection, split_roles
from p2ptrain.planner.search import Engine, Group, Score, merge_stages
from p2ptrain.planner.shares import timed_layouts

CORES = (8, 16)  # servers a large swarm's start keeps of each cluster (module doc)
CORE_LAYERS = (4.0, 2.5)  # the most and fewest layers a stage of a large swarm's start holds (module doc)
CORE_LEVELS = 4  # stage counts a large swarm's starts take, evenly apart on a log scale between those (module doc)
SEARCHES = 3  # runs of steps 1-3, each from its own clustering, where the anytime phase descends (module doc)
# the share of the budget after which no more of them start: at 480 devices one takes 6.7 s of the 22.75 s budget here,
# and three left the anytime phase 7-13 rounds where one left it 41
SEARCH_SHARE = 0.5
# where the anytime phase stalls with this many times the first quick search's time left, it goes on from a new one's
# optimum: the search itself, and descents from it as long again twice over
RESTART_ROOM = 3.0
RACE_FIRST = 1000  # plans the race's first local search of each start scores; every later round doubles it


def ranked(plan: tuple[list[Group], Score]) -> tuple[float, float]:
    """Sort key of scored plans, best first: PT, ties broken as ``Score.better_than`` does."""
    return plan[1].pt, plan[1].smooth


def complete(engine: Engine, groups: list[Group]) -> tuple[list[Group], Score]:
    """Step 1's clients: the idle unreliable devices admitted, scored at the contract's compute shares."""
    return engine.admit(groups, [x for x in engine.idle(groups) if not engine.reliable[x]], timed=False)


def split_stage(engine: Engine, groups: list[Group], k: int, seed: int) -> list[Group] | None:
    """Stage k's servers bisected spectrally; the halves take the nearer clients and the paper's FS/BS rule."""
    servers = np.array(groups[k].servers, dtype=int)
    if len(servers) < 4:
        return None
    left, right = spectral_bisection(engine.delay, servers, seed)
    context = [np.array(g.servers, dtype=int) for g in groups]
    ordered = context[:k] + [left, right] + context[k + 1:]
    roles = split_roles(engine, ordered)
    halves = roles[k:k + 2]
    clients: list[list[int]] = [[], []]
    for u in groups[k].clients:
        near = [float(engine.delay[u, list(h.servers)].mean()) for h in halves]
        clients[int(np.argmin(near))].append(u)
    return groups[:k] + [Group.of(h.fs, h.bs, c) for h, c in zip(halves, clients)] + groups[k + 1:]


def reshape(engine: Engine, groups: list[Group], *, rng: np.random.Generator, rounds: int, budget: int, seed: int,
            fixed_stages: bool, reshapes: int = 4, splits: int = 3) -> tuple[list[Group], Score]:
    """Local search, then K±1 while a searched result is better: merging any two neighbouring stages, or
    splitting one of the ``splits`` stages with the most servers; scored with time-set shares (module doc)."""
    groups, score = engine.improve(groups, rng=rng, rounds=rounds, budget=budget, timed=True)
    for _ in range(0 if fixed_stages else reshapes):
        largest = sorted(range(len(groups)), key=lambda k: -len(groups[k].servers))[:splits]
        options = [split_stage(engine, groups, k, seed) for k in largest]
        options += [merge_stages(groups, k) for k in range(len(groups) - 1)]
        scored = [(engine.score(o, timed=True), i) for i, o in enumerate(options) if o is not None]
        scored = [(s, i) for s, i in scored if np.isfinite(s.pt)]
        if not scored:
            break
        _, i = min(scored, key=lambda item: (item[0].pt, item[0].smooth))
        trial, trial_score = engine.improve(options[i], rng=rng, rounds=rounds, budget=budget, timed=True)
        if not trial_score.better_than(score):
            break
        groups, score = trial, trial_score
    return groups, score


def perturb(engine: Engine, groups: list[Group], score: Score, *, rng: np.random.Generator, budget: int,
            patience: int, rounds: int, kick_budget: int, strength: int = 3) -> tuple[list[Group], Score]:
    """Iterated local search: from the best plan, make ``strength`` random feasible moves whatever they cost,
    search locally again, and keep the result if it is better; until ``budget`` plans were scored, or
    ``patience`` kicks in a row found nothing better. ``score``: ``groups``' with time-set shares, as it scores."""
    misses, stop = 0, engine.scored + budget
    while engine.scored < stop and misses < patience:
        trial = groups
        for _ in range(strength):
            trial = next((o for o in engine.neighbours(trial, rng, 3, 6)
                          if np.isfinite(engine.score(o, timed=True).pt)), trial)
        trial, trial_score = engine.improve(trial, rng=rng, rounds=rounds, budget=kick_budget, swaps=True,
                                            timed=True)
        if trial_score.better_than(score):
            groups, score, misses = trial, trial_score, 0
        else:
            misses += 1
    return groups, score


def core(engine: Engine, members: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` members nearest the cluster's medoid (the member with the least mean delay to the others)."""
    if len(members) <= size:
        return members
    medoid = members[int(engine.delay[np.ix_(members, members)].mean(axis=1).argmin())]
    return np.sort(members[np.argsort(engine.delay[medoid, members], kind="stable")[:size]])


def core_starts(engine: Engine, levels: list[list[np.ndarray]], seed: int) -> list[tuple[list[Group], Score]]:
    """A large swarm's starts (module doc), scored with time-set shares: the cores of ``CORE_LEVELS`` levels of
    ``CORE_LAYERS`` layers a stage, ordered and split into FS/BS by the paper's rules, with clients admitted."""
    most, fewest = CORE_LAYERS
    spread = np.geomspace(engine.layers / most, engine.layers / fewest, CORE_LEVELS)
    counts = {int(round(k)) for k in spread}
    starts: dict[tuple[Group, ...], Score] = {}
    for k in sorted(counts & set(range(1, len(levels) + 1))):
        clusters = order_clusters(engine, levels[k - 1], seed)
        for size in CORES:
            groups, _ = complete(engine, split_roles(engine, [core(engine, c, size) for c in clusters]))
            score = engine.score(groups, timed=True)
            if np.isfinite(score.pt):
                starts[tuple(groups)] = score
    return [(list(groups), score) for groups, score in starts.items()]


def race(engine: Engine, starts: list[tuple[list[Group], Score]], *, seed: int,
         out_of_time: Callable[[], bool] = lambda: False, first: int = RACE_FIRST) -> tuple[list[Group], Score]:
    """Successive halving: each start gets a local search (time-set shares) of ``first`` plans, the better half goes
    on with twice the budget, until one is left; the best so far if ``out_of_time()`` before a round. Budgets are
    counts, so the result depends only on the seed and the rounds run."""
    runners = sorted(starts, key=ranked)
    budget, round_ = first, 0
    while len(runners) > 1 and not out_of_time():
        searched = [engine.improve(groups, rng=np.random.default_rng([seed, round_, i]), rounds=budget // 5,
                                   budget=budget, swaps=True, timed=True)
                    for i, (groups, _) in enumerate(runners)]
        runners = sorted(searched, key=ranked)[:(len(searched) + 1) // 2]
        budget, round_ = 2 * budget, round_ + 1
    return runners[0]


class RefinedSearch:
    """The refined plan of one seed (module doc), kept between runs of its anytime phase: steps 1-3 (or a large
    swarm's race) when made, then each ``run`` goes on with the phase's rounds (``anytime.Anytime``), so that a
    portfolio's heat goes on from where it stopped (``portfolio``); ``layouts`` is the plan so far."""

    def __init__(self, engine: Engine, paper: PaperResult | None, *, seed: int, stages: int | None = None,
                 anytime: bool = False, out_of_time: Callable[[], bool] = lambda: False,
                 anytime_patience: int | None = None, searches: int = SEARCHES,
                 may_search: Callable[[], bool] | None = None, time_left: Callable[[], float] | None = None,
                 rounds: int = 200, budget: int = 2000, starts: int = 3, screen: int = 3, kick_total: int = 2000,
                 patience: int = 6, kick_budget: int = 200) -> None:
        """``anytime``: whether the anytime phase follows (else ``run`` does nothing); it starts from the best of up to
        ``searches`` runs of steps 1-3 where its rounds are descents, each after the first only while ``may_search()``
        (none without it), and where it stalls there, goes on from the optima of new clusterings while ``time_left()``
        seconds are ``RESTART_ROOM`` times the first run's (none without it; ``math.inf``, as where rounds bound the
        phase: no bound). ``out_of_time`` bounds a large swarm's race. ``anytime_patience``: rounds in a row without a
        better plan after which the phase goes on from another start or ends (default: ``PATIENCE``, and no bound
        after a large swarm's race, module doc). ``rounds`` to ``kick_budget``: the counts that bound steps 1-3
        (``local_optimum``)."""
        self.engine, self.searches = engine, 1
        self.start: tuple[list[Group], Score] | None = None
        self.phase: Anytime | None = None
        reliable = np.flatnonzero(engine.reliable)
        most = min(len(reliable) // 2, engine.layers)
        if paper is not None and len(paper.levels) >= (stages or most):
            levels, chosen = paper.levels, paper.chosen
        else:
            levels, chosen = divisive_levels(engine, reliable, stages or most, seed, reach=stages is not None), 1
        if anytime and stages is None and thinly_walked(engine.net.size, CORE_COVER):
            cores = core_starts(engine, levels, seed)
            if cores:  # else the refined search's own starts (`starts` is their count)
                winner, _ = race(engine, cores, seed=seed, out_of_time=out_of_time)
                self._begin(engine.admit(winner, engine.idle(winner), timed=True), seed=seed, fixed_stages=False,
                            anytime=anytime, patience=math.inf if anytime_patience is None else anytime_patience)
                return
        search = dict(rounds=rounds, budget=budget, starts=starts, screen=screen, kick_total=kick_total,
                      patience=patience, kick_budget=kick_budget)
        left = time_left() if time_left is not None else math.inf
        optima = [local_optimum(engine, paper, levels, chosen, seed=seed, stages=stages, **search)]
        took = left - time_left() if time_left is not None and math.isfinite(left) else 0.0  # a quick search's time
        # where the anytime phase only descends (a large swarm), it seldom leaves the basin it starts in
        descends = may_search is not None and thinly_walked(engine.net.size, WALK_COVER)
        for i in range(1, searches if descends else 1):
            if not may_search():
                break
            optima.append(_other_optimum(engine, paper, i, seed=seed, stages=stages, **search))
        self.searches = len(optima)
        found = [o for o in optima if o is not None]
        if not found:
            return
        best = found[0]
        for optimum in found[1:]:
            best = optimum if optimum[1].better_than(best[1]) else best
        # where the phase stalls, it goes on from the others, the better first, then (where it descends) from the
        # optima of new clusterings while the budget has room for them
        rest = [groups for groups, _ in sorted((o for o in found if o is not best), key=ranked)]
        room = (lambda: False) if time_left is None else (lambda: time_left() >= RESTART_ROOM * took)
        then = _restarts(engine, paper, rest, first=len(optima), room=room, seed=seed, stages=stages,
                         **search) if descends else rest
        self._begin(best, seed=seed, fixed_stages=stages is not None, anytime=anytime, then=then,
                    patience=PATIENCE if anytime_patience is None else anytime_patience)

    def _begin(self, start: tuple[list[Group], Score], *, seed: int, fixed_stages: bool, anytime: bool,
               patience: float, then: Iterable[list[Group]] = ()) -> None:
        self.start = start
        if anytime:
            self.phase = Anytime(self.engine, start[0], seed=seed, fixed_stages=fixed_stages, patience=patience,
                                 then=then)

    def run(self, *, out_of_time: Callable[[], bool], max_rounds: int | None = None) -> None:
        """The anytime phase's rounds until ``out_of_time()`` or ``max_rounds`` in all (``Anytime.run``); none where
        it was not asked for."""
        if self.phase is not None:
            self.phase.run(out_of_time=out_of_time, max_rounds=max_rounds)

    def layouts(self) -> tuple[list[StageLayout] | None, SearchRecord | None]:
        """The better layout of what the anytime phase started and ended with (the start's without the phase), and
        what the phase did."""
        if self.start is None:
            return None, None
        engine, finalists, record = self.engine, [self.start], None
        if self.phase is not None:
            finalists.append((self.phase.best, self.phase.best_score))
            record = dataclasses.replace(self.phase.record, searches=self.searches)
        # the engine's score prices shares by compute and some shared tensors by a bound: the exact cost model decides
        options = [o for groups, score in finalists
                   for o in (engine.layouts(groups, score), timed_layouts(engine, groups))]
        return better(engine, *options), record


def _other_optimum(engine: Engine, paper: PaperResult | None, i: int, *, seed: int, stages: int | None,
                   **search: int) -> tuple[list[Group], Score] | None:
    """``local_optimum`` from the ``i``-th clustering after the planner's seed's (its seed drawn from both)."""
    reliable = np.flatnonzero(engine.reliable)
    most = min(len(reliable) // 2, engine.layers)
    other = int(np.random.SeedSequence([seed, i]).generate_state(1)[0])
    levels = divisive_levels(engine, reliable, stages or most, other, reach=stages is not None)
    return local_optimum(engine, paper, levels, 1, seed=other, stages=stages, **search)


def _restarts(engine: Engine, paper: PaperResult | None, rest: list[list[Group]], *, first: int,
              room: Callable[[], bool], seed: int, stages: int | None, **search: int) -> Iterator[list[Group]]:
    """``rest``, then the local optima of the ``first``-th and later clusterings (``_other_optimum``), each searched
    only when the anytime phase asks for it and ``room()``, until one has none (with no bound on time, the end)."""
    yield from rest
    i = first
    while room():
        optimum = _other_optimum(engine, paper, i, seed=seed, stages=stages, **search)
        if optimum is None:
            return
        i += 1
        yield optimum[0]


def local_optimum(engine: Engine, paper: PaperResult | None, levels: list[list[np.ndarray]], chosen: int, *,
                  seed: int, stages: int | None, rounds: int, budget: int, starts: int, screen: int,
                  kick_total: int, patience: int, kick_budget: int) -> tuple[list[Group], Score] | None:
    """Steps 1-3 of the module doc from the clustering ``levels`` (``chosen``: the paper's pick among them); None
    where no candidate is feasible."""
    rng = np.random.default_rng(seed)
    if stages is not None:
        wanted = [stages] if stages <= len(levels) else []
    else:
        # every level up to 24 stages, then a geometric sample: the servers-only score screens them cheaply
        wanted = sorted({*range(1, min(len(levels), 24) + 1), *np.geomspace(24, len(levels), 4).astype(int),
                         chosen} & set(range(1, len(levels) + 1)))
    screened = []
    for k in wanted:
        groups = split_roles(engine, order_clusters(engine, levels[k - 1], seed))
        screened.append((engine.score(groups), k, groups))
    screened.sort(key=lambda c: c[0].pt)
    candidates = [complete(engine, groups) for _, _, groups in screened[:screen]]
    balanced = swarm_groups(engine, stages)
    if balanced is not None:
        candidates.append((balanced, engine.score(balanced)))
    if paper is not None:
        candidates.append((paper.groups, engine.score(paper.groups)))
    candidates = [c for c in candidates if np.isfinite(c[1].pt)]
    if not candidates:
        return None
    candidates.sort(key=ranked)
    best: tuple[list[Group], Score] | None = None
    for groups, _ in candidates[:starts]:
        result = reshape(engine, groups, rng=rng, rounds=rounds, budget=budget, seed=seed,
                         fixed_stages=stages is not None)
        if best is None or result[1].better_than(best[1]):
            best = result
    assert best is not None
    searched, _ = perturb(engine, *best, rng=rng, budget=kick_total, patience=patience, rounds=rounds,
                          kick_budget=kick_budget)
    return engine.admit(searched, engine.idle(searched), timed=True)


def better(engine: Engine, *options: Sequence[StageLayout] | None) -> list[StageLayout] | None:
    """The option with the lowest evaluated PT (the first on ties)."""
    scored = [(evaluate(engine.net, engine.wl, o).batch_time_s, i) for i, o in enumerate(options) if o is not None]
    if not scored:
        return None
    return list(options[min(scored)[1]])
