"""A client joins by probing (issue 7): the pure stage choice, without a network (milliseconds each)."""
from __future__ import annotations

import math
import re
import time

import pytest

from p2ptrain.planner.cost import Workload
from p2ptrain.planner.join import Joiner, LinkEstimate, StageChoice, SwarmView, choose_stage
from p2ptrain.planner.presets import ModelSpec
from p2ptrain.planner.records import StagePlan

GFLOPS = 1e9
MODEL = ModelSpec(layers=4, flops_per_token_per_layer=1e6, activation_bytes_per_token=256.0,
                  param_bytes_per_layer=1e5, memory_bytes_per_layer=1e6)
WORKLOAD = Workload(model=MODEL, batch_tokens=2048, microbatches=4)
FAST = LinkEstimate(latency_s=1e-3, bandwidth_bps=1e9)


def link(latency_ms: float, bandwidth_mbs: float) -> LinkEstimate:
    return LinkEstimate(latency_s=latency_ms * 1e-3, bandwidth_bps=bandwidth_mbs * 1e6)


def two_stages(*, clients0: tuple[str, ...] = (), clients1: tuple[str, ...] = ()) -> tuple[StagePlan, ...]:
    return (StagePlan(layers=(0, 2), fs=("fs0",), bs=("bs0",), clients=clients0),
            StagePlan(layers=(2, 4), fs=("fs1",), bs=("bs1",), clients=clients1))


def view(stages: tuple[StagePlan, ...], flops: dict[str, float]) -> SwarmView:
    servers = [s for stage in stages for s in stage.fs + stage.bs]
    # the servers measured each other over fast links (as servers placed by a plan announce)
    links = {(a, b): FAST for a in servers for b in servers if a != b}
    return SwarmView(stages=stages, flops=flops, memory={}, links=links)


def joiner(links: dict[str, LinkEstimate], *, flops: float = 1 * GFLOPS, memory: float = 1e9) -> Joiner:
    return Joiner(peer_id="me", flops=flops, memory=memory, links=links)


def choose(swarm: SwarmView, me: Joiner, rule: str) -> StageChoice:
    return choose_stage(swarm, me, workload=WORKLOAD, rule=rule)


EVEN = {"fs0": 1 * GFLOPS, "bs0": 1 * GFLOPS, "fs1": 1 * GFLOPS, "bs1": 1 * GFLOPS}


def test_both_rules_avoid_the_stage_behind_a_slow_link():
    swarm = view(two_stages(), EVEN)
    me = joiner({"fs0": link(100, 5), "bs0": link(100, 5), "fs1": link(1, 500), "bs1": link(1, 500)})
    for rule in ("paper", "cost"):
        choice = choose(swarm, me, rule)
        assert choice.stage == 1, choice
    cost = choose(swarm, me, "cost")
    assert cost.options[1].batch_time_s < cost.options[0].batch_time_s
    # the stages are alike, so stage 0 still bounds the pipeline: joining stage 1 costs nothing, stage 0 costs time
    assert cost.options[1].batch_time_s == pytest.approx(cost.baseline_s)
    assert cost.options[0].mean_bandwidth_bps == pytest.approx(5e6)


def test_the_cost_rule_joins_the_bottleneck_stage_where_the_paper_rule_follows_bandwidth():
    # stage 0 is crowded with fast clients; stage 1 has slow servers and is the pipeline's bottleneck. Stage 0's
    # servers are a little closer to the joiner, so the paper's rule sends it there, where it barely helps.
    flops = {**EVEN, "c0": 8 * GFLOPS, "c1": 8 * GFLOPS, "fs1": 0.5 * GFLOPS, "bs1": 0.5 * GFLOPS}
    swarm = view(two_stages(clients0=("c0", "c1")), flops)
    me = joiner({"fs0": link(1, 400), "bs0": link(1, 400), "fs1": link(2, 200), "bs1": link(2, 200)})
    paper, cost = choose(swarm, me, "paper"), choose(swarm, me, "cost")
    assert paper.stage == 0 and cost.stage == 1
    # the cost rule's pick predicts a lower batch time than the paper's, and lower than without the client
    assert cost.chosen.batch_time_s < paper.chosen.batch_time_s < paper.baseline_s * (1 + 1e-12)
    assert cost.options == paper.options  # the same figures, only the rule differs


def test_a_stage_whose_servers_did_not_all_answer_is_no_candidate():
    swarm = view(two_stages(), EVEN)
    me = joiner({"fs0": link(1, 500), "bs0": link(1, 500), "fs1": link(1, 900)})  # bs1 did not answer
    for rule in ("paper", "cost"):
        choice = choose(swarm, me, rule)
        assert choice.stage == 0
        assert not choice.options[1].reachable and math.isinf(choice.options[1].batch_time_s)
        assert choice.options[1].mean_bandwidth_bps == pytest.approx(450e6)  # an unreached server counts as 0
    with pytest.raises(ValueError, match="no stage can take this client"):
        choose(swarm, joiner({"fs1": link(1, 900)}), "cost")


def test_a_client_too_small_for_a_stage_is_not_placed_there():
    stages = (StagePlan(layers=(0, 3), fs=("fs0",), bs=("bs0",), clients=()),
              StagePlan(layers=(3, 4), fs=("fs1",), bs=("bs1",), clients=()))
    me = joiner({s: FAST for s in EVEN}, memory=2.5e6)  # room for 2 layers of 1e6 bytes
    choice = choose(view(stages, EVEN), me, "paper")
    assert choice.stage == 1 and not choice.options[0].fits


def test_when_the_model_cannot_tell_stages_apart_the_paper_rule_decides():
    swarm = view(two_stages(), EVEN)
    # alike stages: wherever the client goes, the other stage bounds the pipeline, so both predict the baseline
    me = joiner({"fs0": link(1, 300), "bs0": link(1, 300), "fs1": link(1, 310), "bs1": link(1, 310)})
    choice = choose(swarm, me, "cost")
    assert choice.options[0].batch_time_s == pytest.approx(choice.options[1].batch_time_s)
    assert choice.stage == 1  # the better bandwidth
    same = joiner({s: link(1, 300) for s in EVEN})
    assert choose(swarm, same, "cost").stage == 0  # a full tie goes to the first stage


def test_unmeasured_links_and_memory_are_filled_in_and_bad_views_refused():
    stages = two_stages(clients0=("c0",))
    swarm = SwarmView(stages=stages, flops={**EVEN, "c0": GFLOPS}, memory={}, links={})  # nobody measured
    me = joiner({"fs0": link(50, 10), "bs0": link(50, 10), "fs1": link(50, 10), "bs1": link(50, 10)})
    choice = choose(swarm, me, "cost")
    assert all(math.isfinite(o.batch_time_s) for o in choice.options) and math.isfinite(choice.baseline_s)
    with pytest.raises(ValueError, match="no compute for c0"):
        choose(SwarmView(stages=stages, flops=EVEN, memory={}, links={}), me, "cost")
    with pytest.raises(ValueError, match="unknown stage choice"):
        choose(swarm, me, "fastest")
    with pytest.raises(ValueError, match="already a member"):
        choose(swarm, Joiner(peer_id="c0", flops=GFLOPS, memory=1e9, links={}), "cost")


# -- a real swarm: clients join by probing -------------------------------------------------------------------------

LIVE_RECIPE = ["--num-stages", "2", "--batch-rows", "2", "--microbatches", "2", "--seq-len", "32", "--epochs", "100000",
               "--compute-power", "1e9"]


@pytest.mark.timeout(600)
def test_clients_without_stage_avoid_the_slow_stage_take_its_state_and_join_its_average(make_swarm):
    swarm = make_swarm("join-probe", LIVE_RECIPE)
    # stage 0's servers sit behind a slow link (latency ~100 ms, ~5 MB/s); stage 1's answer at loopback speed
    for stage, extra in ((0, ["--probe-delay", "0.2"]), (1, [])):
        for role in ("fs", "bs"):
            swarm.peer(f"{role}{stage}", "--role", "server", "--stage", str(stage), "--server-role", role, "--compute",
                       *extra)
    deadline = time.monotonic() + 180
    while not all(s["fs"] and s["bs"] for s in swarm.status()["stages"]) or len(swarm.status()["stages"]) < 2:
        assert time.monotonic() < deadline and not swarm.failed(), "the servers did not come up\n" + swarm.logs()
        time.sleep(1.0)
    while swarm.status()["epoch"] < 1:  # the servers work too: the stage has trained state to hand a joiner
        assert time.monotonic() < deadline and not swarm.failed(), "the swarm did not train\n" + swarm.logs()
        time.sleep(1.0)
    for rule in ("paper", "cost"):
        swarm.peer(f"client-{rule}", "--role", "client", "--stage-choice", rule)
    deadline = time.monotonic() + 180
    while True:
        report = swarm.status()
        clients = {p["peer_id"]: p["stage"] for p in report["peers"] if p["role"] == "client"}
        if len(clients) == 2 and all(stage is not None for stage in clients.values()) \
                and set(clients) <= set(report["stages"][1]["workers"]):
            break
        assert time.monotonic() < deadline and not swarm.failed(), f"clients {clients} not placed\n" + swarm.logs()
        time.sleep(1.0)
    assert set(clients.values()) == {1}, clients
    assert not set(clients) & set(report["stages"][0]["workers"]), report["stages"]
    for rule in ("paper", "cost"):
        log = (swarm.workdir / f"client-{rule}.log").read_text()
        assert f"joining stage 1 of 2 by the {rule} rule" in log, log[-3000:]
        assert "stage 0: mean bandwidth" in log and "stage 1: mean bandwidth" in log, log[-3000:]
    deadline = time.monotonic() + 60
    for rule in ("paper", "cost"):
        # before its first task it took a stage mate's trained state (it is a worker of the stage once announced,
        # which is before it asks), and its rows enter the stage's average
        while "loaded the state of epoch" not in (log := (swarm.workdir / f"client-{rule}.log").read_text()):
            assert time.monotonic() < deadline and not swarm.failed(), log[-3000:]
            time.sleep(0.5)
        first_deposit = log.find("deposited its gradients")
        assert first_deposit == -1 or log.index("loaded the state of epoch") < first_deposit, log[-3000:]
    deadline = time.monotonic() + 180
    for rule in ("paper", "cost"):
        while not re.search(r"stepped epoch \d+ \([1-9]\d* rows, averaged in a group of [2-9]",
                            (swarm.workdir / f"client-{rule}.log").read_text()):
            assert time.monotonic() < deadline and not swarm.failed(), swarm.logs([f"client-{rule}", "fs1"])
            time.sleep(1.0)
