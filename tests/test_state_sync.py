"""A joining worker downloads its stage's parameters and optimizer state from a stage mate: in-process through the real
handler, the state arrives bit-equal and keeps training in lockstep; a state of other layers or of another model is
refused; a worker that holds only the seed's weights, or runs in client mode, serves nothing; and over real
hivemind P2P on 127.0.0.1 a state of several MiB (several chunks) arrives bit-equal."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from p2ptrain.client.averaging import StageAllReduce
from p2ptrain.client.state_sync import StageStateServer, load_state_from_peers
from p2ptrain.client.worker import FAILED_AVERAGING_EPOCH, Worker
from p2ptrain.compression import CHUNK_BYTES
from p2ptrain.config import RunConfig, RuntimeConfig
from p2ptrain.models import build_stage
from p2ptrain.models.configs import LlamaConfig, ModelConfig
from p2ptrain.protocol.messages import (
    STAGE_STATE,
    DownloadState,
    GroupMember,
    MessageError,
    StageStateReply,
)
from p2ptrain.state.codec import StateMismatch, encode_state
from p2ptrain.transport import Caller, Refused, Service
from tests.loopback import loopback_p2ps

CONFIG = RunConfig(num_stages=2, rows_per_microbatch=4, microbatches=1, seq_len=8)
TINY = CONFIG.model_config


def make_worker(worker_id: str, *, local: dict[tuple[str, str], Service], stage: int = 0,
                model_config: ModelConfig = TINY, client_mode: bool = False, caller: Caller | None = None,
                **options: object) -> Worker:
    """A worker of `stage` (layers as the run splits them) whose calls reach the servicers in `local`; `options`: more
    of Worker's keywords."""
    start, end = CONFIG.stage_layers(stage)
    model = build_stage(model_config, start=start, end=end, seed=CONFIG.seed)
    caller = caller or Caller(p2p=None, peer_id=worker_id, codec="none", timeout=10.0, local=local)
    return Worker(worker_id=worker_id, stage=stage, config=CONFIG, settings=RuntimeConfig(), model=model,
                  # a group of one averages without the network: the averager is never started
                  averager=StageAllReduce(p2p=None, run_id=CONFIG.run_id, stage=stage, timeout=1.0, caller=caller),
                  caller=caller,
                  servers=lambda: ([], []), compute=1e9, client_mode=client_mode, **options)


def serving(worker: Worker, local: dict[tuple[str, str], Service]) -> Worker:
    local[(worker.worker_id, STAGE_STATE)] = StageStateServer(worker=worker)
    return worker


async def step(worker: Worker, seed: int, *, mates: tuple[str, ...] = ()) -> None:
    """One epoch's step through the worker's own path, on gradients drawn from `seed`, in a group with `mates`
    (alone by default)."""
    generator = torch.Generator().manual_seed(seed)
    for accumulated in worker.accumulated:
        accumulated.copy_(torch.randn(accumulated.shape, generator=generator))
    worker.rows_accumulated = CONFIG.rows_per_microbatch
    await worker._step(tuple(GroupMember(peer_id=peer, client_mode=False) for peer in (worker.worker_id, *mates)))
    await worker.settle()  # with delayed parameter updates the step runs in the background


def assert_same_state(a: Worker, b: Worker) -> None:
    model_a, model_b = a.model.state_dict(), b.model.state_dict()
    assert model_a.keys() == model_b.keys()
    for name in model_a:
        assert model_a[name].dtype == model_b[name].dtype and torch.equal(model_a[name], model_b[name]), name
    optim_a, optim_b = a.master.optimizer.state_dict(), b.master.optimizer.state_dict()
    assert optim_a["param_groups"] == optim_b["param_groups"]
    assert optim_a["state"].keys() == optim_b["state"].keys() and optim_a["state"]
    for index, entries in optim_a["state"].items():
        assert entries.keys() == optim_b["state"][index].keys()
        for name, value in entries.items():
            other = optim_b["state"][index][name]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), (index, name)
            else:
                assert value == other, (index, name)


def test_the_messages_survive_the_wire_and_refuse_an_empty_layer_range():
    request = DownloadState(stage=1, start=2, end=4)
    assert DownloadState.from_header(request.to_header()) == request
    assert (DownloadState.method, DownloadState.reply) == ("rpc_download_state", StageStateReply)
    blob = torch.zeros(3, dtype=torch.uint8)
    reply = StageStateReply.from_header(StageStateReply(epoch=7, blob=blob).to_header(), {"blob": blob})
    assert reply.epoch == 7 and reply.blob is blob
    with pytest.raises(MessageError, match=r"DownloadState.end: layers \[2, 2\)"):
        DownloadState.from_header({"stage": 0, "start": 2, "end": 2})


@pytest.mark.timeout(60)
def test_a_joining_worker_loads_a_mates_state_bit_equal_and_trains_on_in_lockstep():
    async def scenario() -> None:
        local: dict[tuple[str, str], Service] = {}
        mate = serving(make_worker("mate", local=local), local)
        for epoch in range(3):
            await step(mate, seed=epoch)
        assert mate.epoch == 3
        joiner = serving(make_worker("joiner", local=local), local)
        assert await load_state_from_peers(joiner, caller=joiner.caller, candidates=["mate", "joiner"]) == 3
        assert joiner.epoch == 3 and joiner.master.loaded
        assert_same_state(mate, joiner)
        # the optimizer state is whole (moments and step counts): the same gradients keep both bit-equal
        await step(mate, seed=10)
        await step(joiner, seed=10)
        assert_same_state(mate, joiner)
        # a worker that loaded a mate's state serves it on, even before it stepped itself
        later = make_worker("later", local=local)
        await load_state_from_peers(joiner, caller=joiner.caller, candidates=["mate"])  # both now at epoch 4
        assert await load_state_from_peers(later, caller=later.caller, candidates=["joiner"]) == 4
        assert_same_state(mate, later)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_joiner_asks_its_stages_servers_before_its_mates():
    """The servers hold the stage's state whatever the workers do: a joiner takes theirs, and a mate's only when no
    server serves one."""
    async def scenario() -> None:
        local: dict[tuple[str, str], Service] = {}
        server = serving(make_worker("server", local=local), local)
        mates = [serving(make_worker(f"mate{n}", local=local), local) for n in range(4)]
        for epoch in range(2):
            for worker in (server, *mates):
                await step(worker, seed=epoch)
        await step(server, seed=7)  # the server stands an epoch further: whoever served shows in the epoch
        for n in range(5):
            joiner = make_worker(f"joiner{n}", local=local)
            assert await load_state_from_peers(joiner, caller=joiner.caller, servers=["server"],
                                               candidates=[m.worker_id for m in mates]) == 3
        local.pop(("server", STAGE_STATE))  # the server cannot be reached: a mate serves
        joiner = make_worker("joiner", local=local)
        assert await load_state_from_peers(joiner, caller=joiner.caller, servers=["server"],
                                           candidates=[m.worker_id for m in mates]) == 2

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_mate_whose_round_under_way_waits_for_the_asker_refuses_at_once_to_serve_the_state_after_it():
    """Its step of the round would bring it to the asker's epoch, but the round cannot end while the asker waits for
    that step: it says at once to ask again (the asker, left out of that round, loads the state once it ended)."""
    async def scenario() -> None:
        local: dict[tuple[str, str], Service] = {}
        mate = serving(make_worker("mate", local=local), local)
        for epoch in range(2):
            await step(mate, seed=epoch)
        mate._stepping, mate._averaging_with[2] = 2, frozenset({"mate", "asker"})  # its round of epoch 2 under way
        began = time.monotonic()
        with pytest.raises(Refused, match="behind the asker's 3") as refused:
            await StageStateServer(worker=mate).download_state(
                DownloadState(stage=0, start=mate.model.start, end=mate.model.end, at_least=3), "asker")
        assert refused.value.retry_after_s is not None
        assert time.monotonic() - began < mate.settings.averaging_timeout_s / 10

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_replica_left_out_of_a_group_that_no_mate_could_serve_takes_a_mates_state_after_its_next_round():
    """The stage steps an epoch without the replica (left out of its group) while its only mate cannot be reached:
    the replica must not step on from parameters an epoch behind, or it would stand apart from the stage for good."""
    async def scenario() -> None:
        local: dict[tuple[str, str], Service] = {}

        async def from_mate(worker: Worker) -> int | None:
            return await load_state_from_peers(worker, caller=worker.caller, candidates=["mate"], deadline=5.0)

        mate = serving(make_worker("mate", local=local), local)
        replica = serving(make_worker("replica", local=local, download_state=from_mate), local)
        for epoch in range(2):
            await step(mate, seed=epoch)
            await step(replica, seed=epoch)
        assert_same_state(mate, replica)
        served = local.pop(("mate", STAGE_STATE))  # out of reach while the replica looks for the stage's state
        replica.rows_accumulated = CONFIG.rows_per_microbatch
        await replica._step((GroupMember(peer_id="mate", client_mode=False),))
        assert replica.stale and replica.epoch == 3
        with pytest.raises(Refused, match="parameters may stand apart"):  # it serves nobody its parameters
            await StageStateServer(worker=replica).download_state(
                DownloadState(stage=0, start=replica.model.start, end=replica.model.end, at_least=3), "joiner")
        await step(mate, seed=2)  # the stage's step of epoch 2, which the replica never took
        local[("mate", STAGE_STATE)] = served
        await step(mate, seed=3)
        await step(replica, seed=3)  # its round succeeds: in place of its own step, the mate's state after it
        assert not replica.stale and replica.epoch == 4
        assert_same_state(mate, replica)
        await step(mate, seed=4)
        await step(replica, seed=4)
        assert_same_state(mate, replica)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_worker_whose_round_failed_publishes_no_digest_of_the_epoch_it_did_not_step():
    """A groupmate killed mid-round can fail the round for one survivor while another completes it (the dead
    reducer's average reached one of them): the one that failed holds the parameters of the epoch before, so its
    record of the epoch holds no digest that the stage's check would take for replicas standing apart; it counts
    the failed round and reloads."""
    async def scenario() -> None:
        worker = make_worker("w", local={}, fault="failed-averaging")
        for epoch in range(FAILED_AVERAGING_EPOCH):
            await step(worker, seed=epoch)
        await step(worker, seed=FAILED_AVERAGING_EPOCH, mates=("mate",))
        records = {record.epoch: record for record in worker.history}
        assert sorted(records) == list(range(FAILED_AVERAGING_EPOCH + 1))
        assert all(records[e].digest and not records[e].round_failed for e in range(FAILED_AVERAGING_EPOCH))
        failed = records[FAILED_AVERAGING_EPOCH]
        assert failed.round_failed and failed.digest == () and worker.stale, failed

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_state_that_does_not_fit_is_refused_and_the_worker_keeps_its_own():
    async def scenario() -> None:
        local: dict[tuple[str, str], Service] = {}
        other_layers = serving(make_worker("stage1", local=local, stage=1), local)
        other_model = LlamaConfig(hidden_size=32, intermediate_size=88, num_heads=4, num_kv_heads=2,
                                  num_layers=TINY.num_layers)
        other_width = serving(make_worker("narrow", local=local, model_config=other_model), local)
        for worker in (other_layers, other_width):
            await step(worker, seed=0)
        joiner = make_worker("joiner", local=local)
        seed_weights = {name: tensor.clone() for name, tensor in joiner.model.state_dict().items()}

        with pytest.raises(Refused, match=r"holds layers \[2, 4\) of stage 1, not \[0, 2\) of stage 0"):
            await joiner.caller.call("stage1", STAGE_STATE, DownloadState(stage=0, start=0, end=2))
        reply = await joiner.caller.call("narrow", STAGE_STATE, DownloadState(stage=0, start=0, end=2))
        with pytest.raises(StateMismatch, match=r"model entry 'embed.weight' is torch.float32 \[256, 32\], this stage's "
                                                r"is torch.float32 \[256, 64\]"):
            joiner.master.decode(reply.blob)
        with pytest.raises(StateMismatch, match="the state does not decode"):
            joiner.master.decode(torch.arange(100, dtype=torch.uint8))

        assert await load_state_from_peers(joiner, caller=joiner.caller,
                                           candidates=["stage1", "narrow", "nobody"]) is None
        assert joiner.epoch == 0 and not joiner.master.loaded and not joiner.master.optimizer.state
        assert all(torch.equal(tensor, seed_weights[name]) for name, tensor in joiner.model.state_dict().items())

    asyncio.run(scenario())


def test_the_optimizer_state_is_checked_against_the_local_parameters():
    mate, joiner = make_worker("mate", local={}), make_worker("joiner", local={})
    asyncio.run(step(mate, seed=0))
    state = mate.master.optimizer.state_dict()
    exp_avg = state["state"][0]["exp_avg"]
    state["state"][0] = {**state["state"][0], "exp_avg": exp_avg.reshape(-1)[:-1].clone()}
    blob = encode_state({name: t.clone() for name, t in mate.model.state_dict().items()}, state)
    with pytest.raises(StateMismatch, match=r"optimizer entry 'optimizer/0/exp_avg' is torch.float32 \[16383\], this "
                                            r"stage's optimizer keeps torch.float32 \[256, 64\] there"):
        joiner.master.decode(blob)


@pytest.mark.timeout(60)
def test_a_worker_with_only_seed_weights_or_in_client_mode_serves_nothing():
    async def scenario() -> None:
        local: dict[tuple[str, str], Service] = {}
        fresh = serving(make_worker("fresh", local=local), local)
        behind_nat = serving(make_worker("nat", local=local, client_mode=True), local)
        await step(behind_nat, seed=0)
        joiner = make_worker("joiner", local=local)
        request = DownloadState(stage=0, start=0, end=2)
        with pytest.raises(Refused, match="holds only the seed's weights: it has not stepped since it started"):
            await joiner.caller.call("fresh", STAGE_STATE, request)
        with pytest.raises(Refused, match="a client-mode worker does not serve its state"):
            await joiner.caller.call("nat", STAGE_STATE, request)
        assert await load_state_from_peers(joiner, caller=joiner.caller, candidates=["fresh", "nat"]) is None
        await step(fresh, seed=1)  # one step and it is the stage's state
        assert await load_state_from_peers(joiner, caller=joiner.caller, candidates=["fresh", "nat"]) == 1
        assert_same_state(fresh, joiner)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_state_of_several_chunks_crosses_real_p2p_bit_equal():
    # wide enough that the state (parameters and two AdamW moments) spans several 1 MiB chunks
    wide = LlamaConfig(hidden_size=128, intermediate_size=352, num_heads=4, num_kv_heads=2,
                       num_layers=TINY.num_layers)

    async def scenario() -> None:
        async with loopback_p2ps(2, timeout=20) as (serving_p2p, joining_p2p):
            mate_id, joiner_id = serving_p2p.peer_id.to_base58(), joining_p2p.peer_id.to_base58()
            mate = make_worker(mate_id, local={}, model_config=wide)
            await StageStateServer(worker=mate).add_p2p_handlers(serving_p2p)
            await step(mate, seed=0)
            joiner = make_worker(joiner_id, local={}, model_config=wide,
                                 caller=Caller(p2p=joining_p2p, peer_id=joiner_id, codec="none", timeout=20.0))
            reply = await joiner.caller.call(mate_id, STAGE_STATE, DownloadState(stage=0, start=0, end=2))
            assert reply.blob.numel() > 4 * CHUNK_BYTES
            assert await load_state_from_peers(joiner, caller=joiner.caller, candidates=[mate_id], timeout=20.0,
                                               deadline=20.0) == 1
            assert_same_state(mate, joiner)

    asyncio.run(scenario())
