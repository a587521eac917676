"""Tensors several stages hold (`protocol.sharing`): who averages with whom, and a swarm whose first and last stages
hold tied embeddings steps them on the whole model's gradient and keeps the copies equal."""
from __future__ import annotations

import pytest
import torch

from p2ptrain.config import RunConfig
from p2ptrain.data import Masking, TextSource
from p2ptrain.models import build_stage, from_pretrained, model_config
from p2ptrain.models.hf_config import read_config
from p2ptrain.protocol.messages import GroupMember, StageGroup
from p2ptrain.protocol.sharing import GroupBook, shared_rounds


def member(name: str, rows: int = 4) -> GroupMember:
    return GroupMember(peer_id=name, client_mode=False, rows=rows)


def test_each_set_of_stages_that_hold_the_same_tensors_averages_in_one_round_in_one_order() -> None:
    groups = (StageGroup(stage=0, group=(member("a"), member("fs0", 0)), shared=("embed", "block0.w")),
              StageGroup(stage=1, group=(member("b"),), shared=("block0.w", "block1.w")),
              StageGroup(stage=2, group=(member("c"), member("d")), shared=("block1.w", "embed")))
    (first,) = shared_rounds(groups, 0)[:1]
    assert [r.stages for r in shared_rounds(groups, 0)] == [(0, 1), (0, 2)]
    assert first.keys == ("block0.w",) and [m.peer_id for m in first.members] == ["a", "fs0", "b"]
    middle = shared_rounds(groups, 1)
    assert [(r.stages, r.keys) for r in middle] == [((0, 1), ("block0.w",)), ((1, 2), ("block1.w",))]
    assert [m.peer_id for m in middle[1].members] == ["b", "c", "d"]
    assert shared_rounds(groups[:1] + (StageGroup(stage=1, group=(member("b"),), shared=()),), 1) == []
    with pytest.raises(ValueError, match="stage 2 did not report"):
        shared_rounds(groups[:2], 2)


def test_the_book_answers_once_every_stage_reported_and_keeps_the_first_report() -> None:
    book = GroupBook(num_stages=2, kept=2)
    zero = StageGroup(stage=0, group=(member("a"),), shared=("embed",))
    assert book.report(epoch=5, entry=zero) is None
    assert book.report(epoch=5, entry=StageGroup(stage=0, group=(member("x"),), shared=())) is None
    one = StageGroup(stage=1, group=(member("b"),), shared=("embed",))
    assert book.report(epoch=5, entry=one) == (zero, one)
    book.report(epoch=7, entry=zero)
    assert book.groups(5) is None  # older than the newest 2 epochs
    with pytest.raises(ValueError, match="stage 2 is not in 0..1"):
        book.report(epoch=7, entry=StageGroup(stage=2, group=(), shared=()))


ROWS, MICROBATCHES, SEQ, SEED, CLIP = 4, 2, 32, 3, 0.05
# averaging in fp32: the steps are compared with one process's to 1e-5, past int8's rounding
RECIPE = ["--num-stages", "2", "--batch-rows", str(ROWS), "--microbatches", str(MICROBATCHES), "--seq-len", str(SEQ),
          "--seed", str(SEED), "--lr", "0.003", "--clip-norm", str(CLIP), "--averaging-codec", "fp32"]


def run_two_stages(swarm, epochs: int) -> dict:
    for stage in (1, 0):
        swarm.peer(f"bs{stage}", "--role", "server", "--stage", str(stage), "--server-role", "bs")
        swarm.peer(f"client{stage}", "--role", "client", "--stage", str(stage))
    swarm.peer("fs1", "--role", "server", "--stage", "1", "--server-role", "fs")
    swarm.peer("fs0", "--role", "server", "--stage", "0", "--server-role", "fs", "--epochs", str(epochs))
    report = swarm.wait_finished(timeout=300)
    assert all(stage["rows_averaged"] == ROWS * MICROBATCHES for e in report["epochs"] for stage in e["stages"])
    return report


def one_process_gradients(whole, source: TextSource) -> dict[str, torch.Tensor]:
    """The whole model, the whole first batch, its mean token loss, clipped by the norm of its gradient: the
    gradient by checkpoint key (a tied or shared tensor is one tensor here)."""
    for index in range(MICROBATCHES):
        inputs, labels = source.microbatch(0, index, ROWS)
        (whole(inputs, labels) / (ROWS * MICROBATCHES * SEQ)).backward()
    assert torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP) > 2 * CLIP, "the clip must be active"
    keys = whole.hf_names()
    return {keys[name]: p.grad for name, p in whole.named_parameters()}


def check_dumps(dumps, config, reference: dict[str, torch.Tensor], epochs: int) -> set[str]:
    """Every worker's applied gradient of epoch 0 against one process's, key by key; and after every epoch, every
    copy of every tensor the two stages share equal. The shared keys."""
    stages = {stage: build_stage(config, start=start, end=end)
              for stage, (start, end) in enumerate([(0, config.num_layers // 2), (config.num_layers // 2,
                                                                                  config.num_layers)])}
    names = {stage: module.hf_names() for stage, module in stages.items()}
    shared = set(stages[0].shared_parameters().values()) & set(stages[1].shared_parameters().values())
    copies: dict[tuple[int, str], torch.Tensor] = {}  # (epoch, key) -> the copy after its step
    covered, seen = set(), set()
    for path in sorted(dumps.glob("*.pt")):
        dump = torch.load(path)
        stage, epoch = dump["stage"], int(path.stem.rsplit("epoch", 1)[1])
        seen.add((stage, epoch))
        if epoch == 0:
            for name, grad in dump["grads"].items():
                key = names[stage][name]
                error = ((grad - reference[key]).norm() / reference[key].norm()).item()
                assert error < 1e-5, f"{path.name}: {key} differs from one process by {error:.2e}"
                covered.add(key)
        for name, param in dump["params"].items():
            if names[stage].get(name) in shared:
                held = copies.setdefault((epoch, names[stage][name]), param)
                assert torch.equal(held, param), f"{path.name}: its copy of {names[stage][name]} differs"
    assert covered == set(reference)
    assert seen == {(stage, epoch) for stage in (0, 1) for epoch in range(epochs)}
    return shared


@pytest.mark.timeout(420)
def test_tied_embeddings_in_two_stages_step_on_the_whole_models_gradient_and_stay_equal(make_swarm, tmp_path):
    """A Llama checkpoint with tied embeddings, split in 2 stages: the first holds the embeddings, the last a copy
    as its output layer. After one global batch every worker's applied gradient (clipped by the global norm) equals
    one process's, the tied tensor's included; after every epoch the two copies are equal."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=True)
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "ckpt")
    dumps, epochs = tmp_path / "grads", 3
    run_two_stages(make_swarm("tied", ["--init-from", str(tmp_path / "ckpt"), *RECIPE, "--dump-grads", str(dumps)]),
                   epochs)
    (whole,) = from_pretrained(tmp_path / "ckpt")
    reference = one_process_gradients(whole, TextSource(seq_len=SEQ, seed=SEED))
    shared = check_dumps(dumps, read_config(tmp_path / "ckpt"), reference, epochs)
    assert shared == {"model.embed_tokens.weight"}


@pytest.mark.timeout(420)
def test_an_albert_swarm_sums_its_shared_block_over_two_stages_and_keeps_every_copy_equal(make_swarm, tmp_path):
    """albert-tiny in 2 stages: one block group applied by all 4 layers, so each stage holds a copy of it, and the
    word embeddings in the first and the decoder tied to them in the last. It trains on masked-LM batches; one
    global batch's gradients equal one process's (1e-5 relative) and every shared copy is equal after every
    epoch."""
    dumps, epochs = tmp_path / "grads", 4
    report = run_two_stages(make_swarm("albert", ["--model", "albert-tiny", *RECIPE, "--dump-grads", str(dumps)]),
                            epochs)
    config = model_config("albert-tiny")
    whole = build_stage(config, start=0, end=config.num_layers, seed=SEED)
    masking = Masking.of(RunConfig(model="albert-tiny"))
    reference = one_process_gradients(whole, TextSource(seq_len=SEQ, seed=SEED, masking=masking))
    shared = check_dumps(dumps, config, reference, epochs)
    assert "albert.embeddings.word_embeddings.weight" in shared and len(shared) > 10  # the word matrix and the block
    losses = [e["loss"] for e in report["epochs"]]
    assert losses[-1] < losses[0], losses
