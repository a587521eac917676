"""Where and in what a stage computes (`--device`, `--precision`): bf16 under autocast on fp32 master weights, the
host as the only place tensors travel from, and a swarm in bf16 against one in fp32. Tests marked `cuda` run where
torch sees a CUDA device and are skipped, with the reason shown, elsewhere."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2ptrain.client.device import autocast, resolve_device, to_device, to_host
from p2ptrain.config import ConfigError, RunConfig
from p2ptrain.models import build_stage, model_config
from p2ptrain.state.params import StageParams


def test_device_names_resolve_or_say_what_to_use() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device.*--device cpu or auto"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="precision"):
        RunConfig(precision="fp8")


def test_a_peer_asked_for_a_device_this_machine_lacks_exits_2_naming_the_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "client", "--device", "tpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--device" in out.stderr and "auto, cpu, cuda or cuda:N" in out.stderr


def test_a_bf16_stage_computes_in_bf16_on_fp32_parameters() -> None:
    """Autocast rounds the matmuls' inputs only: the loss is near fp32's, and the parameter gradients and the master
    copy the optimizer steps stay fp32; what travels is fp32 on the host."""
    config = model_config("llama-small")
    stage = build_stage(config, start=4, end=8, seed=0)
    hidden = torch.randn(2, 32, config.hidden_size, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    device = torch.device("cpu")
    losses = {}
    for precision in ("fp32", "bf16"):
        with autocast(device, precision):
            loss = stage(hidden, labels)
            projected = stage.layers[0].attn.q_proj(hidden)
        grads = torch.autograd.grad(loss, [p for p in stage.parameters() if p.requires_grad])
        assert all(g.dtype == torch.float32 for g in grads)
        assert projected.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        losses[precision] = float(loss)
    assert losses["bf16"] != losses["fp32"]  # it did compute in bf16
    assert abs(losses["bf16"] - losses["fp32"]) < 0.01 * losses["fp32"]
    master = StageParams(model=stage, config=RunConfig(model="llama-small", precision="bf16"))
    assert all(p.dtype == torch.float32 for p in master.module.parameters())
    assert to_host(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert to_host(torch.ones(2, dtype=torch.int64)).dtype == torch.int64


def _final_loss(tmp_path: Path, precision: str, epochs: int) -> tuple[float, float]:
    report = tmp_path / f"{precision}.json"
    out = subprocess.run([sys.executable, "-m", "p2ptrain.launch", "--model", "llama-small", "--epochs", str(epochs),
                          "--precision", precision, "--device", "cpu", "--run-id", f"precision-{precision}",
                          "--workdir", str(tmp_path / precision), "--report", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(report.read_text())
    assert status["recipe"]["config"]["precision"] == precision  # what the swarm carried and trained in
    return status["epochs"][0]["loss"], status["loss"]


@pytest.mark.timeout(400)
def test_a_bf16_swarm_trains_llama_small_within_3_percent_of_the_fp32_swarm(tmp_path) -> None:
    """Two local swarms (launcher: 2 stages, FS, BS and a client each) train llama-small on the same batches, one
    in fp32 and one in bf16: the loss after 8 epochs is within 3% of each other, and it fell."""
    first32, last32 = _final_loss(tmp_path, "fp32", 8)
    first16, last16 = _final_loss(tmp_path, "bf16", 8)
    assert last32 < first32 - 1.0 and last16 < first16 - 1.0
    assert abs(last16 - last32) <= 0.03 * last32, (last16, last32)


@pytest.mark.cuda
def test_a_stage_on_cuda_steps_there_and_travels_from_the_host() -> None:
    """On a CUDA device: the stage, its master copy and optimizer state live there; inputs come from the host,
    results and snapshots go back to it, and a snapshot loads back into a fresh holder."""
    device = resolve_device("cuda")
    config = RunConfig(model="llama-tiny", precision="bf16")
    stage = build_stage(config.model_config, start=0, end=2, seed=0).to(device)
    master = StageParams(model=stage, config=config)
    ids = to_device(torch.randint(0, 256, (2, 16)), device)
    with autocast(device, config.precision):
        outputs = stage(ids)
    params = [p for p in stage.parameters() if p.requires_grad]
    grads = torch.autograd.grad(outputs.float().sum(), params)
    assert all(g.device.type == "cuda" and g.dtype == torch.float32 for g in grads)
    master.step([to_host(g) for g in grads], epoch=0)
    epoch, model_state, optimizer_state = master.snapshot()
    assert epoch == 1 and all(t.device.type == "cpu" for t in model_state.values())
    other = StageParams(model=stage, config=config)
    other.load(model_state=model_state, optimizer_state=optimizer_state, epoch=epoch)
    assert other.digest() == master.digest()
    assert to_host(outputs).device.type == "cpu" and to_host(outputs).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_a_swarm_on_cuda_trains(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "p2ptrain.launch", "--epochs", "4", "--device", "cuda",
                          "--precision", "bf16", "--run-id", "precision-cuda", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 4 epochs" in out.stdout
