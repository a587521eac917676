"""Hugging Face interchange: stages built from a local `transformers` checkpoint compute transformers' logits, and
an export loads back into transformers. The checkpoints are random-weight models the tests create (no download)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from p2ptrain.models import export, from_pretrained
from p2ptrain.models.hf import CheckpointError, read_config
from p2ptrain.models.llama import Block

transformers = pytest.importorskip("transformers")

LLAMA_CASES = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mqa-tied-llama3": dict(num_key_value_heads=1, tie_word_embeddings=True,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mha-linear-headdim-bias": dict(num_key_value_heads=4, head_dim=12, rope_theta=500.0, attention_bias=True,
                                    mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def llama_checkpoint(tmp_path, **overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
                                      **overrides)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts norms at one and biases at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(tmp_path / "checkpoint")
    return model, tmp_path / "checkpoint"


def run(stages, ids):
    x = ids
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_stages_from_a_transformers_checkpoint_give_its_logits_and_export_back(tmp_path, case):
    model, path = llama_checkpoint(tmp_path, **LLAMA_CASES[case])
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        for k in range(1, 5):
            stages = from_pretrained(path, num_stages=k)
            assert len(stages) == k and stages[0].start == 0 and stages[-1].end == 4
            torch.testing.assert_close(run(stages, ids), expected, atol=1e-4, rtol=0)
        export(stages, tmp_path / "export")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-4, rtol=0)
        assert read_config(tmp_path / "export") == read_config(path)
    config = read_config(path)
    assert config.layer_parameters() == sum(p.numel() for p in Block(config).parameters())  # the planner's count


ALBERT_CASES = {
    "one-group-tied": dict(num_hidden_groups=1),
    "two-groups-untied-gelu": dict(num_hidden_groups=2, tie_word_embeddings=False, hidden_act="gelu"),
}


def albert_checkpoint(tmp_path, **overrides):
    torch.manual_seed(0)
    config = transformers.AlbertConfig(vocab_size=97, embedding_size=16, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
                                       **overrides)
    model = transformers.AlbertForMaskedLM(config).eval()
    with torch.no_grad():  # transformers starts LayerNorms at one and biases at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
    model.save_pretrained(tmp_path / "checkpoint")
    return model, tmp_path / "checkpoint"


@pytest.mark.parametrize("case", ALBERT_CASES)
def test_albert_stages_from_a_transformers_checkpoint_give_its_logits_and_export_back(tmp_path, case):
    model, path = albert_checkpoint(tmp_path, **ALBERT_CASES[case])
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        for k in range(1, 5):
            stages = from_pretrained(path, num_stages=k)
            torch.testing.assert_close(run(stages, ids), expected, atol=1e-4, rtol=0)
        export(stages, tmp_path / "export")
        reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "export").eval()
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-4, rtol=0)
        assert read_config(tmp_path / "export") == read_config(path)


def test_albert_stages_name_the_shared_blocks_they_hold(tmp_path):
    _, path = albert_checkpoint(tmp_path, num_hidden_groups=2)
    stages = from_pretrained(path, num_stages=4)  # layer i applies group i // 2
    groups = [{key.split(".")[3] for key in stage.shared_parameters().values() if "layer_groups" in key}
              for stage in stages]
    assert groups == [{"0"}, {"0"}, {"1"}, {"1"}]
    assert "embeddings.word.weight" in stages[0].shared_parameters()
    assert "head.decoder.weight" in stages[3].shared_parameters()
    assert from_pretrained(path, num_stages=1)[0].shared_parameters() == {}
    assert torch.equal(stages[0].groups["0"].query.weight, stages[1].groups["0"].query.weight)


def test_albert_copies_start_equal_when_built_from_a_seed():
    from p2ptrain.models import build_stage, model_config

    config = model_config("albert-tiny")
    first, last = (build_stage(config, start=a, end=b, seed=3) for a, b in ((0, 2), (2, 4)))
    assert torch.equal(first.groups["0"].ffn.weight, last.groups["0"].ffn.weight)
    assert torch.equal(first.embeddings.word.weight, last.head.decoder.weight)
    labels = torch.full((2, 16), -100).index_fill_(1, torch.tensor([3]), 7)
    loss = last(first(torch.randint(0, 256, (2, 16))), labels)
    assert loss.item() > 0 and loss.shape == ()


def test_the_rope_scaling_is_what_makes_the_scaled_checkpoints_logits(tmp_path):
    """The scaled case is a real check: the same weights without the scaling give other logits at 48 tokens."""
    model, path = llama_checkpoint(tmp_path, **LLAMA_CASES["mqa-tied-llama3"])
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(1))
    unscaled = dataclasses.replace(read_config(path), rope_scaling=None)
    with torch.no_grad():
        assert (run(from_pretrained(path, config=unscaled), ids) - model(ids).logits).abs().max() > 1e-3


def test_tied_embeddings_are_one_tensor_in_one_stage_and_named_copies_across_stages(tmp_path):
    _, path = llama_checkpoint(tmp_path, tie_word_embeddings=True)
    (whole,) = from_pretrained(path, num_stages=1)
    assert whole.lm_head.weight is whole.embed.weight and whole.shared_parameters() == {}
    first, last = from_pretrained(path, num_stages=2)
    assert first.shared_parameters() == {"embed.weight": "model.embed_tokens.weight"}
    assert last.shared_parameters() == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(first.embed.weight, last.lm_head.weight)
    with torch.no_grad():
        last.lm_head.weight.add_(1.0)
    with pytest.raises(ValueError, match="copies of model.embed_tokens.weight differ"):
        export([first, last], tmp_path / "export")


def test_sharded_checkpoints_load(tmp_path):
    model, _ = llama_checkpoint(tmp_path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(run(from_pretrained(tmp_path / "sharded", num_stages=3), ids), model(ids).logits,
                                   atol=1e-4, rtol=0)


def test_bad_checkpoints_get_errors_that_say_what_to_fix(tmp_path):
    with pytest.raises(CheckpointError, match="hub name; p2ptrain downloads nothing"):
        from_pretrained("meta-llama/Llama-3.2-1B")
    with pytest.raises(CheckpointError, match="config.json"):
        from_pretrained(tmp_path)
    _, path = llama_checkpoint(tmp_path)
    hf = json.loads((path / "config.json").read_text())
    for change, match in [({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
                          ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
                          ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
                           "'yarn' is not supported"),
                          ({"intermediate_size": 65}, r"mlp.gate_proj.weight has shape \(64, 32\)")]:
        (path / "config.json").write_text(json.dumps(hf | change))
        with pytest.raises(CheckpointError, match=match):
            from_pretrained(path, num_stages=2)
    (path / "config.json").write_text(json.dumps(hf))
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        from_pretrained(path)


def test_an_export_in_shards_of_a_stage_each_loads_back_and_a_partial_one_is_refused(tmp_path):
    """ExportWriter, as a swarm's export uses it: a shard per stage with an index, tied weights written once; a
    directory without every layer gets no config.json, so transformers never loads half a model."""
    from p2ptrain.models.hf import ExportWriter, load_pretrained

    model, path = llama_checkpoint(tmp_path, tie_word_embeddings=True)
    stages = from_pretrained(path, num_stages=3)
    writer = ExportWriter(tmp_path / "shards", stages[0].config, num_shards=3)
    for stage in stages:
        writer.add(stage)
    writer.close()
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00003.safetensors"
    assert "lm_head.weight" not in index["weight_map"]
    ids = torch.randint(0, 97, (2, 8))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "shards").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    fresh = from_pretrained(path, num_stages=3)[1]
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    load_pretrained(fresh, tmp_path / "shards")
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), stages[1].parameters()))
    partial = ExportWriter(tmp_path / "partial", stages[0].config, num_shards=3)
    partial.add(stages[0])
    with pytest.raises(ValueError, match="a stage of layers"):
        partial.add(stages[2])
    with pytest.raises(ValueError, match="export needs every layer"):
        partial.close()
    assert not (tmp_path / "partial" / "config.json").exists()


@pytest.mark.parametrize("family", ["llama", "albert"])
def test_the_planner_prices_a_transformers_config_by_the_layer_transformers_builds(tmp_path, family):
    """`python -m p2ptrain.plan --model-config PATH` plans the model of a transformers config.json: the bytes and
    FLOPs of a layer (of ALBERT's shared group and tied word matrix) follow the parameters transformers builds from
    that config."""
    from p2ptrain.plan import main
    from p2ptrain.planner.presets import config_spec

    if family == "llama":
        hf = transformers.LlamaConfig(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=6,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                      attention_bias=True)
        layer = transformers.LlamaForCausalLM(hf).model.layers[0]
    else:
        hf = transformers.AlbertConfig(vocab_size=1000, embedding_size=16, hidden_size=96, intermediate_size=200,
                                       num_hidden_layers=6, num_attention_heads=6, max_position_embeddings=128)
        layer = transformers.AlbertForMaskedLM(hf).albert.encoder.albert_layer_groups[0].albert_layers[0]
    hf.save_pretrained(tmp_path / "model")
    params = sum(p.numel() for p in layer.parameters())
    spec = config_spec(read_config(tmp_path / "model" / "config.json"), name="model")
    if family == "llama":
        assert spec.layers == 6 and spec.param_bytes_per_layer == 4 * params
    else:  # the layers apply one shared group, which a stage holds once (ModelSpec.shared)
        assert spec.layers == 6 and spec.param_bytes_per_layer == 0
        assert [t.param_bytes for t in spec.shared] == [4 * params, 4 * 1000 * 16]
    assert spec.flops_per_token_per_layer > 6 * params  # forward and backward of every weight, attention on top
    out = tmp_path / "plan.json"
    assert main(["peers/local.toml", "--model-config", str(tmp_path / "model"), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["model"] == spec.to_json()
    assert sum(end - start for start, end in (stage["layers"] for stage in plan["stages"])) == 6
    with pytest.raises(SystemExit):
        main(["peers/local.toml", "--model-config", str(tmp_path / "model"), "--model", "llama-tiny"])
