"""benchmarks/cpu_causes.py puts each py-spy stack under the cause it serves: the first in its order whose frames
it passes through, whatever does the work below (framing, hivemind's client); what no cause claims is the rest."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
