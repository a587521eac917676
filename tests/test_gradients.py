"""Gradient equivalence (DESIGN §5): with no faults and no compression, the gradient each stage averages after
one global batch equals the gradient one process computes for the same model on the same batch."""
from __future__ import annotations

import re
import time

import pytest
import torch

from p2ptrain.data import TextSource
from p2ptrain.models import build_stage, model_config

MODEL, ROWS, MICROBATCHES, SEQ, SEED = "llama-tiny", 6, 2, 32, 3
RECIPE = ["--model", MODEL, "--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES),
          "--seq-len", str(SEQ), "--seed", str(SEED), "--epochs", "1"]


def reference_grads() -> dict[str, torch.Tensor]:
    """One process, the whole model, the whole global batch, mean token loss."""
    config = model_config(MODEL)
    model = build_stage(config, start=0, end=config.num_layers, seed=SEED)
    source = TextSource(seq_len=SEQ, seed=SEED)
    for index in range(MICROBATCHES):
        inputs, labels = source.microbatch(0, index, ROWS)
        (model(inputs, labels) / (ROWS * MICROBATCHES * SEQ)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def global_name(name: str, start: int) -> str:
    """A stage's parameter name as in the whole model: its block i is the model's block start + i."""
    return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + start}.", name)


def check_dumps(dump_dir, expected_workers: dict[int, int]) -> None:
    reference = reference_grads()
    seen: dict[int, int] = {}
    covered = set()
    for path in sorted(dump_dir.glob("*.pt")):
        dump = torch.load(path)
        start = dump["layers"][0]
        seen[dump["stage"]] = seen.get(dump["stage"], 0) + 1
        assert dump["grads"], f"{path.name} holds no gradients"
        for name, grad in dump["grads"].items():
            want = reference[global_name(name, start)]
            error = (grad - want).norm() / want.norm()
            assert error < 1e-5, f"{path.name}: {name} differs from one process by {error:.2e} (relative)"
            covered.add(global_name(name, start))
    assert seen == expected_workers
    assert covered == set(reference), f"no stage averaged {sorted(set(reference) - covered)}"


@pytest.mark.timeout(300)
def test_one_worker_per_stage_matches_one_process(make_swarm, tmp_path):
    dumps = tmp_path / "grads"
    swarm = make_swarm("grad1", [*RECIPE, "--dump-grads", str(dumps)])
    for stage in (0, 1):
        swarm.peer(f"fs{stage}", "--role", "server", "--stage", str(stage), "--server-role", "fs")
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", str(stage), "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", str(stage))
    report = swarm.wait_finished(timeout=240)
    check_dumps(dumps, {0: 1, 1: 1})
    for stage in report["epochs"][0]["stages"]:
        assert stage["rows_in_batch"] == ROWS * MICROBATCHES == stage["rows_averaged"]
        assert stage["tasks_redone"] == 0


def stage_complete(report: dict, stage: int, *, fs: int, bs: int, workers: int) -> bool:
    stages = report["stages"]
    if len(stages) <= stage:
        return False
    s = stages[stage]
    return len(s["fs"]) >= fs and len(s["bs"]) >= bs and len(s["workers"]) >= workers


@pytest.mark.timeout(400)
def test_two_fs_two_bs_three_workers_in_a_stage_match_one_process(make_swarm, tmp_path):
    """Stage 1 has 2 FS and 2 BS, and three workers: a client and two servers that also compute (the paper's
    partially collocated parameter servers), so rows are split over workers and segmented over servers."""
    dumps = tmp_path / "grads"
    swarm = make_swarm("grad3", [*RECIPE, "--dump-grads", str(dumps)])
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1-0", "--role", "server", "--stage", "1", "--server-role", "fs", "--compute")
    swarm.peer("fs1-1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1-0", "--role", "server", "--stage", "1", "--server-role", "bs", "--compute")
    swarm.peer("bs1-1", "--role", "server", "--stage", "1", "--server-role", "bs")
    swarm.peer("client1", "--role", "client", "--stage", "1")
    # the data source (stage 0's FS) starts once stage 1 is complete in the DHT, so that all three stage-1 workers
    # (which look for their servers there) are polling before the first rows arrive
    deadline = time.monotonic() + 180
    while not stage_complete(swarm.status(), 1, fs=2, bs=2, workers=1):
        assert time.monotonic() < deadline, "stage 1 did not come up\n" + swarm.logs()
        time.sleep(1.0)
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--compute")
    report = swarm.wait_finished(timeout=360)
    check_dumps(dumps, {0: 1, 1: 3})
    stages = report["epochs"][0]["stages"]
    assert [s["rows_in_batch"] for s in stages] == [ROWS * MICROBATCHES] * 2
    assert [s["rows_averaged"] for s in stages] == [ROWS * MICROBATCHES] * 2
