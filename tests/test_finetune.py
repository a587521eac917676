"""Fine-tuning end to end: a swarm starts from a local Hugging Face checkpoint (`--init-from`), trains, and its data
source exports the result (`--export-to`), which transformers loads. The checkpoint is a random-weight Llama the test
makes with transformers (nothing is downloaded)."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2ptrain.cli import LOOPBACK
from p2ptrain.data import embedded_corpus
from p2ptrain.models.hf_config import read_config

transformers = pytest.importorskip("transformers")


def random_llama(path: Path) -> Path:
    """A random-weight Llama whose output layer is scaled up: its loss (about 1.6 times a fresh model's) shows whether
    a swarm computes with it or with weights of its own."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    return path


def text_loss(path: Path, windows: torch.Tensor) -> float:
    """transformers' mean next-token loss of the checkpoint at `path` on byte windows."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)


@pytest.mark.timeout(480)
def test_a_swarm_started_from_a_checkpoint_exports_a_model_transformers_loads_with_a_lower_loss(make_swarm, tmp_path):
    """The servers start from the checkpoint; the volunteers, given only the swarm's address, have no copy of it and
    download their stages' state from the servers. The swarm's first loss is the checkpoint's. After 10 epochs the
    data source exports; transformers loads the export, its config is the checkpoint's, and its loss on the training
    text is lower than the checkpoint's."""
    checkpoint = random_llama(tmp_path / "llama")
    export = tmp_path / "trained"
    epochs = 10
    swarm = make_swarm("finetune", ["--init-from", str(checkpoint), "--num-stages", "2", "--batch-rows", "4",
                                    "--microbatches", "2", "--seq-len", "64", "--lr", "0.003"])
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    bare = ["--host-maddrs", LOOPBACK, "--initial-peers", *swarm.initial_peers]
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(epochs),
               "--export-to", str(export))
    for stage in (0, 1):
        swarm.start(f"volunteer{stage}", ["--role", "client", "--stage", str(stage), *bare])
    deadline = time.monotonic() + 180
    while sum(len(stage["workers"]) for stage in swarm.status()["stages"]) < 2:
        assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
        time.sleep(1.0)
    report = swarm.wait_finished(timeout=300)
    assert [e["epoch"] for e in report["epochs"] if not e["abandoned"]] == list(range(epochs))
    for stage in (0, 1):
        log = (swarm.workdir / f"volunteer{stage}.log").read_text()
        assert "from a checkpoint" in log and "loaded the state of epoch" in log, log[-3000:]
    assert "exported the model of epoch" in (swarm.workdir / "fs0.log").read_text()
    # a server holds its stage's state: one with no copy of the checkpoint is refused, naming the flag
    refused = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "server", "--stage", "1",
                              "--server-role", "fs", *bare], capture_output=True, text=True, timeout=180)
    assert refused.returncode == 2 and "--init-from None: the run starts from a checkpoint" in refused.stderr, \
        refused.stderr[-2000:]

    assert read_config(export) == read_config(checkpoint)
    data = torch.tensor(list(embedded_corpus().encode()[:32 * 65])).view(32, 65)
    before, after = text_loss(checkpoint, data), text_loss(export, data)
    first = report["epochs"][0]["loss"]
    assert before > 1.5 * math.log(256) and abs(first - before) < 0.2 * before, (first, before)
    assert math.isfinite(after) and after < before - 0.3, (before, after)


def test_the_model_comes_from_the_checkpoint_so_a_model_flag_beside_it_is_refused(tmp_path):
    from p2ptrain.peer import parse_args

    checkpoint = random_llama(tmp_path / "llama")
    command = parse_args(["--role", "client", "--stage", "1", "--init-from", str(checkpoint)])
    assert command.config.model == "llama" and command.config.model_config.num_layers == 4
    with pytest.raises(SystemExit) as refused:
        parse_args(["--role", "client", "--stage", "1", "--init-from", str(checkpoint), "--model", "llama-small"])
    assert refused.value.code == 2
