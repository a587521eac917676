"""Gradient equivalence (docs/design.md §5): with no faults and no compression, the gradient each stage averages after
one global batch equals the gradient one process computes for the same model on the same batch; clipped by the
global norm across stages, and stepped at the schedule's learning rate, it gives the same parameters too."""
from __future__ import annotations

import random
import re
import time

import pytest
import torch

from p2ptrain.config import RunConfig
from p2ptrain.data import TextSource
from p2ptrain.models import build_stage, model_config

MODEL, ROWS, MICROBATCHES, SEQ, SEED = "llama-tiny", 6, 2, 32, 3
# averaging in fp32: the stages' steps are compared with one process's to 1e-5, past int8's rounding
RECIPE = ["--model", MODEL, "--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES),
          "--seq-len", str(SEQ), "--seed", str(SEED), "--epochs", "1", "--averaging-codec", "fp32"]


# an lr schedule whose first epoch runs at a third of the peak, and a clip far below the batch's gradient norm
CLIPPED = ["--lr", "0.003", "--warmup-epochs", "2", "--clip-norm", "0.05"]
CLIP_NORM, FIRST_LR = 0.05, 0.003 / 3


def reference_step(*, lr: float, clip_norm: float = 0.0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole model, the whole global batch, mean token loss: the gradient (clipped by its norm
    if `clip_norm`) and the parameters after one AdamW step at `lr`."""
    config = model_config(MODEL)
    model = build_stage(config, start=0, end=config.num_layers, seed=SEED)
    optimizer = model.configure_optimizer(lr=lr, weight_decay=RunConfig().weight_decay)
    source = TextSource(seq_len=SEQ, seed=SEED)
    for index in range(MICROBATCHES):
        inputs, labels = source.microbatch(0, index, ROWS)
        (model(inputs, labels) / (ROWS * MICROBATCHES * SEQ)).backward()
    if clip_norm:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        assert norm > 2 * clip_norm, "the clip must be active for the test to mean anything"
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()
    return grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def global_name(name: str, start: int) -> str:
    """A stage's parameter name as in the whole model: its block i is the model's block start + i."""
    return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + start}.", name)


def check_dumps(dump_dir, expected_workers: dict[int, int], *, lr: float, clip_norm: float = 0.0,
                same_params: bool = False, rounding_floor: float = 0.0) -> None:
    """Every worker's dump of epoch 0 (the run's first global batch): its averaged gradient against one process's;
    the parameters it stepped to against those of its stage mates, and with `same_params` against one process's.

    One process's parameters are only comparable entry for entry where the summation order matches (a worker per
    stage): AdamW's first step moves each weight by about ±lr whatever its gradient's size, so a gradient entry that
    cancels to near zero takes the sign of its rounding, which another order of the same sums may flip. With
    `rounding_floor`, the entries whose gradient in one process is below that fraction of its tensor's largest are
    left out of that comparison (with several workers per stage, a few per tensor, around 1e-5 of the largest and
    below, flip)."""
    reference, reference_params = reference_step(lr=lr, clip_norm=clip_norm)
    seen: dict[int, int] = {}
    covered = set()
    stepped: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(dump_dir.glob("*-epoch0.pt")):
        dump = torch.load(path)
        start = dump["layers"][0]
        seen[dump["stage"]] = seen.get(dump["stage"], 0) + 1
        assert dump["grads"], f"{path.name} holds no gradients"
        for name, grad in dump["grads"].items():
            error = relative_error(grad, reference[global_name(name, start)])
            assert error < 1e-5, f"{path.name}: {name} differs from one process by {error:.2e} (relative)"
            covered.add(global_name(name, start))
        mate = stepped.setdefault(dump["stage"], dump["params"])
        for name, param in dump["params"].items():
            error = relative_error(param, mate[name])
            assert error < 1e-6, f"{path.name}: parameter {name} differs from a stage mate's by {error:.2e}"
            if same_params:
                want, grad = reference_params[global_name(name, start)], reference[global_name(name, start)]
                kept = grad.abs() >= rounding_floor * grad.abs().max()
                error = relative_error(param[kept], want[kept])
                assert error < 1e-5, f"{path.name}: parameter {name} differs from one process by {error:.2e}"
    assert all(seen.get(stage, 0) >= count for stage, count in expected_workers.items()), seen
    assert covered == set(reference), f"no stage averaged {sorted(set(reference) - covered)}"


@pytest.mark.timeout(300)
def test_one_worker_per_stage_clipped_by_the_global_norm_matches_one_process(make_swarm, tmp_path):
    """Each stage knows only its own gradient; the norm that clips it is the whole model's, from every stage."""
    dumps = tmp_path / "grads"
    held_out = tmp_path / "held-out.txt"
    held_out.write_text(" ".join(random.Random(4).choice(["the", "swarm", "of", "volunteers", "trains", "a", "model",
                                                          "across", "slow", "links", "."]) for _ in range(3000)))
    swarm = make_swarm("grad1", [*RECIPE, *CLIPPED, "--dump-grads", str(dumps)])
    for stage in (0, 1):
        evaluation = ["--eval-data", str(held_out), "--eval-every", "1", "--eval-rows", "16"] if stage == 0 else []
        swarm.peer(f"fs{stage}", "--role", "server", "--stage", str(stage), "--server-role", "fs", *evaluation)
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", str(stage), "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", str(stage))
    report = swarm.wait_finished(timeout=240)
    # the FS and BS of each stage hold its state and step with its client; one still starting when the epoch closed
    # is not in its group and downloads the state instead, so only the clients' steps are certain
    wait_for_steps(swarm, dumps, 2)
    check_dumps(dumps, {0: 1, 1: 1}, lr=FIRST_LR, clip_norm=CLIP_NORM, same_params=True)
    # the held-out loss the swarm computed through its stages' servers is one process's after the same step
    _, params = reference_step(lr=FIRST_LR, clip_norm=CLIP_NORM)
    config = model_config(MODEL)
    model = build_stage(config, start=0, end=config.num_layers, seed=SEED)
    model.load_state_dict(params, strict=False)
    source = TextSource(path=str(held_out), seq_len=SEQ, seed=SEED)
    with torch.no_grad():
        windows = [source.microbatch(0, index, rows) for index, rows in enumerate([ROWS, ROWS, 16 - 2 * ROWS])]
        want = sum(float(model(ids, labels)) for ids, labels in windows) / (16 * SEQ)
    got = report["epochs"][0]["eval_loss"]
    assert got is not None and abs(got - want) < 1e-5 * want, (got, want)
    assert report["eval_loss"] == got
    for stage in report["epochs"][0]["stages"]:
        assert stage["rows_in_batch"] == ROWS * MICROBATCHES == stage["rows_averaged"]
        assert stage["tasks_redone"] == 0


def wait_for_steps(swarm, dumps, count: int) -> None:
    """With delayed parameter updates, a stage's last step lands after the data source saw its epoch close."""
    deadline = time.monotonic() + 60
    while len(list(dumps.glob("*.pt"))) < count:
        assert time.monotonic() < deadline, "the workers did not step\n" + swarm.logs()
        time.sleep(0.5)


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
    wait_for_steps(swarm, dumps, 4)  # the servers that do not compute hold the state too, if in time for the group
    check_dumps(dumps, {0: 1, 1: 3}, lr=RunConfig().lr)
    # the stage's three workers (and its state-holding servers in the group) published digests of the same
    # parameters, and no round failed
    deadline = time.monotonic() + 60
    while (stage := swarm.status()["epochs"][0]["stages"][1])["digests"] < 3:
        assert time.monotonic() < deadline, f"stage 1 published {stage['digests']} digests\n" + swarm.logs()
        time.sleep(1.0)
    assert stage["digests_agree"] and stage["rounds_failed"] == 0
    stages = report["epochs"][0]["stages"]
    assert [s["rows_in_batch"] for s in stages] == [ROWS * MICROBATCHES] * 2
    assert [s["rows_averaged"] for s in stages] == [ROWS * MICROBATCHES] * 2
