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

from p2ptrain.client.device import DTYPES, autocast, place, resolve_device, to_device, to_host
from p2ptrain.client.worker import Worker
from p2ptrain.config import ConfigError, RunConfig, RuntimeConfig
from p2ptrain.live.probe import available_memory, measure_block_compute
from p2ptrain.models import build_stage
from p2ptrain.planner.presets import PRECISIONS, run_spec
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_peer_asked_for_cuda_on_a_machine_without_it_exits_2_naming_the_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "client", "--device", "cuda",
                          "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--device cuda" in out.stderr and "no CUDA device" in out.stderr, out.stderr[-2000:]


def test_live_planning_measures_where_and_in_what_a_peer_computes() -> None:
    """A peer without a stage measures one block on its device at the run's precision, and announces the memory
    free there (host RAM here; on a GPU, `torch.cuda.mem_get_info`)."""
    cpu = torch.device("cpu")
    for precision in ("fp32", "bf16"):
        assert measure_block_compute(RunConfig(model="llama-small", precision=precision), device=cpu) > 0
    assert 0 < available_memory(cpu)


@pytest.mark.cuda
def test_live_planning_measures_a_cuda_device() -> None:
    device = resolve_device("cuda")
    assert available_memory(device) == pytest.approx(torch.cuda.mem_get_info(device)[0], rel=0.05)
    assert measure_block_compute(RunConfig(model="llama-small", precision="bf16"), device=device) > 0


def test_a_bf16_stage_computes_in_bf16_beside_an_fp32_master_copy() -> None:
    """A bf16 worker's model holds bf16 weights and computes under autocast (norms and softmax in fp32): its loss is
    near fp32's; the master copy the optimizer steps is fp32, built before the cast; what travels is fp32."""
    config = RunConfig(model="llama-small", precision="bf16")
    hidden = torch.randn(2, 32, 256, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    device = torch.device("cpu")
    losses = {}
    for precision in ("fp32", "bf16"):
        stage = build_stage(config.model_config, start=4, end=8, seed=0)
        master = StageParams(model=stage, config=config)
        model = place(stage, device, precision)
        with autocast(device, precision):
            loss = model(hidden, labels)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        assert all(p.dtype == dtype for p in params) and all(g.dtype == dtype for g in grads)
        assert all(p.dtype == torch.float32 for p in master.trainable)
        losses[precision] = float(loss)
    assert losses["bf16"] != losses["fp32"]  # it did compute in bf16
    assert abs(losses["bf16"] - losses["fp32"]) < 0.01 * losses["fp32"]
    assert to_host(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert to_host(torch.ones(2, dtype=torch.int64)).dtype == torch.int64


@pytest.mark.parametrize("model", ["llama-small", "albert-small"])
def test_recompute_keeps_each_blocks_input_only_and_gives_the_same_gradients(model: str) -> None:
    """`--recompute`: what a forward keeps for backward shrinks to the blocks' inputs (measured with autograd's
    saved-tensor hooks), and the gradients are those of a plain forward."""
    config = RunConfig(model=model).model_config
    stage = build_stage(config, start=1, end=config.num_layers - 1, seed=0)
    hidden = torch.randn(2, 64, config.hidden_size, generator=torch.Generator().manual_seed(1))
    params = [p for p in stage.parameters() if p.requires_grad]
    kept, grads = {}, {}
    for recompute in (False, True):
        stage.recompute = recompute
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            inputs = hidden.clone().requires_grad_(True)
            out = stage(inputs)
        kept[recompute] = sum(t.numel() * t.element_size() for t in {id(t): t for t in saved}.values())
        grads[recompute] = torch.autograd.grad(out.square().sum(), [inputs, *params])
    assert kept[True] < 0.25 * kept[False], kept
    for plain, recomputed in zip(grads[False], grads[True]):
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-6)


def _one_layer_worker(config: RunConfig, device: torch.device) -> Worker:
    """A worker of a stage of one middle layer, as a peer builds it, that has stepped once (so its optimizer state
    exists); it reaches no server: none of its calls are made."""
    stage = build_stage(config.model_config, start=1, end=2, seed=config.seed)
    worker = Worker(worker_id="w", stage=1, config=config, settings=RuntimeConfig(), model=stage, averager=None,
                    caller=None, servers=lambda: ([], []), compute=1.0, device=device)
    worker.master.step([torch.zeros_like(p) for p in worker.master.trainable], epoch=0)
    return worker


def _allocated(worker: Worker) -> dict[str, int]:
    """Bytes of the layer's parameters and optimizer state a worker holds, by what holds them."""
    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    # bitsandbytes' 8-bit AdamW keeps two quantization maps that all its parameters share (2 KiB in all, which the
    # planner leaves out)
    state = [value for entries in worker.master.optimizer.state.values() for name, value in entries.items()
             if isinstance(value, torch.Tensor) and name not in ("qmap1", "qmap2")]
    return {"weights": size(worker.params), "gradients": size(worker.accumulated),
            "master": size(worker.master.trainable), "optimizer": size(state)}


@pytest.mark.parametrize("offload", [False, True], ids=["on the device", "offloaded"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "lamb"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_planners_memory_per_layer_is_what_a_worker_allocates(precision: str, optimizer: str,
                                                                  offload: bool) -> None:
    """The planner's M for a run (`run_spec`: its precision, optimizer and offload) is the bytes a worker of one
    layer allocates for its parameters and optimizer state (its weights, accumulated gradients, master copy and
    optimizer state; with the optimizer offloaded, the weights alone stay on the device), plus one row's
    checkpointed input, which the cost model adds."""
    config = RunConfig(model="llama-small", precision=precision, optimizer=optimizer, offload_optimizer=offload)
    worker = _one_layer_worker(config, torch.device("cpu"))
    allocated = _allocated(worker)
    spec = run_spec(config)
    hidden, seq = config.model_config.hidden_size, config.model_config.max_seq_len
    layer = spec.memory_bytes_per_layer - hidden * seq * PRECISIONS[precision]
    assert layer == (allocated["weights"] if offload else sum(allocated.values())), allocated
    assert all(p.dtype == DTYPES[precision] for p in worker.params)
    assert all(p.dtype == torch.float32 for p in worker.master.trainable)
    if optimizer == "adamw8bit":  # the matrices' moments are 8-bit
        assert allocated["optimizer"] < 0.3 * 8 * sum(p.numel() for p in worker.master.trainable)


def test_memory_per_layer_follows_precision_optimizer_and_offload() -> None:
    """Each of the three choices changes M, as the runtime's allocations do (above)."""
    def m(**choices) -> float:
        return run_spec(RunConfig(model="llama-small", **choices)).memory_bytes_per_layer
    base = m()
    assert m(precision="bf16") < base and m(optimizer="adamw8bit") < 0.75 * base
    assert m(offload_optimizer=True) < 0.3 * base
    assert m(precision="bf16", optimizer="adamw8bit", offload_optimizer=True) < m(offload_optimizer=True)


def _final_loss(tmp_path: Path, precision: str, epochs: int) -> tuple[float, float]:
    report = tmp_path / f"{precision}.json"
    out = subprocess.run([sys.executable, "-m", "p2ptrain.launch", "--model", "llama-small", "--epochs", str(epochs),
                          "--precision", precision, "--device", "cpu", "--run-id", f"precision-{precision}",
                          "--workdir", str(tmp_path / precision), "--report", str(report)],
                         capture_output=True, text=True, timeout=600)  # bf16 without native support: 330 s
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(report.read_text())
    assert status["recipe"]["config"]["precision"] == precision  # what the swarm carried and trained in
    return status["epochs"][0]["loss"], status["loss"]


@pytest.mark.timeout(1300)
def test_a_bf16_swarm_trains_llama_small_within_3_percent_of_the_fp32_swarm(tmp_path) -> None:
    """Two local swarms (launcher: 2 stages, FS, BS and a client each) train llama-small on the same batches, one
    in fp32 and one in bf16: the loss after 8 epochs is within 3% of each other, and it fell."""
    first32, last32 = _final_loss(tmp_path, "fp32", 8)
    first16, last16 = _final_loss(tmp_path, "bf16", 8)
    assert last32 < first32 - 1.0 and last16 < first16 - 1.0
    assert abs(last16 - last32) <= 0.03 * last32, (last16, last32)


@pytest.mark.timeout(300)
def test_a_swarm_set_for_a_small_card_trains(tmp_path) -> None:
    """bf16 weights, 8-bit AdamW, the optimizer offloaded and activations recomputed, all at once, in a local swarm:
    it trains, and the swarm carries the recipe's choices."""
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "p2ptrain.launch", "--epochs", "6", "--precision", "bf16",
                          "--optimizer", "adamw8bit", "--offload-optimizer", "--recompute", "--lr", "1e-2",
                          "--run-id", "small-card", "--workdir", str(tmp_path / "logs"), "--report", str(report)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(report.read_text())
    recipe = status["recipe"]["config"]
    assert (recipe["precision"], recipe["optimizer"], recipe["offload_optimizer"]) == ("bf16", "adamw8bit", True)
    assert status["loss"] < status["epochs"][0]["loss"] - 0.5
    assert all(stage["digests_agree"] for epoch in status["epochs"] for stage in epoch["stages"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says on a machine without CUDA")
@pytest.mark.parametrize("script", ["gpu.py", "transfers.py"])
def test_the_gpu_benchmarks_say_there_is_no_gpu_and_exit_0(tmp_path, script: str) -> None:
    out = subprocess.run([sys.executable, f"benchmarks/{script}", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0 and "no CUDA device" in out.stdout and not list(tmp_path.iterdir())


@pytest.mark.cuda
def test_a_stage_on_cuda_steps_there_and_travels_from_the_host() -> None:
    """On a CUDA device: the stage, its master copy and optimizer state live there; inputs come from the host,
    results and snapshots go back to it, and a snapshot loads back into a fresh holder."""
    device = resolve_device("cuda")
    assert device == torch.device("cuda", torch.cuda.current_device())  # indexed, as its tensors report it
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
@pytest.mark.parametrize("offload", [False, True], ids=["on the device", "offloaded"])
def test_the_planners_memory_per_layer_is_what_a_cuda_worker_allocates_there(offload: bool) -> None:
    """On a CUDA device, the bytes a one-layer worker allocates there are the planner's M (its parameters and
    optimizer state; offloaded, its weights alone), within the allocator's rounding."""
    device = resolve_device("cuda")
    config = RunConfig(model="llama-small", precision="bf16", optimizer="adamw8bit", offload_optimizer=offload)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    worker = _one_layer_worker(config, device)
    torch.cuda.synchronize(device)
    spec = run_spec(config)
    hidden, seq = config.model_config.hidden_size, config.model_config.max_seq_len
    layer = spec.memory_bytes_per_layer - hidden * seq * PRECISIONS[config.precision]
    stage_buffers = sum(b.numel() * b.element_size() for b in worker.model.buffers())
    assert torch.cuda.memory_allocated(device) - before - stage_buffers == pytest.approx(layer, rel=0.02)
    assert all(p.device == device for p in worker.params)
    assert all(t.device.type == ("cpu" if offload else "cuda") for t in worker.accumulated + worker.master.trainable)


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_a_swarm_on_cuda_trains(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "p2ptrain.launch", "--epochs", "4", "--device", "cuda",
                          "--precision", "bf16", "--run-id", "precision-cuda", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 4 epochs" in out.stdout
