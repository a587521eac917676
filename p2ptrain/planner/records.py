"""The plan as the runtime and the CLI see it: device ids, half-open layer ranges, the prediction."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from p2ptrain.planner.anytime import SearchRecord
from p2ptrain.planner.cost import (
    Evaluation,
    Network,
    StageLayout,
    Workload,
    evaluate,
    link_lower_bound,
    memory_lower_bound,
)


class PlanningError(ValueError):
    """No valid plan exists for this swarm and model (e.g. the servers cannot hold the model)."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Layers [start, end) and the stage's members; ``shares`` maps worker id to its fraction of each microbatch's
    rows (absent: proportional to compute, as docs/design.md §3 says)."""

    layers: tuple[int, int]
    fs: tuple[str, ...]
    bs: tuple[str, ...]
    clients: tuple[str, ...]
    shares: dict[str, float] | None = None

    @property
    def workers(self) -> tuple[str, ...]:
        return self.fs + self.bs + self.clients


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """docs/design.md §3 figures; ``stage_times_s[k] = d·(C_k + C_{k+1} + DT_k)``, ``averaging_s[k] = AR_k``."""

    batch_time_s: float
    lower_bound_s: float
    efficiency: float
    stage_times_s: tuple[float, ...]
    averaging_s: tuple[float, ...]
    memory_lower_bound_s: float | None = None  # cost.memory_lower_bound: no plan of this swarm can beat it
    link_lower_bound_s: float | None = None  # cost.link_lower_bound: nor this one

    @property
    def bound_s(self) -> float:
        """The tightest lower bound on PT known: no plan of the swarm is faster."""
        return max(self.lower_bound_s, self.memory_lower_bound_s or 0.0, self.link_lower_bound_s or 0.0)

    @property
    def gap(self) -> float:
        """How far the plan may be from the best possible: its batch time over the tightest bound known, less 1."""
        bound = self.bound_s
        return self.batch_time_s / bound - 1 if bound > 0 else float("inf")

    @classmethod
    def of(cls, evaluation: Evaluation, *, memory_lower_bound_s: float | None = None,
           link_lower_bound_s: float | None = None) -> "Prediction":
        return cls(batch_time_s=evaluation.batch_time_s, lower_bound_s=evaluation.lower_bound_s,
                   efficiency=evaluation.efficiency, stage_times_s=evaluation.stage_times_s,
                   averaging_s=evaluation.averaging_s, memory_lower_bound_s=memory_lower_bound_s,
                   link_lower_bound_s=link_lower_bound_s)


@dataclass(frozen=True, kw_only=True)
class Plan:
    stages: tuple[StagePlan, ...]
    idle: tuple[str, ...]
    predicted: Prediction
    planner: str = ""
    search: SearchRecord | None = None  # the refined planner's anytime phase, when it had a budget

    def to_json(self) -> dict[str, Any]:
        stages = []
        for stage in self.stages:
            entry: dict[str, Any] = {"layers": list(stage.layers), "fs": list(stage.fs), "bs": list(stage.bs),
                                     "clients": list(stage.clients)}
            if stage.shares is not None:
                entry["shares"] = dict(stage.shares)
            stages.append(entry)
        p = self.predicted
        return {"planner": self.planner, "stages": stages, "idle": list(self.idle),
                "predicted": {"batch_time_s": p.batch_time_s, "lower_bound_s": p.lower_bound_s,
                              "efficiency": p.efficiency, "stage_times_s": list(p.stage_times_s),
                              "averaging_s": list(p.averaging_s), "gap": p.gap,
                              **({} if p.memory_lower_bound_s is None
                                 else {"memory_lower_bound_s": p.memory_lower_bound_s}),
                              **({} if p.link_lower_bound_s is None
                                 else {"link_lower_bound_s": p.link_lower_bound_s})},
                **({} if self.search is None else {"search": dataclasses.asdict(self.search)})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        stages = tuple(
            StagePlan(layers=(int(s["layers"][0]), int(s["layers"][1])), fs=tuple(s["fs"]), bs=tuple(s["bs"]),
                      clients=tuple(s.get("clients", ())),
                      shares={k: float(v) for k, v in s["shares"].items()} if s.get("shares") is not None else None)
            for s in data["stages"])
        p = data["predicted"]
        predicted = Prediction(batch_time_s=float(p["batch_time_s"]), lower_bound_s=float(p["lower_bound_s"]),
                               efficiency=float(p["efficiency"]), stage_times_s=tuple(p["stage_times_s"]),
                               averaging_s=tuple(p.get("averaging_s", ())),
                               memory_lower_bound_s=p.get("memory_lower_bound_s"),
                               link_lower_bound_s=p.get("link_lower_bound_s"))
        search = data.get("search")
        return cls(stages=stages, idle=tuple(data.get("idle", ())), predicted=predicted,
                   planner=str(data.get("planner", "")),
                   search=None if search is None else SearchRecord(**{
                       f.name: None if search[f.name] is None else (bool if f.type == "bool" else int)(search[f.name])
                       for f in dataclasses.fields(SearchRecord)
                       if f.name in search or f.default is dataclasses.MISSING}))  # plans of before `searches`

    def layouts(self, ids: Sequence[str]) -> list[StageLayout]:
        """The plan by device index, for re-scoring it against a (possibly changed) network."""
        where = {device: i for i, device in enumerate(ids)}
        out = []
        for s in self.stages:
            shares = None if s.shares is None else np.array([s.shares[w] for w in s.workers])
            out.append(StageLayout(fs=np.array([where[x] for x in s.fs], dtype=int),
                                   bs=np.array([where[x] for x in s.bs], dtype=int),
                                   clients=np.array([where[x] for x in s.clients], dtype=int),
                                   layers=s.layers[1] - s.layers[0], shares=shares))
        return out


def build_plan(ids: Sequence[str], net: Network, wl: Workload, layouts: Sequence[StageLayout], *,
               planner: str, reliable: np.ndarray | None = None, search: SearchRecord | None = None) -> Plan:
    """Score index layouts with the cost model and name everything by device id; with ``reliable``, also the
    memory-aware lower bound."""
    evaluation = evaluate(net, wl, layouts)
    bound = None if reliable is None else memory_lower_bound(net, wl, reliable)
    links = None if reliable is None else link_lower_bound(net, wl, reliable)
    stages, start, placed = [], 0, set()
    for s in layouts:
        workers = [ids[i] for i in s.workers]
        placed.update(workers)
        shares = None if s.shares is None else {w: float(p) for w, p in zip(workers, s.shares)}
        stages.append(StagePlan(layers=(start, start + s.layers), fs=tuple(ids[i] for i in s.fs),
                                bs=tuple(ids[i] for i in s.bs), clients=tuple(ids[i] for i in s.clients),
                                shares=shares))
        start += s.layers
    idle = tuple(device for device in ids if device not in placed)
    return Plan(stages=tuple(stages), idle=idle, predicted=Prediction.of(evaluation, memory_lower_bound_s=bound,
                                                                          link_lower_bound_s=links),
                planner=planner, search=search)


def format_plan(plan: Plan, *, title: str) -> str:
    """The plan as a table: each stage's layers, FS, BS, clients and predicted times, then the bounds."""
    p = plan.predicted
    rows = [("stage", "layers", "FS", "BS", "clients", "batch time s", "averaging s")]
    for k, (s, t, a) in enumerate(zip(plan.stages, p.stage_times_s, p.averaging_s)):
        rows.append((str(k), f"[{s.layers[0]}, {s.layers[1]})", " ".join(s.fs), " ".join(s.bs),
                     " ".join(s.clients) or "-", f"{t:.4g}", f"{a:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"idle: {' '.join(plan.idle) or '-'}")
    lines.append(f"predicted batch time {p.batch_time_s:.4g} s, lower bound {p.lower_bound_s:.4g} s, "
                 f"efficiency {p.efficiency:.3f}")
    if p.memory_lower_bound_s is not None and p.memory_lower_bound_s > p.lower_bound_s * (1 + 1e-9):
        lines.append(f"with memory and 2 servers per stage counted, no plan beats {p.memory_lower_bound_s:.4g} s "
                     f"({p.memory_lower_bound_s / p.batch_time_s:.3f} of this plan's time)")
    if p.link_lower_bound_s is not None and p.link_lower_bound_s > max(p.lower_bound_s, p.memory_lower_bound_s or 0):
        lines.append(f"with every device's links, the stages' boundaries and averaging counted, no plan beats "
                     f"{p.link_lower_bound_s:.4g} s")
    lines.append(f"gap to the tightest bound: {p.gap:.1%} (no plan is faster than the bound; the best one may be "
                 "slower)")
    if plan.search is not None:
        lines.append(_search_line(plan.search))
    return "\n".join(lines)


def _search_line(s: SearchRecord) -> str:
    """What the refined search did, and the flags that replay it (where the record says its seed)."""
    line = f"search: {s.rounds} anytime rounds ({s.improved} improved the plan)"
    if s.searches > 1:
        line += f" from the best of {s.searches} searches"
    if s.restarts:
        line += f", going on from {s.restarts} of the others where it stalled"
    line += f", {s.scored} plans scored"
    if s.seed is not None:
        line += f"; seed {s.seed}"
        if s.heats > 1:
            line += (f", the best of {s.jobs * s.heats} searches from as many seeds, {s.jobs} at once, "
                     + ("each job's best going on from where it stopped" if s.resumed else f"the best {s.jobs} again")
                     + " for the rest of the budget")
        elif s.jobs > 1:
            line += f", the best of {s.jobs} searches from as many seeds"
            if s.shared:
                line += ", which shared their best plans once"
        replay = f"--seed {s.seed} --rounds {s.rounds} --searches {s.searches}"
        if s.donor_seed is not None:
            line += (f", going on before its round {s.adopted_at} from seed {s.donor_seed}'s best plan after "
                     f"{s.donor_rounds} rounds")
            replay += f" --donor {s.donor_seed}:{s.donor_rounds}:{s.adopted_at}"
        line += f" ({replay} replays it)"
    return line
