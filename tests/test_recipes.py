"""The recipe scripts (`recipes/*.py`): a local swarm with no arguments, every flag documented, the commands of a
run across machines, and the plan of the same model config."""
from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.models import MODEL_CONFIGS

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
ADDR = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWFPVJUMLEmqeCF9d9Gc6sc2BGVUDFRjg8CMppWk7apiCR"


def family(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name.upper())


def recipe(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RECIPES / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name", ["llama", "albert"])
def test_every_flag_of_a_recipe_is_documented(name: str) -> None:
    from p2ptrain.recipe_cli import build_parser

    parser = build_parser(family(name))
    undocumented = [action.option_strings for action in parser._actions if not action.help]
    assert not undocumented
    out = recipe(name, "--help")
    assert out.returncode == 0 and "examples:" in out.stdout and "--init-from" in out.stdout
    for size in family(name).sizes:  # every size an example names is one the recipe has
        assert size in out.stdout


@pytest.mark.parametrize("name", ["llama", "albert"])
def test_the_printed_commands_are_peer_command_lines_that_carry_the_recipe_to_the_data_source_only(name: str) -> None:
    from p2ptrain.peer import parse_args

    out = recipe(name, "--print-commands", "--size", "small", "--stages", "3", "--seq-len", "32", "--lr", "0.001",
                 "--initial-peers", ADDR)
    assert out.returncode == 0, out.stderr
    lines = [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("python -m p2ptrain.peer")]
    commands = [parse_args(line[3:]) for line in lines]
    roles = [(c.options.role, c.options.placement and (c.options.placement.stage, c.options.placement.server_role))
             for c in commands]
    assert roles == [("bootstrap", None), ("server", (0, "fs")), ("server", (0, "bs")), ("server", (1, "fs")),
                     ("server", (1, "bs")), ("server", (2, "fs")), ("server", (2, "bs")), ("client", None)]
    source = commands[1]
    assert (source.config.model, source.config.num_stages, source.config.seq_len, source.config.lr) == \
        (f"{name}-small", 3, 32, 0.001)
    for command in commands[2:]:  # the others take the recipe from the swarm
        assert command.options.waits_for_recipe and command.options.network.initial_peers == (ADDR,)


@pytest.mark.parametrize("name, big", [("llama", "llama-33b"), ("albert", "albert-xxlarge")])
def test_the_plan_prices_the_size_the_recipe_trains_and_a_size_too_large_to_train_here_is_refused(name, big) -> None:
    out = recipe(name, "--size", big, "--plan", "peers/paper-sec43-32.toml", "--seq-len", "512")
    assert out.returncode == 0, out.stderr
    assert big in out.stdout and "predicted batch time" in out.stdout
    layers = MODEL_CONFIGS[big].num_layers
    assert f"{layers})" in out.stdout  # the last stage ends at the model's last layer
    refused = recipe(name, "--size", big)
    assert refused.returncode == 2 and "too large to train on one machine" in refused.stderr
    refused = recipe(name, "--seq-len", "4096")
    assert refused.returncode == 2 and "--seq-len 4096" in refused.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "albert"])
def test_a_recipe_trains_a_local_swarm_and_exports_it(tmp_path, name: str) -> None:
    out = recipe(name, "--epochs", "3", "--export-to", str(tmp_path / "trained"), "--workdir",
                 str(tmp_path / "logs"), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 3 epochs" in out.stdout and (tmp_path / "trained" / "config.json").is_file()
    transformers = pytest.importorskip("transformers")
    kind = transformers.AutoModelForCausalLM if name == "llama" else transformers.AutoModelForMaskedLM
    assert kind.from_pretrained(tmp_path / "trained").config.model_type == name
