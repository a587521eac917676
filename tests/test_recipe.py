"""The recipe the swarm carries: what it holds, how a peer adopts it, and which given values it refuses."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from p2ptrain.config import ConfigError, RunConfig
from p2ptrain.models.configs import LlamaConfig, RopeScaling, config_from_dict, config_to_dict
from p2ptrain.recipe import Recipe, RecipeConflict, adopt, fingerprint


def test_a_recipe_travels_as_plain_values_and_comes_back_whole(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_text("some training text " * 20)
    config = RunConfig(run_id="run-7", model="llama-small", num_stages=4, seq_len=32, lr=1e-3, data=str(data),
                       average_every=4, averaging_codec="int8")
    recipe = Recipe.of(config)
    value = recipe.to_value()
    assert str(tmp_path) not in repr(value)  # no path of the publisher's machine travels
    assert value["data"] == fingerprint(str(data)) and value["tokenizer"] is None
    assert value["model"]["family"] == "llama" and value["model"]["hidden_size"] == 256
    back = Recipe.from_value(value)
    assert back == recipe and back.model == config.model_config
    assert back.config.data is None and back.config.architecture == config.model_config


def test_model_configs_round_trip_through_plain_dicts() -> None:
    scaled = LlamaConfig(head_dim=12, rope_scaling=RopeScaling(kind="llama3", factor=8.0), tie_embeddings=True)
    assert config_from_dict(config_to_dict(scaled)) == scaled
    with pytest.raises(ValueError, match="model family 'gpt' is unknown"):
        config_from_dict({"family": "gpt"})
    with pytest.raises(ValueError, match="not a llama config"):
        config_from_dict({**config_to_dict(scaled), "layers": 3})


def test_a_peer_given_nothing_adopts_the_recipe_and_a_conflicting_value_is_refused_naming_both() -> None:
    recipe = Recipe.of(RunConfig(model="llama-small", seq_len=32, microbatches=6))
    assert adopt(recipe, {}) == recipe.config
    assert adopt(recipe, {"seq_len": 32, "model": "llama-small"}) == recipe.config  # agreeing values are fine
    with pytest.raises(RecipeConflict) as refused:
        adopt(recipe, {"microbatches": 6, "seq_len": 64})
    assert (refused.value.field, refused.value.value, refused.value.carried) == ("seq_len", 64, 32)
    assert "the swarm's recipe has 32" in str(refused.value) and isinstance(refused.value, ConfigError)


def test_a_peers_own_data_must_be_the_runs_by_content_not_by_path(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine, theirs, other = tmp_path / "a" / "text.txt", tmp_path / "b" / "copy.txt", tmp_path / "b" / "other.txt"
    mine.write_text("the run's text " * 10)
    theirs.write_text("the run's text " * 10)
    other.write_text("another text " * 10)
    recipe = Recipe.of(RunConfig(data=str(mine)))
    assert adopt(recipe, {"data": str(theirs)}).data == str(theirs)  # its own copy, where it lies
    with pytest.raises(RecipeConflict, match="another data"):
        adopt(recipe, {"data": str(other)})
    with pytest.raises(RecipeConflict, match="no data"):
        adopt(Recipe.of(RunConfig()), {"data": str(other)})


def test_a_folders_fingerprint_follows_its_content_and_names_not_its_place(tmp_path: Path) -> None:
    for where in ("x", "y"):
        (tmp_path / where / "sub").mkdir(parents=True)
        (tmp_path / where / "one.txt").write_text("one")
        (tmp_path / where / "sub" / "two.txt").write_text("two")
    assert fingerprint(str(tmp_path / "x")) == fingerprint(str(tmp_path / "y"))
    (tmp_path / "y" / "sub" / "two.txt").rename(tmp_path / "y" / "sub" / "three.txt")
    assert fingerprint(str(tmp_path / "x")) != fingerprint(str(tmp_path / "y"))


def test_a_malformed_recipe_is_an_error_not_a_crash() -> None:
    value = Recipe.of(RunConfig()).to_value()
    for broken in ({}, {**value, "config": {**value["config"], "seq_len": 0}},
                   {**value, "config": {**value["config"], "unknown": 1}}, {**value, "model": {"family": "llama",
                                                                                              "hidden_size": -3}}):
        with pytest.raises(ValueError):
            Recipe.from_value(broken)


def test_a_run_config_with_a_whole_architecture_needs_no_preset_and_keeps_its_vocabulary(tokenizer_file) -> None:
    architecture = dataclasses.replace(LlamaConfig(), vocab_size=600, num_layers=3)
    config = RunConfig(model="from-a-checkpoint", architecture=architecture, num_stages=3)
    assert config.model_config == architecture and config.stage_layers(2) == (2, 3)
    assert RunConfig(model="x", architecture=architecture, tokenizer=str(tokenizer_file)).model_config == architecture
    with pytest.raises(ConfigError, match="more than the model's vocabulary of 256"):
        RunConfig(tokenizer=str(tokenizer_file), architecture=LlamaConfig())
    with pytest.raises(ConfigError, match="unknown model"):
        RunConfig(model="from-a-checkpoint")


@pytest.mark.timeout(420)
def test_a_volunteer_given_only_the_swarms_address_trains_with_its_recipe_and_a_conflicting_one_exits_2(make_swarm):
    """The swarm runs a recipe far from the defaults under a run id of its own. A client started with nothing but
    `--role client --initial-peers ADDR` finds the run, takes the recipe and trains in it (every row of every
    epoch averaged, with it among the workers); one given a `--seq-len` that differs exits 2 naming the flag and
    both values."""
    import subprocess
    import sys
    import time

    from p2ptrain.cli import LOOPBACK

    epochs, recipe = 4, ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "4", "--microbatches", "2",
                         "--seq-len", "32", "--seed", "5", "--lr", "0.002"]
    swarm = make_swarm("carried-recipe", recipe)
    swarm.peer("bs0", "--role", "server", "--stage", "0", "--server-role", "bs")
    swarm.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("bs1", "--role", "server", "--stage", "1", "--server-role", "bs")
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(epochs))
    bare = ["--host-maddrs", LOOPBACK, "--initial-peers", *swarm.initial_peers]
    swarm.start("volunteer1", ["--role", "client", "--stage", "1", *bare])
    deadline = time.monotonic() + 180
    while not any(stage["workers"] for stage in swarm.status()["stages"][1:]):
        assert time.monotonic() < deadline and not swarm.failed(), swarm.logs()
        time.sleep(1.0)
    swarm.start("volunteer0", ["--role", "client", *bare])  # no stage either: it probes, and finds stage 0 empty
    report = swarm.wait_finished(timeout=300)
    assert report["recipe"]["config"]["seq_len"] == 32 and report["recipe"]["model"]["num_layers"] == 4
    epochs_closed = [e for e in report["epochs"] if not e["abandoned"]]
    assert [e["epoch"] for e in epochs_closed] == list(range(epochs))
    for epoch in epochs_closed:
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == 4 * 2 == stage["rows_averaged"], epoch
    assert sorted(len(stage["workers"]) for stage in report["stages"]) == [1, 1], report["stages"]
    for name in ("volunteer0", "volunteer1"):
        log = (swarm.workdir / f"{name}.log").read_text()
        assert "took the recipe of run carried-recipe" in log and "32 tokens" in log, log[-2000:]
    refused = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "client", "--stage", "1",
                              "--seq-len", "64", *bare], capture_output=True, text=True, timeout=180)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--seq-len 64: the swarm's recipe has 32" in refused.stderr, refused.stderr[-2000:]
    # a stage past the defaults' is the recipe's to judge: this run has 2
    refused = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "client", "--stage", "3", *bare],
                             capture_output=True, text=True, timeout=180)
    assert refused.returncode == 2 and "--stage 3: not in 0..1" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.timeout(300)
def test_a_volunteer_that_finds_no_recipe_says_so_and_one_stopped_while_it_waits_stops_cleanly(make_swarm):
    """A swarm with no data source up: a client given no recipe flags waits for the recipe (--recipe-timeout) and
    then exits 2 saying there is none; one stopped (SIGTERM) while it waits stops at once with status 0."""
    import subprocess
    import sys
    import time

    from p2ptrain.cli import LOOPBACK

    swarm = make_swarm("no-data-source-yet", [])
    bare = ["--host-maddrs", LOOPBACK, "--initial-peers", *swarm.initial_peers]
    refused = subprocess.run([sys.executable, "-m", "p2ptrain.peer", "--role", "client", "--stage", "0",
                              "--recipe-timeout", "3", *bare], capture_output=True, text=True, timeout=180)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--run-id p2ptrain: no recipe of this run in the swarm after 3 s" in refused.stderr, refused.stderr[-2000:]
    waiting = swarm.start("waiting", ["--role", "client", "--stage", "1", *bare])
    deadline = time.monotonic() + 120
    while "waiting up to" not in (swarm.workdir / "waiting.log").read_text():
        assert time.monotonic() < deadline and waiting.poll() is None, swarm.logs()
        time.sleep(0.5)
    waiting.terminate()
    assert waiting.wait(timeout=60) == 0, swarm.logs(["waiting"])


def test_a_run_started_from_a_checkpoint_takes_its_model_and_carries_its_fingerprint(tmp_path: Path) -> None:
    """--init-from: the model is the checkpoint's config.json; the recipe carries the checkpoint's fingerprint, a
    peer's own copy must match it, and what is no checkpoint is refused saying why."""
    transformers = pytest.importorskip("transformers")
    import shutil

    hf = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=48)
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "ckpt")
    config = RunConfig(model="ckpt", init_from=str(tmp_path / "ckpt"), num_stages=3, seq_len=48)
    model = config.model_config
    assert (model.family, model.num_layers, model.num_kv_heads, model.max_seq_len) == ("llama", 3, 1, 48)
    recipe = Recipe.of(config)
    assert recipe.init_from == fingerprint(str(tmp_path / "ckpt")) and str(tmp_path) not in repr(recipe.to_value())
    assert Recipe.from_value(recipe.to_value()) == recipe and "from a checkpoint" in recipe.describe()
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    assert adopt(recipe, {}).init_from is None  # a volunteer without a copy downloads its stage's state
    assert adopt(recipe, {"init_from": str(tmp_path / "copy")}).model_config == model
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "other")  # other weights
    with pytest.raises(RecipeConflict, match="another init_from"):
        adopt(recipe, {"init_from": str(tmp_path / "other")})
    with pytest.raises(ConfigError, match="exceeds the model's max_seq_len 48"):
        RunConfig(init_from=str(tmp_path / "ckpt"), seq_len=64)
    with pytest.raises(ConfigError, match="config.json: missing"):
        RunConfig(init_from=str(tmp_path))
    with pytest.raises(ConfigError, match="another model than the run's"):
        RunConfig(init_from=str(tmp_path / "ckpt"), architecture=LlamaConfig())


def test_tensors_shared_across_stages_are_averaged_at_every_epoch() -> None:
    tied = dataclasses.replace(LlamaConfig(), tie_embeddings=True)
    assert not RunConfig(model="tied", architecture=tied, num_stages=1).shares_across_stages
    assert RunConfig(model="tied", architecture=tied, num_stages=2).shares_across_stages
    assert not RunConfig(num_stages=2).shares_across_stages
    with pytest.raises(ConfigError, match="stay equal only when averaged at every epoch"):
        RunConfig(model="tied", architecture=tied, num_stages=2, average_every=4)
