"""fp16 with a dynamic loss scale (`--precision fp16`): the scale a stage's holders keep and carry in their state, the
recipes it cannot run with, and a swarm in which one worker's gradients overflow: every worker and server replica of
every stage skips that epoch alike, read from the stage's average and the data source's answer, never decided alone."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from p2ptrain.client.worker import OVERFLOW_EPOCH
from p2ptrain.config import ConfigError, RunConfig
from p2ptrain.models import build_stage
from p2ptrain.state.codec import encode_state
from p2ptrain.state.params import StageParams

CLIENTS = {"c0a": "0", "c0b": "0", "c1a": "1", "c1b": "1"}
# far below where llama-tiny's gradients overflow in this swarm (seen from 2^16 on), so that only the fault does
START_SCALE = 2.0**12


@pytest.mark.parametrize(("fields", "field"), [({"dpu": True}, "dpu"), ({"average_every": 4}, "average_every")])
def test_fp16_refuses_what_would_decide_its_skips_per_worker(fields: dict, field: str) -> None:
    with pytest.raises(ConfigError, match="fp16") as error:
        RunConfig(precision="fp16", **fields)
    assert error.value.field == field
    for bad in ({"loss_scale": 0.0}, {"loss_scale": float("inf")}, {"loss_scale_growth": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RunConfig(precision="fp16", **bad)


def test_the_loss_scale_is_part_of_the_stage_state_that_mates_download_and_checkpoints_keep() -> None:
    config = RunConfig(precision="fp16", loss_scale=1024.0, loss_scale_growth=2)
    held = StageParams(model=build_stage(config.model_config, start=0, end=1, seed=0), config=config)
    held.loss_scale.update(overflow=True)
    held.loss_scale.update(overflow=False)
    assert (held.loss_scale.value, int(held.loss_scale.clean)) == (512.0, 1)
    epoch, model_state, optimizer_state = held.snapshot()
    joiner = StageParams(model=build_stage(config.model_config, start=0, end=1, seed=0), config=config)
    assert joiner.loss_scale.value == 1024.0
    joiner.load(**dict(zip(("model_state", "optimizer_state"),
                           joiner.decode(encode_state(model_state, optimizer_state)))), epoch=epoch)
    assert (joiner.loss_scale.value, int(joiner.loss_scale.clean)) == (512.0, 1)
    joiner.loss_scale.update(overflow=False)  # the second clean epoch in a row: the scale doubles
    assert joiner.loss_scale.value == 1024.0
    assert StageParams(model=build_stage(config.model_config, start=0, end=1, seed=0),
                       config=RunConfig()).loss_scale is None  # fp32 and bf16 keep none


def test_llama_computes_finite_fp16_gradients_close_to_fp32() -> None:
    """RMSNorm normalizes in fp32 (as Hugging Face's does): in fp16 the backward of its rsqrt overflowed on the small
    activations of a fresh model, making every gradient before it nan even at loss scale 1."""
    config = RunConfig(model="llama-small")
    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    grads = {}
    for dtype in (torch.float32, torch.float16):
        model = build_stage(config.model_config, start=0, end=config.model_config.num_layers, seed=0).to(dtype)
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float16):
            loss = model(ids[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
        params = [p for p in model.parameters() if p.requires_grad]
        grads[dtype] = torch.autograd.grad(loss * (1024.0 if dtype == torch.float16 else 1.0), params)
    for half, full in zip(grads[torch.float16], grads[torch.float32]):
        assert torch.isfinite(half).all()
        assert torch.linalg.vector_norm(half.float() / 1024.0 - full) <= 0.05 * torch.linalg.vector_norm(full) + 1e-6


@pytest.mark.timeout(420)
def test_an_fp16_overflow_is_skipped_by_every_worker_of_every_stage_alike(make_swarm) -> None:
    """Two stages with two clients each and a state-holding FS, in fp16; one stage-1 client's gradients overflow in
    one task of epoch OVERFLOW_EPOCH (`--fault overflow`, inf in a gradient as fp16 makes it). Every holder of both
    stages skips that epoch (its stage mate and the other stage's workers among them, whose own gradients were
    finite), the loss scale halves after it and is the same everywhere, the holders' parameters agree after every
    epoch, and the loss falls."""
    epochs = 8
    swarm = make_swarm("fp16", ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "4", "--microbatches",
                                "4", "--seq-len", "32", "--precision", "fp16", "--loss-scale", str(START_SCALE)])
    swarm.start_two_stages(CLIENTS, epochs=epochs, client_args={"c1b": ["--fault", "overflow"]})
    report = swarm.wait_finished(timeout=300)
    trained = [e for e in report["epochs"] if not e["abandoned"]]
    assert [e["epoch"] for e in trained] == list(range(epochs)), report["epochs"]

    skipped = [e["epoch"] for e in trained if e["stages"][0]["steps_skipped"]]
    assert OVERFLOW_EPOCH in skipped, skipped
    logs = {name: (swarm.workdir / f"{name}.log").read_text() for name in (*CLIENTS, "fs0", "fs1")}
    averaged = {name: re.search(rf"averaging epoch {OVERFLOW_EPOCH} \(\d+ rows\) in a group of (\d+)", log)
                for name, log in logs.items()}
    # the holders in that epoch's group, as the FS's replica (a member of every group) counts them: stage 1's 2 clients
    # and its FS; stage 0's FS and its clients that found the data source by then, which under load may take a stage-0
    # client several epochs (the swarm runs one in about 0.5 s)
    groups = [int(averaged[fs].group(1)) for fs in ("fs0", "fs1")]
    assert groups[1] == 3 and groups[0] == 1 + sum(bool(averaged[c]) for c in ("c0a", "c0b")) >= 2, groups
    for epoch in trained:
        for stage in epoch["stages"]:
            # the FS's replica and the clients in the epoch's group: a stage-0 client finds the data source (its
            # stage's FS) only once that is up and feeding, and may miss the first epoch's group, as in the int8 test
            assert stage["digests"] >= 2 and stage["digests_agree"], epoch
            assert stage["steps_skipped"] == (stage["digests"] if epoch["epoch"] in skipped else 0), epoch
        if epoch["epoch"] == OVERFLOW_EPOCH:  # every holder in the epoch's group skipped it
            assert [stage["digests"] for stage in epoch["stages"]] == groups, (epoch, groups)
    scales = [e["loss_scale"] for e in trained]
    expected = [START_SCALE]
    for epoch in range(epochs - 1):
        expected.append(expected[-1] / 2 if epoch in skipped else expected[-1])
    assert scales == expected, (scales, skipped)

    overflowed = re.compile(rf"fp16 gradients of epoch {OVERFLOW_EPOCH} overflowed")
    assert overflowed.search(logs["c1b"]), logs["c1b"][-3000:]
    for name in ("c1a", "c0a", "c0b"):  # finite gradients here: the skip came from the stage and the data source
        assert not overflowed.search(logs[name]), logs[name][-3000:]
        skip = re.search(rf"skipped the step of epoch {OVERFLOW_EPOCH}: the swarm's fp16 gradients overflowed",
                         logs[name])
        assert bool(skip) == bool(averaged[name]), logs[name][-3000:]
    losses = [e["loss"] for e in trained]
    assert losses[-1] < losses[0] - 0.3, losses
    # the servers' records count the requests they served, the workers' task polls among them
    assert any(calls.get("rpc_take_task", 0) > 0 for calls in report["calls_served_by_peer"].values())


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_an_fp16_swarm_on_cuda_trains(tmp_path) -> None:
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "p2ptrain.launch", "--epochs", "6", "--device", "cuda",
                          "--precision", "fp16", "--run-id", "fp16-cuda", "--workdir", str(tmp_path / "logs"),
                          "--report", str(report)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(report.read_text())
    assert status["recipe"]["config"]["precision"] == "fp16"
    assert status["loss"] < status["epochs"][0]["loss"] - 0.5
    assert all(stage["digests_agree"] for epoch in status["epochs"] for stage in epoch["stages"])
