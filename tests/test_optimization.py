"""The pure rules of a step (`protocol.optimization`): the schedule, the clip coefficient, the data source's norm
book; the recipe's checks of the optimization settings; and a worker that gets no global norm in time."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from p2ptrain.cli import add_optimization_flags, optimization_from
from p2ptrain.config import ConfigError, RunConfig
from p2ptrain.protocol.optimization import GlobalStep, LossScaleRule, LRSchedule, NormBook, clip_coefficient


def test_the_schedule_warms_up_then_decays_along_a_cosine_to_its_floor():
    schedule = LRSchedule(lr=1.0, warmup_epochs=3, decay_epochs=13, min_lr=0.1)
    assert [schedule.at(e) for e in range(3)] == [0.25, 0.5, 0.75]
    assert schedule.at(3) == 1.0
    assert math.isclose(schedule.at(8), 0.55)  # halfway down the cosine
    assert all(schedule.at(e) > schedule.at(e + 1) for e in range(3, 13))
    assert schedule.at(13) == schedule.at(1000) == 0.1
    assert LRSchedule(lr=0.5).at(0) == LRSchedule(lr=0.5).at(10**6) == 0.5
    assert LRSchedule(lr=0.5, warmup_epochs=1).at(5) == 0.5  # no decay: the peak after the warm-up


def test_the_clip_coefficient_is_the_one_torch_applies():
    for norm_wanted in (0.01, 0.3, 5.0):
        grads = [torch.randn(30, 7), torch.randn(11)]
        norm = math.sqrt(sum(g.double().square().sum().item() for g in grads))
        clipped = [g.clone().requires_grad_() for g in grads]
        for c, g in zip(clipped, grads):
            c.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(clipped, norm_wanted)
        scale = clip_coefficient(norm, norm_wanted)
        for c, g in zip(clipped, grads):
            assert torch.allclose(c.grad, g * scale, rtol=1e-6)
    assert clip_coefficient(0.0, 1.0) == 1.0


def test_the_norm_book_answers_once_every_stage_reported_and_the_first_report_counts():
    book = NormBook(num_stages=3, kept=2)
    assert book.report(epoch=5, stage=2, squared_norm=9.0) is None
    assert book.report(epoch=5, stage=0, squared_norm=4.0) is None
    assert book.report(epoch=5, stage=2, squared_norm=100.0) is None  # a stage mate's rounding of the same norm
    assert book.report(epoch=5, stage=1, squared_norm=12.0) == GlobalStep(norm=5.0)
    assert book.report(epoch=5, stage=0, squared_norm=4.0) == GlobalStep(norm=5.0)  # every worker asks again alike
    for epoch in (6, 7):
        book.report(epoch=epoch, stage=0, squared_norm=1.0)
    assert book.report(epoch=5, stage=1, squared_norm=1.0) is None  # forgotten: only the newest 2 epochs are kept
    with pytest.raises(ValueError, match="stage 3"):
        book.report(epoch=7, stage=3, squared_norm=1.0)
    with pytest.raises(ValueError, match="finite"):
        book.report(epoch=7, stage=1, squared_norm=float("nan"))


def test_one_stage_that_overflowed_makes_every_stage_skip_the_epoch():
    book = NormBook(num_stages=2, kept=4)
    assert book.report(epoch=3, stage=1, squared_norm=1.0, overflow=True) is None
    assert book.report(epoch=3, stage=0, squared_norm=4.0, overflow=False) == GlobalStep(norm=5 ** 0.5, overflow=True)
    assert book.report(epoch=3, stage=1, squared_norm=1.0, overflow=False).overflow  # the first report counts
    book.report(epoch=4, stage=0, squared_norm=1.0)
    assert book.report(epoch=4, stage=1, squared_norm=0.0) == GlobalStep(norm=1.0, overflow=False)


def test_the_loss_scale_halves_after_an_overflow_and_doubles_after_a_run_of_clean_epochs():
    rule, scale, clean, seen = LossScaleRule(growth_epochs=3), 1024.0, 0, []
    for overflow in (True, False, False, False, False, True, True, False):
        scale, clean = rule.after(scale, clean, overflow=overflow)
        seen.append(scale)
    assert seen == [512.0, 512.0, 512.0, 1024.0, 1024.0, 512.0, 256.0, 256.0]


@pytest.mark.parametrize(("fields", "field", "problem"), [
    ({"optimizer": "sgd"}, "optimizer", "unknown optimizer"),
    ({"min_lr": 0.1, "lr": 0.01}, "min_lr", "exceeds the peak"),
    ({"warmup_epochs": 5, "decay_epochs": 5}, "decay_epochs", "past the warm-up"),
    ({"clip_norm": -1.0}, "clip_norm", "0 or more"),
    ({"warmup_epochs": -1}, "warmup_epochs", "0 or more"),
    ({"average_every": 0}, "average_every", "at least 1"),
    ({"outer_lr": 0.0}, "outer_lr", "positive"),
    ({"outer_momentum": 1.0}, "outer_momentum", r"\[0, 1\)"),
    ({"average_every": 4, "clip_norm": 1.0}, "clip_norm", "cannot clip with average_every > 1"),
    ({"average_every": 4, "dpu": True}, "dpu", "for average_every = 1"),
])
def test_the_recipe_refuses_optimization_settings_that_cannot_work(fields, field, problem):
    with pytest.raises(ConfigError, match=problem) as error:
        RunConfig(**fields)
    assert error.value.field == field


def test_delayed_updates_are_on_by_default_where_they_apply_and_asked_for_where_they_do_not_are_refused():
    assert RunConfig().dpu is True and RunConfig(precision="bf16").dpu is True
    assert RunConfig(precision="fp16").dpu is False and RunConfig(average_every=2).dpu is False
    assert RunConfig(dpu=False).dpu is False
    with pytest.raises(ConfigError, match="fp16's loss scale"):
        RunConfig(precision="fp16", dpu=True)
    parser = argparse.ArgumentParser()
    add_optimization_flags(parser)
    for argv, dpu in (([], True), (["--precision", "fp16"], False), (["--average-every", "3"], False),
                      (["--dpu", "off"], False), (["--dpu", "on", "--precision", "bf16"], True)):
        assert RunConfig(**optimization_from(parser.parse_args(argv))).dpu is dpu, argv
    with pytest.raises(ConfigError, match="for average_every = 1"):
        RunConfig(**optimization_from(parser.parse_args(["--dpu", "on", "--average-every", "3"])))


def test_lamb_steps_and_its_state_travels_to_a_stage_mate():
    """bitsandbytes' LAMB keeps its statistics in a nested map; the state download carries them whole."""
    from p2ptrain.models import build_stage, model_config
    from p2ptrain.state.codec import decode_state, encode_state

    model = build_stage(model_config("llama-tiny"), start=0, end=2, seed=0)
    optimizer = model.configure_optimizer(name="lamb", lr=1e-3, weight_decay=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    mate = build_stage(model_config("llama-tiny"), start=0, end=2, seed=0)
    mate_optimizer = mate.configure_optimizer(name="lamb", lr=1e-3, weight_decay=0.01)
    model_state, optimizer_state = decode_state(encode_state(model.state_dict(), optimizer.state_dict()), mate,
                                                mate_optimizer)
    mate_optimizer.load_state_dict(optimizer_state)
    saved, loaded = optimizer.state_dict()["state"], mate_optimizer.state_dict()["state"]
    for index, entries in saved.items():
        for name, value in entries["__bnb_optimizer_quant_state__"].items():
            assert torch.equal(value, loaded[index]["__bnb_optimizer_quant_state__"][name]), (index, name)


def test_a_worker_that_hears_no_global_norm_in_time_steps_unclipped_and_says_so(caplog):
    """With --clip-norm, a stage whose data source never answers with the global norm waits the averaging timeout,
    then steps on its averaged gradients as they are (not clipped by its own norm, which no other stage shares)."""
    import dataclasses

    from p2ptrain.client.worker import Worker
    from p2ptrain.config import RuntimeConfig
    from tests.lone import give_gradients, lone_worker, stepped_alone

    def stepped(config: RunConfig) -> Worker:
        settings = dataclasses.replace(RuntimeConfig(), averaging_timeout_s=0.3, norm_poll_s=0.05)
        worker = lone_worker(config, settings=settings, norm_keeper=lambda: None)
        give_gradients(worker, seed=1, scale=100.0)  # far above the clip norm
        return stepped_alone(worker)

    recipe = {"num_stages": 2, "rows_per_microbatch": 2, "microbatches": 1, "seq_len": 8}
    with caplog.at_level("WARNING"):
        clipped = stepped(RunConfig(**recipe, clip_norm=1.0))
    plain = stepped(RunConfig(**recipe))
    record = clipped.history[-1]
    assert record.unclipped and record.grad_norm is None and not plain.history[-1].unclipped
    assert clipped.master.digest() == plain.master.digest()
    assert "no global gradient norm of epoch 0" in caplog.text and "stepping unclipped" in caplog.text
