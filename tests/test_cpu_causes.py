"""benchmarks/cpu_causes.py puts each py-spy stack under the cause it serves: the first in its order whose frames
it passes through, whatever does the work below (framing, hivemind's client); what no cause claims is the rest."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from p2ptrain.cli import flag_value
from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.node.options import NodeOptions

SPEC = importlib.util.spec_from_file_location("cpu_causes", Path(__file__).parents[1] / "benchmarks" / "cpu_causes.py")
cpu_causes = sys.modules.setdefault("cpu_causes", importlib.util.module_from_spec(SPEC))
SPEC.loader.exec_module(cpu_causes)

LOOP = "<module> (p2ptrain/peer.py:9);run (asyncio/runners.py:118);_run_once (asyncio/base_events.py:1922)"
RAW = "\n".join([
    f"{LOOP};rpc_calls (p2ptrain/transport.py:300);BackwardServer.push_outputs (p2ptrain/server/backward.py:60);"
    "deserialize (p2ptrain/compression.py:80) 7",
    f"{LOOP};rpc_calls (p2ptrain/transport.py:300);_read_frame (hivemind/p2p/p2p_daemon.py:410) 3",
    f"{LOOP};_iterate (hivemind/p2p/p2p_daemon.py:300) 2",
    f"{LOOP};rpc_calls (p2ptrain/transport.py:300);StageServer.take_task (p2ptrain/server/base.py:114) 4",
    f"{LOOP};publish_metrics (p2ptrain/node/metrics.py:123);fit (p2ptrain/node/metrics.py:105) 2",
    f"{LOOP};rpc_deposit_grads (p2ptrain/client/averaging.py:111);_bootstrap (threading.py:1002) 5",
    f"{LOOP};take_task (elsewhere/other.py:3) 1",  # a function of the same name outside p2ptrain: no cause
    f"{LOOP} 6",
    "a line that is not py-spy's",
])


def test_each_stack_counts_for_the_first_cause_it_passes_through():
    samples = cpu_causes.parse_raw(RAW)
    assert samples == {
        "activations: push, fetch and forward": 7,
        "framing and codecs (no cause above)": 3,
        "hivemind's P2P client (no cause above)": 2,
        "task pool: take, result, end epoch": 4,
        "metrics records": 2,
        "the stage's replica: deposits, averaging, steps": 5,
        cpu_causes.OTHER: 7,
    }
    assert {cause for cause, _, _ in cpu_causes.CAUSES} >= set(samples) - {cpu_causes.OTHER}


def test_a_thread_caught_at_its_selector_wait_counts_for_no_cause_and_every_cause_has_a_plane():
    raw = "\n".join([
        f"{LOOP};EpollSelector.select (selectors.py:468) 9",
        f"{LOOP};EpollSelector.select (selectors.py:468);_key_from_fd (selectors.py:275) 1",  # at work inside it
        f"{LOOP};BackwardServer._forward (p2ptrain/server/backward.py:150);StageServer.deliver "
        "(p2ptrain/server/base.py:429) 2",
        f"{LOOP};StageServer.deliver (p2ptrain/server/base.py:429) 3",  # a relay spawned on its own
    ])
    assert cpu_causes.parse_raw(raw) == {cpu_causes.WAITING: 9, cpu_causes.OTHER: 1,
                                         "activations: push, fetch and forward": 5}
    assert set(cpu_causes.PLANES) == {cause for cause, _, _ in cpu_causes.CAUSES} | {cpu_causes.OTHER}
    assert set(cpu_causes.PLANES.values()) == {cpu_causes.DATA, cpu_causes.CONTROL, cpu_causes.UNKNOWN}


def test_the_split_by_plane_charges_the_daemons_for_the_bytes_at_their_measured_cost_and_loses_no_core():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import dataplane
    finally:
        sys.path.pop(0)
    causes = dataplane.profile_causes({"samples": {"s0-fs": {"activations: push, fetch and forward": 2,
                                                             "metrics records": 1, cpu_causes.OTHER: 1,
                                                             cpu_causes.WAITING: 6}}, "cpu": None},
                                      roles={"s0-fs": "server"})
    assert causes["samples"] == 4 and causes["waiting_samples"] == 6
    causes["groups"] = {"server": 0.4, "p2pd": 0.3, "dht": 0.05, "bootstrap": 0.01, "averager": 0.0}
    for row in causes["causes"]:
        row["cores"] = 0.4 * row["share"]
    epochs = [{"epoch": e, "seconds": 2.0} for e in range(4)]
    profiled = {"report": {"epochs": epochs, "bytes_sent": {"activations": 80e6, "averaging": 160e6, "control": 1e5}},
                "calls_training": {"fs": {"rpc_take_task": 8.0, "rpc_push_input_grads": 3.0},
                                   "bs": {"rpc_task_result": 2.0, "rpc_push_outputs": 3.0}}}
    rpc = {"transfers": [{"size": "act 256 KiB", "push_cpu_ms_per_mb": {"daemons": 4.0}},
                         {"size": "8 MiB", "push_cpu_ms_per_mb": {"daemons": 2.0}}],
           "small": {"cpu_ms_per_call_by_part": {"caller": 0.5, "callee": 0.5, "daemons": 1.0, "calls": 1000}}}
    split = dataplane.planes(causes, profiled, rpc, warmup=1)
    # 10 MB/s of activations at 4 ms a MB, 20 MB/s of gradients at 2 ms
    assert abs(split["daemons"][cpu_causes.DATA] - 0.08) < 1e-9
    assert abs(split[cpu_causes.CONTROL] - (0.1 + 0.05 + 0.01)) < 1e-9
    assert abs(split[cpu_causes.DATA] + split[cpu_causes.CONTROL] + split[cpu_causes.UNKNOWN] - 0.76) < 1e-9
    # 10 control calls a second (polls and results; not the pushes) at 2 ms each
    assert split["control_calls_per_s"] == 10.0 and abs(split["control_calls_cores"] - 0.02) < 1e-9
    assert abs(split["control_estimate"] - (0.16 + 0.02)) < 1e-9
    assert dataplane.planes(causes, profiled, {"transfers": []}, warmup=1) is None


def test_the_dataplane_report_shows_the_swarm_that_runs_as_p2ptrain_ships_where_the_run_has_it():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import dataplane
    finally:
        sys.path.pop(0)
    behind = flag_value(RuntimeConfig.push_behind)
    runs = [{"keep_streams": "on", "push_behind": behind, "averaging_codec": RunConfig().averaging_codec, "dpu": dpu,
             "keep_freed_memory": freed, "overlap_epochs": overlap, "max_in_flight": NodeOptions.max_in_flight}
            for dpu, freed, overlap in (("off", "on", "off"), ("on", "on", "off"), ("on", "on", "on"))]
    assert dataplane.shown_swarm(runs) is runs[1]  # dpu on, no overlap: the defaults
    assert dataplane.shown_swarm([runs[0], runs[2]]) is runs[2]  # none as shipped: the last
    more = {**runs[1], "max_in_flight": NodeOptions.max_in_flight + 1}
    assert dataplane.shown_swarm([runs[1], more]) is runs[1]


def test_the_dataplane_ratio_leaves_out_the_swarms_epochs_that_a_pause_for_the_one_process_touched():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import dataplane
    finally:
        sys.path.pop(0)
    # epochs of 1 s closing at 11, 12, ...; the swarm stood still over [13.5, 15.5], so epoch 3 (12-13) ran before it,
    # epoch 4 (its 3 s run from 13 to 16) across it, epoch 5 (16-17) is the first after it, epoch 6 undisturbed
    epochs = [{"epoch": e, "seconds": 3.0 if e == 4 else 1.0} for e in range(2, 7)]
    closed_at = {2: 11.0, 3: 12.0, 4: 16.0, 5: 17.0, 6: 18.0}
    assert dataplane.disturbed(epochs, closed_at, [(13.5, 15.5)]) == {4, 5}
    assert dataplane.disturbed(epochs, closed_at, []) == set()
    assert dataplane.outside(10.0, 18.0, [(13.5, 15.5)]) == [(10.0, 13.5), (15.5, 18.0)]
    assert dataplane.outside(10.0, 18.0, [(9.0, 11.0), (17.0, 19.0)]) == [(11.0, 17.0)]
    assert dataplane.outside(10.0, 18.0, []) == [(10.0, 18.0)]
