from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import hivemind
import pydantic.v1 as pydantic
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.dht import (
    Announcer,
    CachedSchemaValidator,
    EpochMetrics,
    Link,
    Membership,
    Metrics,
    PeerInfo,
    PlanRecord,
    RecipeRecord,
    get_metrics,
    get_peers,
    get_plan,
    get_recipe,
    get_stage_members,
    make_validators,
    owned_subkey,
    peers_key,
    stage_key,
)

RUN = "testrun"


@dataclass
class Peer:
    dht: hivemind.DHT
    key: bytes  # local_public_key of the peer's signer


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[Peer, Peer]]:
    """Two loopback DHT peers, each signing with its own RSA key (as two processes would)."""
    started: list[hivemind.DHT] = []
    try:
        result = []
        for _ in range(2):
            signer = RSASignatureValidator(RSAPrivateKey())
            dht = hivemind.DHT(
                start=True,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=started[0].get_visible_maddrs() if started else None,
                record_validators=make_validators(RUN, signer=signer),
            )
            started.append(dht)
            result.append(Peer(dht, signer.local_public_key))
        yield result[0], result[1]
    finally:
        for dht in started:
            dht.shutdown()


def _info(peer_id: str, **changes: object) -> PeerInfo:
    info = PeerInfo(
        peer_id=peer_id, role="server", server_role="fs", stage=1, reliable=True, computes=False, compute=2e12,
        memory=8 << 30, maddrs=["/ip4/127.0.0.1/tcp/4000"], state="online", started=get_dht_time(),
        links={"other": Link(latency_s=0.02, bandwidth_bps=1.25e8)},
    )
    return replace(info, **changes)


def _mine(records: list, peer_id: str) -> list:
    return [r for r in records if r.peer_id == peer_id]


def test_records_round_trip_and_membership_moves(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    ann = Announcer(dht=a.dht, run_id=RUN, peer_id="rt", owner_key=a.key, period_s=5, ttl_s=30, start=False)
    info = _info("rt")
    metrics = Metrics(
        peer_id="rt", stage=1, role="fs", epoch=3, loss=2.5, tokens_per_s=1000, rows_in_batch=64, rows_averaged=64,
        tasks_redone=1, updated=get_dht_time(),
        per_epoch=[EpochMetrics(epoch=e, rows_in_batch=64, rows_averaged=64, tasks_redone=e % 2, loss=3.0 - e / 2,
                                tokens=8192) for e in range(4)],
    )
    ann.set_peer_info(info)
    ann.set_membership(1, Membership(peer_id="rt", role="fs", compute=2e12, load=0.5))
    ann.set_metrics(metrics)
    assert ann.refresh()
    # read from the other peer: the records travelled through the DHT
    assert _mine(get_peers(b.dht, RUN), "rt") == [info]
    membership = Membership(peer_id="rt", role="fs", compute=2e12, load=0.5)
    assert _mine(get_stage_members(b.dht, RUN, 1), "rt") == [membership]
    assert _mine(get_metrics(b.dht, RUN), "rt") == [metrics]
    # moving to another stage withdraws the old membership
    ann.set_membership(2, Membership(peer_id="rt", role="worker", compute=2e12))
    assert ann.refresh()
    assert _mine(get_stage_members(b.dht, RUN, 1), "rt") == []
    assert [m.role for m in _mine(get_stage_members(b.dht, RUN, 2), "rt")] == ["worker"]
    ann.shutdown()
    assert _mine(get_peers(b.dht, RUN), "rt") == []
    assert _mine(get_metrics(a.dht, RUN), "rt") == []


def test_wrong_schema_is_rejected(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    with pytest.raises(ValueError, match="role"):
        _info("bad", role="wizard").to_value()
    value = _info("bad").to_value()
    for broken in ({**value, "compute": 5}, {**value, "extra": 1}, {k: v for k, v in value.items() if k != "stage"}):
        stored = b.dht.store(peers_key(RUN), broken, get_dht_time() + 30, subkey=owned_subkey("bad", b.key))
        assert stored is False
    partial = {"peer_id": "bad"}
    assert b.dht.store(stage_key(RUN, 0), partial, get_dht_time() + 30, subkey=owned_subkey("bad", b.key)) is False
    assert _mine(get_peers(a.dht, RUN), "bad") == []
    assert _mine(get_stage_members(a.dht, RUN, 0), "bad") == []
    # the same value, well formed, is accepted: the rejections above were the schema's doing
    assert b.dht.store(peers_key(RUN), value, get_dht_time() + 30, subkey=owned_subkey("bad", b.key)) is True
    assert _mine(get_peers(a.dht, RUN), "bad") == [_info("bad", started=value["started"])]


def test_the_schema_validator_checks_each_distinct_record_once_and_still_refuses_bad_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[bytes] = []
    original = SchemaValidator.validate

    def counting(self: SchemaValidator, record: DHTRecord) -> bool:
        checked.append(record.value)
        return original(self, record)

    monkeypatch.setattr(SchemaValidator, "validate", counting)
    [_, schema] = make_validators(RUN)
    assert isinstance(schema, CachedSchemaValidator)
    key = DHTID.generate(source=peers_key(RUN)).to_bytes()
    subkey = MSGPackSerializer.dumps(owned_subkey("p", RSASignatureValidator(RSAPrivateKey()).local_public_key))

    def record(value: dict) -> DHTRecord:
        return DHTRecord(key=key, subkey=subkey, value=MSGPackSerializer.dumps(value),
                         expiration_time=get_dht_time() + 30)

    good, bad = _info("p").to_value(), {**_info("p").to_value(), "compute": 5}
    assert [schema.validate(record(good)) for _ in range(3)] == [True] * 3
    assert [schema.validate(record(bad)) for _ in range(3)] == [False] * 3
    assert len(checked) == 2  # each distinct record went through pydantic once
    changed = {**good, "state": "joining"}
    assert schema.validate(record(changed)) and len(checked) == 3
    # another schema merged in may accept what this one refused: the verdicts are forgotten
    other = SchemaValidator(pydantic.create_model("Other", other=(int, None)), prefix=RUN)
    assert schema.merge_with(other)
    assert not schema.validate(record(bad)) and len(checked) == 4
    # bounded: at cache_size distinct records it starts again
    schema.cache_size = 2
    for value in (good, changed, good):
        schema.validate(record(value))
    assert len(checked) == 7


def test_a_record_too_large_for_the_dht_process_is_refused_before_it_is_sent(peers: tuple[Peer, Peer]) -> None:
    a, _ = peers
    ann = Announcer(dht=a.dht, run_id=RUN, peer_id="big", owner_key=a.key, period_s=5, ttl_s=30, start=False)
    links = {f"peer{i:05d}" + "x" * 40: Link(latency_s=0.01, bandwidth_bps=1e8) for i in range(400)}
    with pytest.raises(ValueError, match="too large"):
        ann.set_peer_info(_info("big", links=links))
    assert ann.refresh() and _mine(get_peers(a.dht, RUN), "big") == []
    ann.shutdown()


def test_peer_cannot_overwrite_another_peers_record(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    ann = Announcer(dht=a.dht, run_id=RUN, peer_id="victim", owner_key=a.key, period_s=5, ttl_s=30, start=False)
    original = _info("victim")
    ann.set_peer_info(original)
    assert ann.refresh()
    forged = _info("victim", compute=1.0, state="offline").to_value()
    # b signs with its own key, but the subkey names a's key: the signature cannot verify
    assert b.dht.store(peers_key(RUN), forged, get_dht_time() + 60, subkey=owned_subkey("victim", a.key)) is False
    # an announcer on b that claims a's key is refused the same way
    impostor = Announcer(dht=b.dht, run_id=RUN, peer_id="victim", owner_key=a.key, period_s=5, ttl_s=60, start=False)
    impostor.set_peer_info(_info("victim", compute=1.0))
    assert impostor.refresh() is False
    for dht in (a.dht, b.dht):
        assert _mine(get_peers(dht, RUN), "victim") == [original]
    ann.shutdown()


def test_records_expire_unless_refreshed(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    vanishing = Announcer(dht=b.dht, run_id=RUN, peer_id="gone", owner_key=b.key, period_s=0.5, ttl_s=1.0, start=False)
    vanishing.set_peer_info(_info("gone"))
    assert vanishing.refresh()
    living = Announcer(dht=b.dht, run_id=RUN, peer_id="alive", owner_key=b.key, period_s=0.3, ttl_s=1.0)
    try:
        living.set_peer_info(_info("alive"))
        deadline = time.monotonic() + 5
        while not _mine(get_peers(a.dht, RUN), "alive") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.peer_id for p in get_peers(a.dht, RUN) if p.peer_id in ("gone", "alive")] == ["alive", "gone"]
        time.sleep(1.6)  # longer than ttl: only the refreshed record is left
        assert [p.peer_id for p in get_peers(a.dht, RUN) if p.peer_id in ("gone", "alive")] == ["alive"]
    finally:
        living.shutdown()


def test_plan_from_a_non_planner_key_is_ignored(peers: tuple[Peer, Peer], caplog: pytest.LogCaptureFixture) -> None:
    planner, other = peers
    ann = Announcer(dht=planner.dht, run_id=RUN, peer_id="planner", owner_key=planner.key, period_s=5, ttl_s=30,
                    start=False)
    rogue = Announcer(dht=other.dht, run_id=RUN, peer_id="rogue", owner_key=other.key, period_s=5, ttl_s=30,
                      start=False)
    layout = {"stages": [{"layers": [0, 2], "fs": ["p1"], "bs": ["p2"]}]}
    real = PlanRecord(plan=layout, version=1, created=get_dht_time())
    fake = PlanRecord(plan={"stages": []}, version=7, created=get_dht_time())
    ann.set_plan(real)
    rogue.set_plan(fake)
    assert ann.refresh() and rogue.refresh()
    with caplog.at_level(logging.WARNING, logger="p2ptrain.dht.readers"):
        assert get_plan(other.dht, RUN, planner.key) == real
    assert any("not the planner's" in r.getMessage() for r in caplog.records)
    assert get_plan(planner.dht, RUN, None) == fake  # trusting everyone picks the highest version
    assert get_plan(planner.dht, RUN, other.key) == fake
    # the planner's own entry can be updated by the planner
    newer = PlanRecord(plan={"stages": [{"layers": [0, 4]}]}, version=2, created=get_dht_time())
    ann.set_plan(newer)
    assert ann.refresh()
    assert get_plan(other.dht, RUN, planner.key) == newer


def test_readers_take_the_recipe_of_the_data_source_among_the_stage_0_fs(peers: tuple[Peer, Peer]) -> None:
    """Two stage-0 FS publish different recipes; every reader takes the one of the data source (the smallest peer
    id without an owner), and none while no stage-0 FS is announced."""
    from p2ptrain.config import RunConfig
    from p2ptrain.recipe import Recipe

    run = "recipe-run"
    a, b = peers
    assert get_recipe(b.dht, run) is None
    announcers = {}
    for peer, peer_id, seq_len in ((a, "fs-b", 48), (b, "fs-a", 32)):
        announcer = Announcer(dht=peer.dht, run_id=run, peer_id=peer_id, owner_key=peer.key, period_s=5, ttl_s=30,
                              start=False)
        announcer.set_recipe(RecipeRecord(peer_id=peer_id, created=get_dht_time(),
                                          recipe=Recipe.of(RunConfig(run_id=run, seq_len=seq_len)).to_value()))
        announcers[peer_id] = announcer
        assert announcer.refresh()
    assert get_recipe(a.dht, run) is None  # recipes, but no data source announced yet
    announcers["fs-b"].set_membership(0, Membership(peer_id="fs-b", role="fs", compute=1.0))
    assert announcers["fs-b"].refresh()
    assert get_recipe(a.dht, run)[0] == "fs-b"
    announcers["fs-a"].set_membership(0, Membership(peer_id="fs-a", role="fs", compute=1.0))
    assert announcers["fs-a"].refresh()
    source, recipe = get_recipe(a.dht, run)
    assert source == "fs-a" and recipe.config.seq_len == 32 and recipe == Recipe.of(RunConfig(run_id=run, seq_len=32))
    for announcer in announcers.values():
        announcer.shutdown()


class _FakeDHT:
    """Answers get() like hivemind.DHT does for a key with subkeys, as a DHT without validators could; with a future,
    as the readers ask for one (`readers.READ_TIMEOUT_S`)."""

    def __init__(self, entries: dict[object, hivemind.utils.ValueWithExpiration]):
        self.entries = entries

    def get(self, key: str, latest: bool, return_future: bool) -> concurrent.futures.Future:
        assert latest and return_future
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(hivemind.utils.ValueWithExpiration(self.entries, get_dht_time() + 30))
        return future


def test_readers_skip_malformed_entries(caplog: pytest.LogCaptureFixture) -> None:
    key = RSASignatureValidator(RSAPrivateKey()).local_public_key
    later, earlier = get_dht_time() + 30, get_dht_time() - 1
    good = _info("good")
    entries = {
        owned_subkey("good", key): hivemind.utils.ValueWithExpiration(good.to_value(), later),
        owned_subkey("typo", key): hivemind.utils.ValueWithExpiration({**good.to_value(), "compute": "fast"}, later),
        owned_subkey("liar", key): hivemind.utils.ValueWithExpiration(_info("good").to_value(), later),
        owned_subkey("left", key): hivemind.utils.ValueWithExpiration(None, later),
        owned_subkey("old", key): hivemind.utils.ValueWithExpiration(_info("old").to_value(), earlier),
        "text-subkey": hivemind.utils.ValueWithExpiration(good.to_value(), later),
        b"no-owner": hivemind.utils.ValueWithExpiration(good.to_value(), later),
    }
    with caplog.at_level(logging.WARNING, logger="p2ptrain.dht.readers"):
        assert get_peers(_FakeDHT(entries), RUN) == [good]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "PeerInfoModel" in messages and "stored under peer liar" in messages
    assert "non-bytes subkey" in messages and "no owner key" in messages


def test_membership_reads_back_off_while_nothing_changes_and_come_back_on_a_change_or_a_suspicion() -> None:
    """An idle swarm reads the DHT little (issue 21): unchanged reads double the wait up to the idle period, a read
    that finds the servers changed brings it back to the base period, and so does a server that did not answer
    (`suspect`), whose next read comes within the base period of the last one instead of the idle one."""
    from p2ptrain.dht.membership import MembershipCache
    from p2ptrain.protocol.layout import StageServers

    async def scenario() -> list[float]:
        cache = MembershipCache(dht=None, run_id=RUN, num_stages=1, period_s=0.1, retry_s=0.01, idle_period_s=0.8)
        loop, reads, servers = asyncio.get_running_loop(), [], [StageServers(fs=("fs",), bs=("bs",))]
        start = loop.time()

        def read() -> tuple[list[StageServers], list[frozenset[str]]]:
            reads.append(loop.time() - start)
            if len(reads) == 6:  # a server joins
                servers[0] = StageServers(fs=("fs", "fs2"), bs=("bs",))
            return list(servers), [frozenset()]

        cache.read = read
        stop = asyncio.Event()
        task = asyncio.create_task(cache.run(stop))
        deadline = start + 10.0
        while len(reads) < 9 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        cache.suspect()
        suspected = loop.time() - start
        while len(reads) < 10 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 5.0)
        return [*reads, suspected]

    *reads, suspected = asyncio.run(scenario())
    waits = [b - a for a, b in zip(reads, reads[1:])]
    assert len(reads) == 10, reads
    # the first read finds the servers (a change), the next four back off; the sixth finds fs2, the next three back
    # off again; the tenth follows a suspicion
    for wait, wanted in zip(waits, [0.1, 0.2, 0.4, 0.8, 0.8, 0.1, 0.2, 0.4]):
        assert wanted - 0.01 <= wait < wanted + 0.15, (waits, reads)
    assert reads[9] - reads[8] < 0.1 + 0.15 and reads[9] <= max(suspected, reads[8] + 0.1) + 0.15, (reads, suspected)


def test_a_server_that_needs_a_fresh_read_has_one_within_the_retry_period_however_many_ask() -> None:
    """A server handed a layout naming a server it has not read (`MembershipCache.refreshed`) gets a read that began
    after it asked, within `retry_s` of the last read instead of the period; ten servers' worth of asking at once
    cost one read, and a read that does not come in time ends the wait at its timeout."""
    from p2ptrain.dht.membership import MembershipCache
    from p2ptrain.protocol.layout import StageServers

    async def scenario() -> None:
        cache = MembershipCache(dht=None, run_id=RUN, num_stages=1, period_s=2.0, retry_s=0.2, idle_period_s=30.0)
        loop, reads = asyncio.get_running_loop(), []
        servers = StageServers(fs=("fs",), bs=("bs",))

        def read() -> tuple[list[StageServers], list[frozenset[str]]]:
            reads.append(loop.time())
            return [servers], [frozenset()]

        cache.read = read
        stop = asyncio.Event()
        task = asyncio.create_task(cache.run(stop))
        while not reads:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        servers = StageServers(fs=("fs",), bs=("bs", "bs2"))  # a BS announced itself after the last read
        asked = loop.time()
        await asyncio.wait_for(asyncio.gather(*(cache.refreshed(timeout=5.0) for _ in range(10))), 5.0)
        assert cache.authorizes("bs2", 0, "bs") and len(reads) == 2, reads
        assert asked < reads[1] <= reads[0] + 0.2 + 0.5 and loop.time() - asked < 1.0, (asked, reads)
        await asyncio.sleep(0.5)  # and then the period again: the next read is 2 s after the last
        assert len(reads) == 2
        cache.read = lambda: time.sleep(1.0) or read()  # a slow DHT: the wait ends at its timeout
        started = loop.time()
        await cache.refreshed(timeout=0.3)
        assert 0.25 < loop.time() - started < 0.9
        stop.set()
        await asyncio.wait_for(task, 5.0)

    asyncio.run(scenario())
