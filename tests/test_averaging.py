"""A stage's all-reduce: real hivemind P2P daemons on loopback run `StageAllReduce` rounds. Every member ends with
the very same average in every averaging codec, int8 in under 1/3.5 of fp32's bytes; a round whose parts did not all
reach the average (here: a member sending in hivemind's 8-bit codec, which the reducers refuse) comes back as
failed, never as a success with local gradients. And the parameter digests that workers publish tell the same
parameters (up to rounding) from parameters one step apart."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.compression import Uniform8BitQuantization
from hivemind.proto import averaging_pb2

from p2ptrain import compression
from p2ptrain.client import averaging
from p2ptrain.client.averaging import (
    CodecAllReduceRunner,
    GradientDeposits,
    StageAllReduce,
    missing_parts,
    reducer_modes,
)
from p2ptrain.compression import decode, encode, int8_error_bound
from p2ptrain.config import AVERAGING_CODECS, WIRE_BYTES, RunConfig
from p2ptrain.live.probe import LinkProbe
from p2ptrain.models import build_stage, model_config
from p2ptrain.protocol.deadlines import all_reduce_bytes
from p2ptrain.protocol.messages import GroupMember
from p2ptrain.protocol.optimization import digests_agree
from p2ptrain.state.params import parameter_digest
from p2ptrain.traffic import METER
from p2ptrain.transport import Caller
from tests.loopback import loopback_p2ps


@contextlib.asynccontextmanager
async def members(count: int, codec: str = "none", *, server: bool = False) -> AsyncIterator[list[StageAllReduce]]:
    """`count` averagers of one stage, each on its own P2P daemon, all on loopback, averaging in `codec` (a wire
    codec); with `server`, the first keeps its stage's gradient deposits, as a server does."""
    async with loopback_p2ps(count) as p2ps:  # a test may shut one down, as a groupmate that died
        averagers = []
        for p2p in p2ps:
            peer_id = p2p.peer_id.to_base58()
            await LinkProbe(peer_id=peer_id).add_p2p_handlers(p2p)
            caller = Caller(p2p=p2p, peer_id=peer_id, codec="none", timeout=10.0)
            deposits = None
            if server and not averagers:
                deposits = GradientDeposits(peer_id=peer_id, stage=0, numel=NUMEL, kept=4)
                await deposits.add_p2p_handlers(p2p)
            averager = StageAllReduce(p2p=p2p, run_id="avg-test", stage=0, timeout=20.0, caller=caller,
                                      codec=codec, deposits=deposits)
            await averager.start()
            averagers.append(averager)
        yield averagers


NUMEL = 300 * 40 + 17  # entries of one draw


def draws(count: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [[torch.randn(300, 40, generator=generator), torch.randn(17, generator=generator)] for _ in range(count)]


async def one_round(averagers: list[StageAllReduce], grads: list[list[torch.Tensor]], rows: list[int]) -> list:
    group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False) for a in averagers)
    return await asyncio.wait_for(asyncio.gather(*(
        a.average(g, epoch=3, rows=r, group=group) for a, g, r in zip(averagers, grads, rows))), 60)


def round_bytes(numel: int, *, members: int, with_rows: int, itemsize: float) -> int:
    """What a round among `members` sends when the `with_rows` members that hand in rows reduce it between them (the
    others' zeros travel as their shape, a few bytes)."""
    return with_rows * all_reduce_bytes(numel, members=members, reducers=with_rows, itemsize=itemsize)


def weighted_mean(grads: list[list[torch.Tensor]], rows: list[int]) -> list[torch.Tensor]:
    return [sum(r * g[k] for r, g in zip(rows, grads)) / sum(rows) for k in range(len(grads[0]))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("averaging_codec", list(AVERAGING_CODECS))
def test_every_member_ends_with_the_very_same_average_in_every_codec(averaging_codec: str):
    """The reducers hand back the average itself, encoded once: the members' results are equal bit for bit, and
    within the codec's error of the row-weighted mean (int8: a part's error and the average's, each at most
    `int8_error_bound` of a block's largest value)."""
    async def scenario() -> None:
        async with members(3, AVERAGING_CODECS[averaging_codec]) as averagers:
            grads, rows = draws(3), [4, 1, 3]
            results = await one_round(averagers, grads, rows)
        expected = weighted_mean(grads, rows)
        largest = max(float(g.abs().max()) for draw in grads for g in draw)
        atol = {"fp32": 1e-6, "fp16": 2e-3 * largest, "int8": 2 * int8_error_bound() * largest}[averaging_codec]
        first = results[0][0]
        for averaged, result in results:
            assert result.ok and result.group_size == 3 and result.rows_lost == 0
            for tensor, want, same in zip(averaged, expected, first):
                assert tensor.dtype == torch.float32 and torch.equal(tensor, same)
                assert torch.allclose(tensor, want, rtol=1e-5, atol=atol)
        if averaging_codec != "fp32":  # lossy: not the exact mean
            assert not all(torch.allclose(tensor, want, rtol=1e-5, atol=1e-6) for tensor, want in zip(first, expected))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_int8_averaging_sends_under_a_third_and_a_half_of_fp32s_bytes():
    async def sent(codec: str) -> int:
        async with members(3, codec) as averagers:
            before, before_epoch = METER.snapshot()["averaging"], METER.of_epoch("averaging", 3)
            await one_round(averagers, draws(3), [4, 1, 3])
            nbytes = METER.snapshot()["averaging"] - before
            assert METER.of_epoch("averaging", 3) - before_epoch == nbytes  # all of it counted as the round's epoch
            return nbytes

    async def scenario() -> None:
        sent_by = {codec: await sent(AVERAGING_CODECS[codec]) for codec in AVERAGING_CODECS}
        assert sent_by["fp16"] <= sent_by["fp32"] / 1.9 and sent_by["int8"] <= sent_by["fp32"] / 3.5
        for codec, nbytes in sent_by.items():  # what the planner's P counts (config.WIRE_BYTES), headers aside
            counted = 3 * all_reduce_bytes(NUMEL, members=3, itemsize=WIRE_BYTES[AVERAGING_CODECS[codec]])
            assert counted <= nbytes <= 1.03 * counted, (codec, nbytes, counted)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_member_without_rows_reduces_nothing_and_sends_only_the_shape_of_its_zeros():
    """A server that keeps its stage's replica hands in zeros for no rows: the two workers reduce the whole average
    between them, the server's zeros travel as their shape alone, and all three end with the very same average. The
    round sends what two reducers among three members send (3/4 of three reducers' bytes), headers aside."""
    async def scenario() -> None:
        async with members(3) as averagers:
            grads, rows = draws(3), [0, 4, 3]
            grads[0] = [torch.zeros_like(grad) for grad in grads[0]]
            group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False, rows=r)
                          for a, r in zip(averagers, rows))
            before = METER.snapshot()["averaging"]
            results = await asyncio.wait_for(asyncio.gather(*(
                a.average(g, epoch=3, rows=r, group=group) for a, g, r in zip(averagers, grads, rows))), 60)
            nbytes = METER.snapshot()["averaging"] - before
        assert_averaged(results, grads, rows, rows_lost=0)
        first = results[0][0]
        assert all(torch.equal(tensor, same) for averaged, _ in results for tensor, same in zip(averaged, first))
        counted = round_bytes(NUMEL, members=3, with_rows=2, itemsize=WIRE_BYTES["none"])
        assert counted <= nbytes <= 1.03 * counted, (nbytes, counted)
        assert counted < 3 * all_reduce_bytes(NUMEL, members=3, itemsize=WIRE_BYTES["none"])

    asyncio.run(scenario())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_a_worker_alone_with_the_server_holding_its_deposit_steps_on_the_deposit_without_a_round(codec: str):
    """One worker with rows and the server keeping its stage's replica: the server holds the worker's deposit, so
    both take it as the average, bit for bit the same (the gradients as they travel in the averaging codec), and no
    all-reduce runs. Without a deposit of that epoch and those rows, or for what is not the epoch's gradients
    (`deposited` off: DiLoCo's rounds), they run the round as before, and still agree."""
    async def scenario() -> None:
        async with members(2, codec, server=True) as (server, worker):
            grads, rows = draws(2), [0, 3]
            grads[0] = [torch.zeros_like(grad) for grad in grads[0]]
            group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False, rows=r)
                          for a, r in zip((server, worker), rows))

            async def both(epoch: int, *, deposited: bool) -> tuple[list, int]:
                before = METER.snapshot()["averaging"]
                results = await asyncio.wait_for(asyncio.gather(*(
                    a.average(g, epoch=epoch, rows=r, group=group, deposited=deposited)
                    for a, g, r in zip((server, worker), grads, rows))), 60)
                return results, METER.snapshot()["averaging"] - before

            assert await worker.deposit(server.caller.peer_id, grads[1], epoch=5, rows=3)
            handed, nbytes = await both(5, deposited=True)
            assert nbytes == 0
            travelled = decode(encode(torch.cat([g.reshape(-1) for g in grads[1]]), codec))
            for averaged, result in handed:
                assert result.ok and result.group_size == 2 and result.rows_lost == 0
                assert torch.equal(torch.cat([a.reshape(-1) for a in averaged]), travelled)
            for deposited, epoch in ((False, 5), (True, 6)):  # not gradients; no deposit of epoch 6
                rounds, nbytes = await both(epoch, deposited=deposited)
                assert nbytes > 0
                assert all(result.ok and result.group_size == 2 for _, result in rounds)
                first = rounds[0][0]
                assert all(torch.equal(tensor, same) for averaged, _ in rounds for tensor, same in zip(averaged, first))

    asyncio.run(scenario())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_the_server_holding_a_stages_deposits_hands_its_depositors_their_mean(codec: str):
    """What a worker looks ahead to under DPU (`client.worker`): the server that holds the stage's deposits of an
    epoch hands each depositor the mean of the group's, weighted by their rows, the same bytes to each, in int8,
    within its error of the round's average; a server that computes takes it without a call. A peer that deposited
    nothing of the epoch gets none, and neither does an epoch nobody deposited."""
    async def scenario() -> None:
        async with members(3, codec, server=True) as (server, first, second):
            grads, rows = draws(3), [4, 2, 6]
            group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False, rows=r)
                          for a, r in zip((server, first, second), rows))
            for member, own, r in zip((server, first, second), grads, rows):
                assert await member.deposit(server.caller.peer_id, own, epoch=7, rows=r)
            means = [await member.stage_mean(grads[0], epoch=7, group=group) for member in (server, first, second)]
            travelled = [[decode(encode(g, codec)) for g in own] for own in grads]
            expected = torch.cat([t.reshape(-1) for t in weighted_mean(travelled, rows)])
            # the deposits travel in the run's codec, the mean in int8 (the server's own, computed here, does not)
            tolerance = int8_error_bound() * float(expected.abs().max()) + 1e-6
            largest = max(float(t.abs().max()) for own in grads for t in own)
            in_round = 1e-5 if codec == "none" else 2 * int8_error_bound() * largest  # its parts and shares in int8
            for mean, covered in means:
                assert covered == sum(rows)
                assert [t.shape for t in mean] == [t.shape for t in grads[0]]
                flat = torch.cat([t.reshape(-1) for t in mean])
                assert torch.allclose(flat, expected, atol=tolerance, rtol=0)
            assert all(torch.equal(a, b) for mean, _ in means[1:] for a, b in zip(mean, means[1][0]))
            averaged = await asyncio.wait_for(asyncio.gather(*(
                member.average(own, epoch=7, rows=r, group=group)
                for member, own, r in zip((server, first, second), grads, rows))), 60)
            assert all(result.ok for _, result in averaged)
            for tensor, own in zip(averaged[1][0], means[1][0]):
                assert torch.allclose(tensor, own, atol=tolerance + in_round, rtol=0)

        async with members(2, codec, server=True) as (server, worker):
            own = draws(1)[0]
            group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False, rows=r)
                          for a, r in ((server, 2), (worker, 3)))
            assert await worker.stage_mean(own, epoch=2, group=group) is None  # it deposited nothing
            worker._deposited[2] = (3, server.caller.peer_id)  # as if it had: the server still holds nothing
            assert await worker.stage_mean(own, epoch=2, group=group) is None
            alone = (dataclasses.replace(group[0], rows=0), group[1])  # its rows are the stage's: no call
            mean, covered = await worker.stage_mean(own, epoch=2, group=alone)
            # its own, as its deposit brought them to the server: the round's average, which its step takes
            travelled = decode(encode(torch.cat([t.reshape(-1) for t in own]), codec))
            assert torch.equal(torch.cat([t.reshape(-1) for t in mean]), travelled) and covered == 3

    asyncio.run(scenario())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_a_lone_worker_encodes_its_deposit_once_and_looks_ahead_and_averages_on_what_it_sent(
        codec: str, monkeypatch: pytest.MonkeyPatch):
    """A lone worker's look-ahead and its round of two with the server holding its deposit both take its gradients
    as the deposit brought them (the holder's copy); the deposit encoded them, and nothing encodes them again."""
    encodings: list[str] = []

    def counted(tensor: torch.Tensor, codec: str):
        encodings.append(codec)
        return encode(tensor, codec)

    monkeypatch.setattr(averaging, "encode", counted)
    monkeypatch.setattr(compression, "encode", counted)  # what the transport encodes with

    async def scenario() -> None:
        async with members(2, codec, server=True) as (server, worker):
            own = draws(1)[0]
            group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False, rows=r)
                          for a, r in ((server, 0), (worker, 3)))
            assert await worker.deposit(server.caller.peer_id, own, epoch=5, rows=3)
            (held,) = server.deposits.of(5, {worker.caller.peer_id})
            mean, covered = await worker.stage_mean(own, epoch=5, group=group)
            averaged, result = await worker.average(own, epoch=5, rows=3, group=group, deposited=True)
            assert covered == 3 and result.ok and result.group_size == 2
            for values in (mean, averaged):
                assert torch.equal(torch.cat([t.reshape(-1) for t in values]), held.grads)
            assert torch.equal(held.grads, decode(encode(torch.cat([t.reshape(-1) for t in own]), codec)))
            assert worker._arrived is None  # past the round, the worker keeps no copy of the stage's gradients

    asyncio.run(scenario())
    assert encodings == [codec]  # the deposit's, once


@pytest.mark.timeout(120)
def test_a_round_that_averaged_nothing_is_counted_as_failed():
    """A member sends its parts in hivemind's 8-bit codec (which does not decode under numpy 2.4, docs/design.md
    §7); the reducers refuse them: its own round fails, and its groupmates' markers show its part missing from their
    average, so theirs fails too. Each gets its local gradients back."""
    async def scenario() -> None:
        async with members(3) as averagers:
            averagers[0].wire = Uniform8BitQuantization()
            grads = draws(3)
            results = await one_round(averagers, grads, [2, 2, 2])
        for (averaged, result), own in zip(results, grads):
            assert not result.ok and result.group_size == 0
            assert all(torch.equal(a, b) for a, b in zip(averaged, own))  # the local gradients come back

    asyncio.run(scenario())


def test_the_members_with_rows_that_take_calls_reduce_and_the_others_only_when_none_can():
    def modes(*members: tuple[bool, int]) -> list[str]:
        group = tuple(GroupMember(peer_id=f"p{i}", client_mode=nat, rows=rows) for i, (nat, rows) in enumerate(members))
        return [mode.name for mode in reducer_modes(group)]

    assert modes((False, 0), (False, 4), (False, 3)) == ["CLIENT", "NODE", "NODE"]
    assert modes((False, 0), (True, 4), (False, 3)) == ["CLIENT", "CLIENT", "NODE"]
    assert modes((False, 0), (True, 4), (True, 3)) == ["NODE", "CLIENT", "CLIENT"]  # the replica reduces for them
    assert modes((False, 0), (False, 0)) == ["NODE", "NODE"]  # survivors without rows of their own
    assert modes((True, 2), (True, 3)) == ["CLIENT", "CLIENT"]  # nobody can: the round fails


def test_markers_name_the_members_whose_part_is_missing():
    group = tuple(GroupMember(peer_id=name, client_mode=False) for name in ("a", "b", "c"))
    assert missing_parts(torch.tensor([0.5, 0.25, 0.25]), group, "a") == []
    assert missing_parts(torch.tensor([1.0, 0.0, 0.0]), group, "a") == ["b", "c"]  # averaged nothing
    assert missing_parts(torch.tensor([0.0, 0.6, 0.4]), group, "c") == ["a"]
    # a member with (almost) no rows has a share far below one ulp of 1: it still counts, its own entry is not read
    assert missing_parts(torch.tensor([0.0, 2e-11, 1.0]), group, "a") == []


def test_digests_tell_the_same_parameters_from_parameters_a_step_apart():
    config = model_config("llama-tiny")
    model = build_stage(config, start=0, end=2, seed=1)
    params = [p.detach().clone() for p in model.parameters()]
    digest = parameter_digest(params)
    generator = torch.Generator().manual_seed(2)
    rounded = [p * (1 + 1e-7 * torch.randn(p.shape, generator=generator)) for p in params]  # an all-reduce's rounding
    assert digests_agree([digest, parameter_digest(params), parameter_digest(rounded)])
    # one AdamW step at lr 1e-3 moves every weight by about 1e-3: a worker that missed a round
    stepped = [p - 1e-3 * torch.sign(torch.randn(p.shape, generator=generator)) for p in params]
    assert not digests_agree([digest, parameter_digest(stepped)])
    assert not digests_agree([digest, parameter_digest(params[:-1])])
    assert digests_agree([digest])


async def average_after_the_last_dies(averagers: list[StageAllReduce], grads: list[list[torch.Tensor]],
                                      rows: list[int]) -> list:
    """The round of epoch 5 of every member but the last, whose process is gone before the round starts."""
    group = tuple(GroupMember(peer_id=a.caller.peer_id, client_mode=False, rows=r) for a, r in zip(averagers, rows))
    await averagers[-1].p2p.shutdown()
    return await asyncio.wait_for(asyncio.gather(*(
        a.average(g, epoch=5, rows=r, group=group) for a, g, r in zip(averagers[:-1], grads, rows))), 60)


def assert_averaged(results: list, grads: list[list[torch.Tensor]], rows: list[int], *, rows_lost: int) -> None:
    """Every survivor holds the row-weighted average of `grads` and counts `rows_lost`."""
    expected = weighted_mean(grads, rows)
    for averaged, result in results:
        assert result.ok and result.group_size == len(results) and result.rows_lost == rows_lost
        for tensor, want in zip(averaged, expected):
            assert torch.allclose(tensor, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_part_that_arrives_after_its_round_ended_is_dropped_without_an_error():
    """A groupmate's part still on its way when the round fails reaches a reducer hivemind has finalized (its
    accumulator gone): the stream ends quietly and the sender counts as failed, with no AttributeError for the log."""
    async def scenario() -> None:
        async with members(2) as averagers:
            p2p = averagers[0].p2p
            peers = [a.p2p.peer_id for a in averagers]
            runner = CodecAllReduceRunner(
                epoch=3, p2p=p2p, servicer_type=StageAllReduce, prefix="late-part", group_id=b"late-part",
                tensors=[torch.zeros(8)], ordered_peer_ids=peers, peer_fractions=(1.0, 1.0), part_size_bytes=2 ** 20)
            runner.tensor_part_reducer.finalize()

            async def late_part() -> AsyncIterator[averaging_pb2.AveragingData]:
                part = torch.ones_like(runner.parts_for_local_averaging[0])
                yield averaging_pb2.AveragingData(tensor_part=encode(part, "none"), weight=1.0)

            sender = runner.sender_peer_ids.index(peers[1])
            answered = [reply async for reply in runner._accumulate_parts_streaming(late_part(), sender)]
            assert answered == [] and peers[1] in runner.banned_senders

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_the_survivors_of_a_groupmate_that_died_average_again_among_themselves():
    """A groupmate whose process is gone fails the round for all; the others find it dead (its dial fails) and
    average among themselves, and say whose rows are missing."""
    async def scenario() -> None:
        async with members(3) as averagers:
            grads, rows = draws(3), [4, 1, 3]
            results = await average_after_the_last_dies(averagers, grads, rows)
        assert_averaged(results, grads[:2], rows[:2], rows_lost=3)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_groupmate_that_died_after_its_deposit_loses_no_rows():
    """A worker deposits its gradients with its stage's server, then dies before the round: the survivors average
    again, the server bringing the deposit, so the average holds every row of the group."""
    async def scenario() -> None:
        async with members(3, server=True) as averagers:
            server, _, dying = averagers
            grads, rows = draws(3), [0, 4, 3]
            grads[0] = [torch.zeros_like(grad) for grad in grads[0]]  # a server that holds the state brings no rows
            assert await dying.deposit(server.caller.peer_id, grads[2], epoch=5, rows=3)
            assert not await dying.deposit(server.caller.peer_id, grads[2][:1], epoch=5, rows=3)  # refused: too short
            results = await average_after_the_last_dies(averagers, grads, rows)
        assert_averaged(results, grads, rows, rows_lost=0)

    asyncio.run(scenario())


@pytest.mark.timeout(420)
def test_a_swarm_averaging_in_int8_keeps_stage_mates_equal_and_learns(make_swarm):
    """Two clients a stage and each stage's FS replica average in int8: every row of every epoch is in the average,
    the stage mates' parameters stay equal (each steps on the same decoded average), and the loss falls."""
    epochs = 6
    swarm = make_swarm("int8-averaging", ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "8",
                                          "--microbatches", "4", "--seq-len", "64", "--seed", "3",
                                          "--averaging-codec", "int8", "--dpu", "off"])  # the round's bytes alone
    swarm.start_two_stages({"c0a": "0", "c0b": "0", "c1a": "1", "c1b": "1"}, epochs=epochs)
    report = swarm.wait_finished(timeout=300)
    epochs_closed = [e for e in report["epochs"] if not e["abandoned"]]
    assert [e["epoch"] for e in epochs_closed] == list(range(epochs))
    for epoch in epochs_closed:
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == 8 * 4 == stage["rows_averaged"], epoch
            assert stage["rounds_failed"] == 0 and stage["digests_agree"] is not False, epoch
    assert all(stage["digests_agree"] for stage in report["stages"]), report["stages"]
    losses = [e["loss"] for e in epochs_closed]
    assert losses[-1] < losses[0] - 0.3, losses
    # per stage and epoch: each client that holds rows of the epoch deposits its values once and reduces the round
    # among its members (the clients that stepped, the FS's replica: the digests), every value at int8's bytes. One
    # client may hold none: the other took every task, as at the start while one is still joining; if it was not in
    # the round yet, the round of two (a client, the replica holding its deposit) sends nothing more
    config = RunConfig(model="llama-tiny", num_stages=2)
    for epoch in epochs_closed[:-1]:  # the last epoch's records may not carry their last bytes yet
        for stage in epoch["stages"]:
            start, end = config.stage_layers(stage["stage"])
            model = build_stage(config.model_config, start=start, end=end, seed=0)
            numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
            members = stage["digests"]
            assert members in (2, 3), (epoch["epoch"], stage)
            expected = [(round_bytes(numel, members=members, with_rows=depositors, itemsize=WIRE_BYTES["int8"])
                         if members > 2 else 0) + depositors * numel * WIRE_BYTES["int8"]
                        for depositors in range(1, members)]
            assert any(bound <= stage["averaging_bytes"] <= 1.03 * bound for bound in expected), \
                (epoch["epoch"], stage, expected)
    assert swarm.failed() == []


@pytest.mark.timeout(420)
def test_a_swarm_averaging_every_4_epochs_sends_a_quarter_of_the_rounds_keeps_its_anchors_equal_and_learns(make_swarm):
    """`--average-every 4` (DiLoCo): each worker steps on its own gradients and the stage averages only after epochs
    3 and 7, one round of the parameters' moves with no deposits; no bytes are sent for averaging in between, every
    holder's anchor (the digest) agrees at every epoch, every row reaches a step, and the loss falls."""
    epochs = 8
    swarm = make_swarm("diloco", ["--model", "llama-tiny", "--num-stages", "2", "--batch-rows", "8",
                                  "--microbatches", "4", "--seq-len", "64", "--seed", "3", "--average-every", "4",
                                  "--averaging-codec", "fp32"])  # a round's bytes, 4 a value, as counted below
    swarm.start_two_stages({"c0a": "0", "c0b": "0", "c1a": "1", "c1b": "1"}, epochs=epochs)
    report = swarm.wait_finished(timeout=300)
    assert [e["epoch"] for e in report["epochs"]] == list(range(epochs))
    assert all(not e["abandoned"] for e in report["epochs"])
    for epoch in report["epochs"]:
        for stage in epoch["stages"]:
            assert stage["rows_in_batch"] == 8 * 4 == stage["rows_averaged"], epoch
            assert stage["rounds_failed"] == 0 and stage["digests_agree"] is not False, epoch
    assert all(stage["digests_agree"] for stage in report["stages"]), report["stages"]
    losses = [e["loss"] for e in report["epochs"]]
    assert losses[-1] < losses[0] - 0.3, losses
    config = RunConfig(model="llama-tiny", num_stages=2)
    for epoch in report["epochs"][:-1]:  # the last epoch's records may not carry their last bytes yet
        for stage in epoch["stages"]:
            if epoch["epoch"] != 3:
                assert stage["averaging_bytes"] == 0, (epoch["epoch"], stage)
                continue
            start, end = config.stage_layers(stage["stage"])
            model = build_stage(config.model_config, start=start, end=end, seed=0)
            numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
            # 2 clients and the FS; the clients with rows in the interval reduce (one may have none, as in the int8 test)
            expected = [round_bytes(numel, members=3, with_rows=reducers, itemsize=WIRE_BYTES["none"])
                        for reducers in (1, 2)]
            assert any(bound <= stage["averaging_bytes"] <= 1.03 * bound for bound in expected), (stage, expected)
    assert swarm.failed() == []
