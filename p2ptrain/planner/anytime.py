"""The refined planner's anytime phase: simulated annealing over stage memberships while a time budget lasts.

The refined search (``refine``) ends in a local optimum of its moves. Given more time (``--budget-s``), this phase keeps
improving the best plan in rounds. A round anneals from the best plan so far: it makes random moves (a device to
idleness, to a near stage or the other server role, or anywhere; two devices of near stages, or any two, trading places;
a device and its nearest mates moving together, to a near stage, to idleness or into a new stage; two neighbouring
stages trading places, a stage moved elsewhere in the pipeline or a run of stages reversed; two stages merged; a stage
split), accepts a worse plan with a probability that falls as the round goes on, and ends in a first-improvement local
search (``Engine.improve``). Each round draws from a generator seeded by the planner's seed and the round's number and
scores a fixed number of moves, so the result depends only on the seed and how many rounds completed; the clock only
decides how many (a round the budget cuts short is dropped). Once ``PATIENCE`` rounds in a row found nothing better, the
phase goes on from the next of the other starts it was given (a large swarm's other clusterings' local optima, then new
ones' while the budget has room, ``refine``), its rounds numbered on, and ends when none is left, so a small swarm is
not searched for the whole budget (after a large swarm's race of starts there is none, and the phase goes on,
``refine``). The best plan of all its starts is the result. Where a start stalls, another may go further: at twice
the default budget of then (28 s; 44 s now, ``default_budget_s``), 6 of 12 plans on 256 devices (swarms 503 and 600,
planner seeds 0-5) stalled before it, and with the other starts the 12 ended 1.035x the best known
plans in the mean (1.041 without), the worst 1.088x (1.129: geo-256-seed503, seed 4, 158.19 -> 148.31 s of PT); at the
14 s of then the phase seldom stalled: 29 of 30 such plans were the same, and the 30th completed 2 rounds fewer
(replayed, the same).
On a large swarm (where a walk would move each device fewer than ``WALK_COVER`` times) rounds are local searches
instead, and none walks. A walk pays only from near a local optimum, and a round's moves spread over hundreds of devices
are too few to find one: in a round measured on a 1,024-device swarm (8 moves a device) the walk's 6,000 moves found no
better plan than its start, and every gain came from its closing local search. The rounds there are descents (the local
search alone) while they find better plans; after one that does not, a wide descent, which draws 4 times as many devices
to move; after a wide one that does not, kicks: from the best plan, half the time one move that changes the stage count
(a stage split, two neighbours merged, or a device's nearest mates in a new stage of their own), else a few random
moves, each within a slack of the start's PT; then a wide descent, kept if better. Each descent samples other devices,
so one that failed says little of the next. The rounds' moves seldom change the stage count, and a changed count pays
only once the devices settle into it, which a wide descent does: with half the kicks changing it, 10 swarms of 256
devices (seeds 500-509) ended at the default budget of then 3.1% faster in the mean, faster on 7 (by up to 10.7%) and
slower on 3 (by up to 3.0%); most ended with more stages than the refined search started with. On 5 swarms of 1,024
devices (seeds 600-604), where the race of starts (``refine``) already tries several stage counts, no change in the
mean: 2 faster (by up to 4.6%), 1 slower (by 4.9%), 2 the same. Measured at the default budget: on geo-1024-seed600
these rounds ended at 84.0 s of PT where walks after the first failed descent ended at 94.0 s, and without kicks they
stalled at 91.5 s from a third of the way through the budget; on 256 devices (31 moves a device) they ended 2-6% better
than walks on 5 of 6 swarms (seeds 500, 502, 600-603) and 0.8% worse on one; on 128 (62 moves a device) 1-2% better on 2
of 3 and 3.6% worse on one, so walks stay there.
A kick's wide descent seldom reaches the bottom of the basin it lands in (it scores up to ``WIDE_BUDGET`` plans, and a
kick that changes the stage count moves many devices' best places), so the kick round goes on with wide descents, each
from the plan the one before ended with, until one finds nothing better (up to ``SETTLE`` more), and only then is set
against the best plan. At the default budget of then (25.25 s, 2 jobs; planner seeds 0-2) on swarms 500-503 and 600 of
256 devices the 15 plans ended 1.026x the best known in the mean where they ended 1.031x, the worst 1.051x where 1.083x,
14 within 5% where 11 (PT 0.996x in the geometric mean: 7 lower, 5 higher); on swarms 700-704, not measured before,
1.023x where 1.030x, the worst 1.053x where 1.065x, 14 within 5% where 10 (0.993x: 8 lower, 6 higher, 0.954x to 1.040x).
Going on from a plan within 2% of the best after a kick that found nothing better, instead of from the best, measured no
better on top of it (the first 15: 1.029x, worst 1.058x, 13 within 5%). A kick whose wide descent ends far above the
plan it kicked seldom settles below it, and its further descents cost the most: in two runs of 120 s (geo-256-seed711
and 712, planner seed 0, one job and one quick search, no early end), of 157 kicks, 19 ended their wide descent over 8%
above their start, and one of them (from 1.135x) settled below it; their further descents took 40 s of the 240, and 21
of the 22 kicks that paid had ended theirs within 7.6%. So the further descents follow only a kick within
``SETTLE_SLACK`` of its start: at the default budget (44 s; one job and one quick search each, as in the portfolio;
swarms 700-704, 711 and 712, planner seeds 0 and 1, and 711 and 712 seed 2) the 16 plans ran 14% more rounds, and their
PT was 0.997x in the geometric mean, lower in 7 (by up to 1.9%), higher in 1 (by 0.4%), the same in 8; on swarms
720-723, not used to choose it (seeds 0 and 1), the 8 plans were the same. On a swarm so large that the refined search
races cores (``CORE_COVER``), rounds are few and the kicks' further descents cost more than they find: on 1,024 devices
(swarms 500-502, planner seed 0) the plans ended 94.8, 88.5 and 83.7 s of PT, 75, 55 and 78 rounds, where without them
(an earlier run, ``planner-gap-1024-fast.md``) 92.9, 87.5 and 83.7 s, 88, 96 and 83 rounds; so there a kick ends with
its first wide descent.
The kick's random moves are bounded because a move made whatever it costs often takes a server far from its stage: on
geo-256-seed600 (planner seed 0) such kicks left plans of 164-1,638 s of PT from a best of 155 s, the wide descents
after them ended as high as 306 s, and 1 of 13 paid. With each move kept within 10% of the start's PT, on 20 plans
(swarms 500-503 and 600, planner seeds 0-3, one job and one quick search each, as in the portfolio, at the default
budget) the mean ratio to the best plan known (of long runs and of every run compared) fell from 1.074 to 1.056 and
the worst from 1.225 to 1.133; on 20 of swarms 700-704, not measured before, from 1.068 to 1.059 and from 1.323 to
1.231; the better of each two seeds' plans from 1.032 to 1.025 and from 1.034 to 1.025; on 1,024 devices (swarms
500-502 and 600, seed 0) from 1.078 to 1.057.
A kick that changes the stage count moves many devices' best places, and a wide descent draws only ``WIDE_SAMPLE``
devices: so after such a kick every idle device, the fastest first, joins whichever of its two nearest stages and roles
lowers PT most, if any does (``Engine.admit``, as after the refined search's steps 1-3). At the default budget (44 s;
one job and one quick search each, two runs at once; planner seed 0) PT was 0.965x in the geometric mean on 7 plans of
256 devices (swarms 700, 701, 710-712 and 720; 720 with seed 1 too: 0.934x to 0.999x, 133.96 -> 125.16 s on 720) and
0.939x on 4 of 1,024 devices (710-712 and 720: 0.884x to 1.003x); admitting after every kick, 0.976x and 0.943x.
Two moves measured no better and are not made (default budget, one job and one quick search each, two runs at once).
A kick that moves a stage to another site (its members idle, as many idle devices nearest a drawn idle reliable one in
its roles), as 15% of the kicks: PT 1.007x in the geometric mean on 1,024 devices (swarms 500-502, 710 and 720, planner
seed 0; 710 and 720, seed 1: 0.978x to 1.086x) and 1.008x on 256 (701, 711, 712 and 720, seed 0: lower on 1). Descents
that also draw idle devices among the 48 nearest a stage's servers: PT 1.010x, 1.042x and 1.070x on 1,024 devices (710,
seed 0; 720, seed 0; 710, seed 1), the last two stalled with about a quarter of the budget left: the near idle
devices that do not fit are drawn again and again.
Moves are scored through ``Engine.score`` with row shares set by time, as the plan ends with (``Engine.levels``), so
the search balances each stage's workers as it moves them; the engine caches every stage's statistics and levels,
so a move recomputes only the stages it touches.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from p2ptrain.planner.search import BS, CLIENT, FS, Engine, Group, Score, merge_stages

PATIENCE = 20  # rounds in a row without a better plan after which the search ends before its budget
CHECK_EVERY = 64  # moves between looks at the clock
# a round's starting temperatures, in turn, and its final one: the relative PT increase accepted with probability
# 1/e. Hotter rounds leave the best plan's basin (they found the better plans of small swarms), cooler ones refine it
HOTS, COLD = (0.02, 0.06), 0.0003
WALK_COVER = 48  # moves a walk makes per device, below which rounds descend instead (module doc)
CORE_COVER = 16  # moves a walk would make per device, below which the refined search races cores (``thinly_walked``)
# a large swarm's rounds (module doc): a descent moves the stages' binding devices and DESCENT_SAMPLE drawn ones and
# scores up to DESCENT_BUDGET plans; a wide one draws WIDE_SAMPLE and scores up to WIDE_BUDGET; a kick makes KICK random
# moves before a wide descent
DESCENT_SAMPLE, DESCENT_BUDGET, WIDE_SAMPLE, WIDE_BUDGET, KICK = 6, 2000, 24, 4000, 4
# a kick's random moves keep PT within KICK_SLACK of the kick's start; a move that would not is drawn again, up to
# KICK_TRIES times (module doc; slack 0.05 and 0.2 measured no better than 0.1)
KICK_SLACK, KICK_TRIES = 0.1, 8
SETTLE = 4  # more wide descents after a kick's, each from the last one's plan, until one finds nothing (module doc)
SETTLE_SLACK = 0.08  # ... only after a kick whose wide descent ended within this of its start's PT (module doc)
DESCENT, WIDE, KICKED, WALK = "descent", "wide", "kick", "walk"
AFTER_A_MISS = {DESCENT: WIDE, WIDE: KICKED, KICKED: KICKED}  # a large swarm's next round after one found nothing
RESHAPE = 0.5  # the share of a large swarm's kicks that change the stage count (module doc)
LOAD_WEIGHT = 0.3  # 0.1 / 0.3 / 1.0 measured on 256-device swarms: 0.3 and 1.0 alike and best


@dataclass(frozen=True, kw_only=True)
class SearchRecord:
    """What the anytime phase did: rounds completed (the result replays from the seed, this count and
    ``searches`` and ``seed``), plans scored by the whole refined search, the rounds that improved the best plan, the
    runs of the refined search's first steps it started from the best of (``refine``), the starts it went on from,
    and the searches from other seeds it was the best of (``portfolio``)."""

    rounds: int
    scored: int
    improved: int
    searches: int = 1
    restarts: int = 0  # times the phase went on from another start after ``PATIENCE`` rounds found nothing
    seed: int | None = None  # the seed of the search that found the plan (``portfolio``); None in plans of before it
    jobs: int = 1  # searches that ran at once, from as many seeds (``portfolio``)
    heats: int = 1  # seeds each of them searched in turn before the best searched again (``portfolio``)
    resumed: bool = False  # whether each job's best heat went on from where it stopped, not from the start
    shared: bool = False  # whether the jobs shared their best plans once (``portfolio``)
    donor_seed: int | None = None  # the search whose best plan this one went on from (``Anytime.adopt``), if any
    donor_rounds: int = 0  # ... after that many of its rounds
    adopted_at: int = 0  # ... before this search's round of that number


class Donor(NamedTuple):
    """Another search's best plan that a search went on from (``Anytime.adopt``): the search's seed, its rounds then,
    and the adopter's round before which it did (the fields a ``SearchRecord`` keeps, for a replay)."""

    seed: int
    rounds: int
    at: int


def default_budget_s(devices: int) -> float:
    """The CLI's budget: 4 s plus 40 s per 1,024 devices up to 64 (6.5 s), then growing with the log of the swarm's size
    to 44 s at 256 devices and no further, so that a whole planning process stays under 10 s at 64 devices and 60 s at
    1,024 (the refined search before this phase takes about 0.7 s and 5.2 s there: one job, planner seed 0, swarms 900
    and 901 of 64 devices, 710 and 720 of 1,024 two at once). Between them the phase gets the rounds it still gains
    from. Measured when it was set, before steps 2-3 of the refined search scored by time (b94ce1b): on swarms 700-704
    of 256 devices (planner seed 0, 2 jobs) 44 s ran 68-92 rounds and ended 1.013, 1.004, 1.037, 1.044 and 1.040x the
    best plans of the long runs (10 x 25.25 s each, 3 seeds), where the 25.25 s of before (growing to 44 s at 1,024)
    ran 41-62 and ended 1.022, 1.004, 1.057, 1.057 and 1.042x. At 128
    devices (swarms 900-903, planner seeds 0-2) 25.25 s in place of 15.9 s: 2 plans better (by 1.3 and 4.3%), 10 within
    0.2%; what stays apart there is the basin the search settles in (geo-128-seed901's seed 2: 235.5 s of PT either
    way, the long runs' 221.3 s)."""
    if devices <= 64:
        return 4.0 + 40.0 * devices / 1024
    return min(44.0, 6.5 + 37.5 * math.log2(devices / 64) / 2)


def round_moves(devices: int) -> int:
    """Scored moves per round: enough to cross a few plateaus (longer rounds found better plans than more, shorter
    ones), few enough that a 1,024-device swarm completes several rounds in its default budget."""
    return min(8000, 800 + 160 * devices)


def thinly_walked(devices: int, cover: int) -> bool:
    """Whether a round's walk would move each device fewer than `cover` times: below ``WALK_COVER`` a large swarm,
    whose rounds are descents, wide descents and kicks (module doc); below ``CORE_COVER`` one so large that the
    refined search starts from a race of cluster cores (``refine`` module doc)."""
    return round_moves(devices) < cover * devices


class Anytime:
    """The anytime phase (module doc) from ``groups`` (scored with time-set shares), kept between runs: after
    ``patience`` rounds in a row found nothing better it goes on from the next of ``then``, and ends when none is left;
    with ``fixed_stages`` no move changes the stage count. ``best`` and ``best_score`` are the best plan found so far,
    ``record`` what was done. A run goes on from the round the last one stopped before, and rounds run in several runs
    end where the same rounds run in one would (each round's draws are seeded by its number, and a round the clock
    cuts short is run again), so a portfolio's heat goes on from where it stopped (``portfolio``) and its seed and
    rounds still replay it."""

    def __init__(self, engine: Engine, groups: list[Group], *, seed: int, fixed_stages: bool,
                 patience: float = PATIENCE, then: Iterable[list[Group]] = ()) -> None:
        self.engine, self.seed, self.fixed_stages, self.patience = engine, seed, fixed_stages, patience
        self.rounds = self.improved = self.misses = self.restarts = 0
        self.moves = round_moves(engine.net.size)
        self.groups, self.score = groups, engine.score(groups, timed=True)
        self.best, self.best_score = self.groups, self.score
        # drawn only once a start stalls: a large swarm's may be searched for then (``refine``)
        self.pending = iter(then)
        self.large = thinly_walked(engine.net.size, WALK_COVER)
        # where rounds are scarce, no settling (module doc)
        self.settle = 0 if thinly_walked(engine.net.size, CORE_COVER) else SETTLE
        self.kind = self._first_kind()
        self.ended = False  # every start stalled
        self.donor: Donor | None = None  # the other search's plan it went on from (``adopt``)

    def _first_kind(self) -> str:
        """A start's first round: a descent on a large swarm, a walk on a small one (module doc)."""
        return DESCENT if self.large else WALK

    @property
    def record(self) -> SearchRecord:
        """What the phase did so far."""
        donor = self.donor
        adopted = {} if donor is None else {"donor_seed": donor.seed, "donor_rounds": donor.rounds,
                                            "adopted_at": donor.at}
        return SearchRecord(rounds=self.rounds, scored=self.engine.scored, improved=self.improved,
                            restarts=self.restarts, **adopted)

    def adopt(self, groups: list[Group], *, seed: int, rounds: int) -> bool:
        """Go on from ``groups``, the best plan of another search (of ``seed``, after ``rounds`` rounds), where it is
        better than this phase's best: as from a start of its own (no misses, a start's first kind of round), its
        rounds numbered on. Whether it was; once only."""
        assert self.donor is None, "a search adopts one plan at most"
        score = self.engine.score(groups, timed=True)
        if not score.better_than(self.best_score):
            return False
        self.groups = self.best = groups
        self.score = self.best_score = score
        self.misses, self.kind, self.ended = 0, self._first_kind(), False
        self.donor = Donor(seed=seed, rounds=rounds, at=self.rounds)
        return True

    def run(self, *, out_of_time: Callable[[], bool], max_rounds: int | None = None) -> None:
        """Rounds until ``out_of_time()``, ``max_rounds`` rounds in all, or every start stalled."""
        engine = self.engine
        while not self.ended and (max_rounds is None or self.rounds < max_rounds):
            if self.misses >= self.patience:
                other = next(self.pending, None)
                if other is None:
                    self.ended = True
                    break
                self.groups, self.misses, self.restarts = other, 0, self.restarts + 1
                self.score, self.kind = engine.score(other, timed=True), self._first_kind()
            result = self._round(out_of_time)
            if result is None:
                break
            self.rounds += 1
            trial, trial_score = result
            better = trial_score.better_than(self.score)
            if self.kind != WALK:
                self.kind = DESCENT if better else AFTER_A_MISS[self.kind]
            if better:
                self.groups, self.score, self.misses = trial, trial_score, 0
            else:
                self.misses += 1
            # another start counts from its first completed round on, as in a replay of the rounds completed
            if self.score.better_than(self.best_score):
                self.best, self.best_score = self.groups, self.score
                self.improved += int(better)

    def _round(self, out_of_time: Callable[[], bool]) -> tuple[list[Group], Score] | None:
        """The next round's plan and score; None if the budget ended first."""
        engine, groups, kind = self.engine, self.groups, self.kind
        rng = np.random.default_rng([self.seed, self.rounds])
        if kind == WALK:
            return _round(engine, groups, self.score, rng=rng, moves=self.moves, hot=HOTS[self.rounds % len(HOTS)],
                          fixed_stages=self.fixed_stages, out_of_time=out_of_time)
        if out_of_time():
            return None
        start = groups if kind != KICKED else _kick(engine, groups, rng, self.fixed_stages)
        result = _local_search(engine, start, rng, wide=kind != DESCENT)
        if kind == KICKED and result[1].pt <= self.score.pt * (1 + SETTLE_SLACK):
            return _settle(engine, result, rng, out_of_time, self.settle)
        return result


def _local_search(engine: Engine, groups: list[Group], rng: np.random.Generator, *,
                  wide: bool = False) -> tuple[list[Group], Score]:
    return engine.improve(groups, rng=rng, rounds=200, budget=WIDE_BUDGET if wide else DESCENT_BUDGET, swaps=True,
                          timed=True, sample=WIDE_SAMPLE if wide else DESCENT_SAMPLE)


def _settle(engine: Engine, result: tuple[list[Group], Score], rng: np.random.Generator,
            out_of_time: Callable[[], bool], times: int) -> tuple[list[Group], Score] | None:
    """A kick's wide descent ``result`` after up to ``times`` more wide descents, each from the plan the one before
    ended with, until one finds nothing better; None if the budget ended first (the round is dropped, as a replay
    would not have it)."""
    for _ in range(times):
        if out_of_time():
            return None
        settled = _local_search(engine, result[0], rng, wide=True)
        if not settled[1].better_than(result[1]):
            break
        result = settled
    return result


def _kick(engine: Engine, groups: list[Group], rng: np.random.Generator, fixed_stages: bool) -> list[Group]:
    """``groups`` after a kick: a fraction ``RESHAPE`` of kicks (unless ``fixed_stages``) make one move that changes
    the stage count (``_reshape``); the others, and those whose move does not apply or gives no feasible plan, make
    ``KICK`` random moves, each drawn again (up to ``KICK_TRIES`` times) where it would take PT over ``KICK_SLACK``
    above the kick's start. Where the stage count changed, idle devices then join where they lower PT
    (``Engine.admit``; module doc)."""
    kicked = None
    if not fixed_stages and rng.random() < RESHAPE:
        reshaped = _reshape(engine, groups, rng)
        if reshaped is not None and math.isfinite(engine.score(reshaped, timed=True).pt):
            kicked = reshaped
    if kicked is None:
        kicked, limit = groups, engine.score(groups, timed=True).pt * (1 + KICK_SLACK)
        for _ in range(KICK):
            for _ in range(KICK_TRIES):
                moved = random_move(engine, kicked, rng, fixed_stages)
                if moved is not None and (pt := engine.score(moved, timed=True).pt) <= limit and math.isfinite(pt):
                    kicked = moved
                    break
    if len(kicked) != len(groups):
        kicked, _ = engine.admit(kicked, engine.idle(kicked), timed=True)
    return kicked


def _reshape(engine: Engine, groups: list[Group], rng: np.random.Generator) -> list[Group] | None:
    """A stage split in two, two neighbouring stages merged, or a device's nearest mates in a new stage of their own;
    None where the drawn move does not apply."""
    draw = rng.random()
    if draw < 0.4:
        return _split(groups, int(rng.integers(len(groups))), rng)
    if draw < 0.7 and len(groups) > 1:
        return merge_stages(groups, int(rng.integers(len(groups) - 1)))
    return _cluster(engine, groups, rng, new_stage=True)


def _round(engine: Engine, groups: list[Group], score: Score, *, rng: np.random.Generator, moves: int, hot: float,
           fixed_stages: bool, out_of_time: Callable[[], bool]) -> tuple[list[Group], Score] | None:
    """One annealing round and its closing local search; None if the budget ended first."""
    current, current_energy = groups, _energy(score)
    best, best_score = groups, score
    for step in range(moves):
        if step % CHECK_EVERY == 0 and out_of_time():
            return None
        trial = random_move(engine, current, rng, fixed_stages)
        if trial is None:
            continue
        trial_score = engine.score(trial, timed=True)
        if not math.isfinite(trial_score.pt):
            continue
        temperature = hot * (COLD / hot) ** (step / moves)
        energy = _energy(trial_score)
        rise = (energy - current_energy) / current_energy
        if rise <= 0 or rng.random() < math.exp(-rise / temperature):
            current, current_energy = trial, energy
            if trial_score.better_than(best_score):
                best, best_score = trial, trial_score
    if out_of_time():
        return None
    return _local_search(engine, best, rng)


def _energy(score: Score) -> float:
    """What a round anneals: PT, plus a little of the mean time of the layer counts that reach it, so a move that
    speeds up stages other than the slowest is taken as progress on PT's plateaus."""
    return score.pt + LOAD_WEIGHT * (score.load if score.load is not None else score.pt)


def random_move(engine: Engine, groups: list[Group], rng: np.random.Generator,
                fixed_stages: bool) -> list[Group] | None:
    """A random neighbour of ``groups`` (module doc), or None where the drawn move does not apply."""
    draw = rng.random()
    if draw < 0.2:
        device = _device(engine, groups, rng)
        options = list(engine.relocations(groups, device, _home(groups, device), engine.near(groups, device), 3))
        return options[int(rng.integers(len(options)))] if options else None
    if draw < 0.4:
        return _anywhere(engine, groups, rng)
    if draw < 0.55:
        device = _device(engine, groups, rng, placed=True)
        options = list(engine.swaps(groups, device, _home(groups, device), engine.near(groups, device), 3, rng))
        return options[int(rng.integers(len(options)))] if options else None
    if draw < 0.67:
        return _trade(engine, groups, rng)
    if draw < 0.8:
        return _cluster(engine, groups, rng, new_stage=not fixed_stages and rng.random() < 0.25)
    if len(groups) < 2:
        return None
    k = int(rng.integers(len(groups) - 1))
    if draw < 0.86:
        return groups[:k] + [groups[k + 1], groups[k]] + groups[k + 2:]
    if draw < 0.93 or fixed_stages:
        return _reorder(groups, rng)
    if draw < 0.965:
        return merge_stages(groups, k)
    return _split(groups, int(rng.integers(len(groups))), rng)


def _home(groups: list[Group], device: int) -> int:
    """The stage `device` works in; -1 if it is idle."""
    return next((k for k, g in enumerate(groups) if device in g.workers), -1)


def _anywhere(engine: Engine, groups: list[Group], rng: np.random.Generator) -> list[Group]:
    """Any device to any stage, in any role it may take, or to idleness: moves no notion of nearness proposes."""
    device = int(rng.integers(engine.net.size))
    moved = [g.without(device) for g in groups]
    target = int(rng.integers(-1, len(groups)))
    if target >= 0:
        role = int(rng.integers(3)) if engine.reliable[device] else CLIENT
        moved[target] = moved[target].adding(device, role)
    return moved


def _trade(engine: Engine, groups: list[Group], rng: np.random.Generator) -> list[Group] | None:
    """Two devices, placed or idle, anywhere, trade places and roles; None where a role does not fit."""
    first, second = (int(x) for x in rng.choice(engine.net.size, size=2, replace=False))
    a, b = _home(groups, first), _home(groups, second)
    if a == b:
        return None
    role_a = groups[a].role(first) if a >= 0 else CLIENT
    role_b = groups[b].role(second) if b >= 0 else CLIENT
    if (role_a != CLIENT and not engine.reliable[second]) or (role_b != CLIENT and not engine.reliable[first]):
        return None
    moved = list(groups)
    if a >= 0:
        moved[a] = moved[a].without(first).adding(second, role_a)
    if b >= 0:
        moved[b] = moved[b].without(second).adding(first, role_b)
    return moved


def _reorder(groups: list[Group], rng: np.random.Generator) -> list[Group]:
    """A stage moved to another place in the pipeline, or a run of stages reversed: orders with other boundaries
    (the inter-stage links), which swaps of neighbours reach only through worse plans."""
    i, j = sorted(int(x) for x in rng.choice(len(groups), size=2, replace=False))
    if rng.random() < 0.5:
        return groups[:i] + groups[i:j + 1][::-1] + groups[j + 1:]
    moved = list(groups)
    if rng.random() < 0.5:
        moved.insert(j, moved.pop(i))
    else:
        moved.insert(i, moved.pop(j))
    return moved


def _cluster(engine: Engine, groups: list[Group], rng: np.random.Generator, *, new_stage: bool) -> list[Group] | None:
    """A device and its nearest mates of the same stage and role (or idle) move together: to a near stage (servers
    keep their role, idle ones take one), to idleness, or, with ``new_stage``, into a stage of their own at a random
    place. A site's devices reach another stage in one move instead of one by one through worse plans."""
    device = _device(engine, groups, rng)
    homes = np.full(engine.net.size, -1)
    roles = np.full(engine.net.size, CLIENT)
    for k, g in enumerate(groups):
        for role, members in ((FS, g.fs), (BS, g.bs), (CLIENT, g.clients)):
            homes[list(members)] = k
            roles[list(members)] = role
    home, role = int(homes[device]), int(roles[device])
    order = engine.closest(device)
    same = order[(homes[order] == home) & ((home < 0) | (roles[order] == role))]
    mates = [int(x) for x in same[:int(rng.integers(4, 13) if new_stage else rng.integers(2, 9))]]
    moved = [g if k != home else Group.of(*(tuple(x for x in part if x not in mates)
                                            for part in (g.fs, g.bs, g.clients)))
             for k, g in enumerate(groups)]
    reliable = [x for x in mates if engine.reliable[x]]
    if new_stage:
        clients = [x for x in mates if not engine.reliable[x]]
        stage = Group.of(reliable[::2], reliable[1::2], clients)
        if not stage.valid or len(moved) >= engine.layers:
            return None
        at = int(rng.integers(len(moved) + 1))
        return moved[:at] + [stage] + moved[at:]
    near = engine.near(groups, device)
    targets = engine.targets(near, home, 3)
    target = targets[int(rng.integers(len(targets)))] if targets and rng.random() < 0.8 else -1
    if target < 0:
        return moved if home >= 0 else None
    server = role if home >= 0 and role != CLIENT else int(rng.integers(2))
    parts = [list(moved[target].fs), list(moved[target].bs), list(moved[target].clients)]
    for x in mates:
        parts[server if engine.reliable[x] else CLIENT].append(x)
    moved[target] = Group.of(*parts)
    return moved


def _device(engine: Engine, groups: list[Group], rng: np.random.Generator, placed: bool = False) -> int:
    """A device to move: half the time one that binds the slowest stage (its slowest link, farthest pair or least
    memory), else any device (placed ones only, with ``placed``)."""
    if rng.random() < 0.5:
        slowest = max(range(len(groups)), key=lambda k: engine.stats(groups[k]).comm)
        stats = engine.stats(groups[slowest])
        binding = (stats.worst, *stats.far, stats.weakest)
        return int(binding[int(rng.integers(len(binding)))])
    if placed:
        workers = [x for g in groups for x in g.workers]
        return int(workers[int(rng.integers(len(workers)))])
    return int(rng.integers(engine.net.size))


def _split(groups: list[Group], k: int, rng: np.random.Generator) -> list[Group] | None:
    """Stage k's servers and clients dealt at random into two stages of at least an FS and a BS each."""
    group = groups[k]
    servers = list(group.servers)
    if len(servers) < 4:
        return None
    order = rng.permutation(len(servers))
    half = len(servers) // 2
    halves = [[servers[i] for i in order[:half]], [servers[i] for i in order[half:]]]
    clients = [int(x) for x in rng.permutation(np.array(group.clients, dtype=int))]
    parts = [Group.of(h[: len(h) // 2], h[len(h) // 2:], clients[i::2]) for i, h in enumerate(halves)]
    return groups[:k] + parts + groups[k + 1:]
