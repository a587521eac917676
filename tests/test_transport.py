"""`Caller.exchange`, the one path of every RPC: a call whose caller is cancelled ends in CancelledError, also when
the reply is ready at that moment (Python 3.11's asyncio.wait_for returned the reply then, and the cancelled task ran
on: a round's watch kept probing, and the round never ended). A peer that floods a servicer with malformed requests
over real p2p daemons is banned, and its requests are refused unread meanwhile; another peer is still served."""
from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from p2ptrain import transport
from p2ptrain.cli import LOOPBACK
from p2ptrain.live.probe import LinkProbe
from p2ptrain.protocol.bans import BanList
from p2ptrain.protocol.messages import LINK_PROBE, Probe
from p2ptrain.transport import Caller, Envelope, Refused
from tests.loopback import loopback_p2ps


def test_a_cancelled_call_is_cancelled_even_when_its_reply_lands_at_that_moment():
    async def main() -> None:
        caller = Caller(p2p=None, peer_id="me", codec="none", timeout=5.0)
        release = asyncio.Event()

        async def answer(*_: object, **__: object) -> Envelope:  # stands for the transport: the reply comes when released
            await release.wait()
            return Envelope({})

        caller._exchange = answer
        call = asyncio.create_task(caller.exchange("peer", "service", "rpc_method", Envelope({})))
        await asyncio.sleep(0)  # the call waits for its reply
        release.set()  # the reply lands...
        call.cancel()  # ...in the same turn of the loop as the caller's cancellation
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep_streams", [False, True], ids=["new-streams", "kept-streams"])
def test_a_peer_that_floods_a_servicer_with_malformed_requests_is_banned_and_then_refused_unread(monkeypatch,
                                                                                                keep_streams):
    decoded = 0
    real_from_header = Probe.from_header

    def counting_from_header(header, tensors):  # counts the requests the servicer decodes: no banned peer's
        nonlocal decoded
        decoded += 1
        return real_from_header(header, tensors)

    async def main() -> None:
        async with loopback_p2ps(3) as (server, attacker, honest):
            server_id = server.peer_id.to_base58()
            probe = LinkProbe(peer_id=server_id)
            await probe.add_p2p_handlers(server)
            callers = {name: Caller(p2p=p2p, peer_id=p2p.peer_id.to_base58(), codec="none", timeout=10.0,
                                    keep_streams=keep_streams) for name, p2p in (("attacker", attacker), ("honest", honest))}
            reasons = []
            for i in range(200):
                malformed = Envelope({"payload": "not a tensor", "junk": i})  # decodes as no Probe
                reply = await callers["attacker"].exchange(server_id, LINK_PROBE, Probe.method, malformed)
                reasons.append(reply.header[transport.REFUSED])
            banned_at = next(i for i, reason in enumerate(reasons) if reason.startswith("banned"))
            assert banned_at == BanList().offences  # the offence that banned it was refused for what it was
            assert all(reason.startswith("banned") for reason in reasons[banned_at:])
            assert decoded == banned_at
            with pytest.raises(Refused, match="banned"):  # a well-formed request too, while the ban lasts
                await callers["attacker"].call(server_id, LINK_PROBE, Probe())
            assert decoded == banned_at
            await callers["honest"].call(server_id, LINK_PROBE, Probe())
            assert decoded == banned_at + 1
            assert probe.bans.banned(now=transport.time.monotonic()) == (attacker.peer_id.to_base58(),)

    monkeypatch.setattr(Probe, "from_header", counting_from_header)
    asyncio.run(main())


def test_bytes_for_an_epoch_are_counted_apart_and_only_the_newest_epochs_are_kept():
    from p2ptrain.traffic import Traffic

    traffic = Traffic(epochs_kept=2)
    traffic.count("averaging", 10, epoch=3)
    traffic.count("averaging", 5, epoch=3)
    traffic.count("averaging", 7)
    traffic.count("control", 1, epoch=3)
    assert traffic.of_epoch("averaging", 3) == 15 and traffic.of_epoch("control", 3) == 1
    assert traffic.snapshot()["averaging"] == 22
    traffic.count("averaging", 1, epoch=4)
    traffic.count("averaging", 2, epoch=5)
    assert (traffic.of_epoch("averaging", 3), traffic.of_epoch("averaging", 5)) == (0, 2)
    with pytest.raises(ValueError, match="unknown traffic kind"):
        traffic.count("gossip", 1)


@pytest.mark.timeout(120)
def test_a_call_over_the_network_counts_its_request_and_reply_bytes_by_kind_and_a_local_call_counts_none():
    from hivemind.proto import runtime_pb2

    from p2ptrain.protocol.messages import Echo
    from p2ptrain.traffic import METER

    async def main() -> None:
        async with loopback_p2ps(2) as (server, client):
            server_id = server.peer_id.to_base58()
            probe = LinkProbe(peer_id=server_id)
            await probe.add_p2p_handlers(server)
            caller = Caller(p2p=client, peer_id=client.peer_id.to_base58(), codec="none", timeout=10.0)
            request = Probe(payload=torch.zeros(50_000, dtype=torch.uint8))
            before, served = METER.snapshot(), METER.served_snapshot().get(Probe.method, 0)
            reply = await caller.call(server_id, LINK_PROBE, request)
            after = METER.snapshot()
            assert METER.served_snapshot()[Probe.method] == served + 1  # the requests served, by method
            sent = transport.pack(Envelope(request.to_header(), request.tensors()), codec="none",
                                  proto=runtime_pb2.ExpertRequest)
            answered = transport.pack(Envelope(reply.to_header(), reply.tensors()), codec="none",
                                      proto=runtime_pb2.ExpertResponse)
            assert isinstance(reply, Echo) and reply.received == 50_000
            assert after["probes"] - before["probes"] == (sum(m.ByteSize() for m in sent)
                                                          + sum(m.ByteSize() for m in answered))
            assert after["probes"] - before["probes"] > 50_000
            assert {k: v for k, v in after.items() if k != "probes"} == {k: v for k, v in before.items()
                                                                         if k != "probes"}
            local = Caller(p2p=None, peer_id=server_id, codec="none", timeout=10.0)
            local.add_local(probe)
            await local.call(server_id, LINK_PROBE, request)
            assert METER.snapshot() == after
            assert METER.served_snapshot()[Probe.method] == served + 2

    asyncio.run(main())


def test_a_refusal_that_says_when_to_ask_again_reaches_the_caller_with_that_delay():
    class Busy(LinkProbe):
        async def echo(self, request: Probe, sender: str):
            raise Refused("behind; ask again", retry_after_s=1.5)

    async def main() -> None:
        caller = Caller(p2p=None, peer_id="asker", codec="none", timeout=5.0)
        caller.add_local(Busy(peer_id="server"))
        with pytest.raises(Refused, match="behind; ask again") as refused:
            await caller.call("server", LINK_PROBE, Probe())
        assert refused.value.retry_after_s == 1.5
        refusal = Busy(peer_id="x").refusal("no")
        assert set(transport.msgpack.unpackb(refusal[0].metadata)["header"]) == {transport.REFUSED}

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_calls_over_kept_streams_reuse_one_stream_each_run_alone_and_a_peer_gone_fails_the_next_call_at_once(
        tmp_path):
    from p2ptrain.protocol.messages import Echo

    identity = tmp_path / "server.key"

    async def main() -> None:
        server = await asyncio.wait_for(P2P.create(host_maddrs=[LOOPBACK], identity_path=str(identity)), 30)
        client = await asyncio.wait_for(P2P.create(host_maddrs=[LOOPBACK],
                                                   initial_peers=await server.get_visible_maddrs()), 30)
        opened: list[str] = []
        open_stream = client.call_binary_stream_handler

        async def counted(peer, name):
            opened.append(name)
            return await open_stream(peer, name)

        client.call_binary_stream_handler = counted
        try:
            server_id = server.peer_id.to_base58()
            await LinkProbe(peer_id=server_id).add_p2p_handlers(server)
            caller = Caller(p2p=client, peer_id=client.peer_id.to_base58(), codec="none", timeout=10.0,
                            keep_streams=True)
            sizes = [0, 10, 3_000_000, 0, 1_500_000, 7]  # 3 MB travels as 3 chunks: a call's end is found exactly
            for size in sizes:
                request = Probe(payload=torch.ones(size, dtype=torch.uint8) if size else None)
                reply = await caller.call(server_id, LINK_PROBE, request)
                assert isinstance(reply, Echo) and reply.received == size
            assert opened == [f"{LINK_PROBE}.{transport.CALLS}"]  # every call on the stream the first one opened

            replies = await asyncio.gather(*(caller.call(server_id, LINK_PROBE, Probe(payload=torch.ones(
                100 * i + 1, dtype=torch.uint8))) for i in range(5)))  # at once: each on a stream of its own
            assert [reply.received for reply in replies] == [100 * i + 1 for i in range(5)]
            assert len(opened) == 5 and len(caller._kept[(server_id, LINK_PROBE)]) == 5

            unknown = Envelope(Probe().to_header())
            reply = await caller.exchange(server_id, LINK_PROBE, "rpc_no_such_handler", unknown)
            assert "no handler 'rpc_no_such_handler'" in reply.header[transport.REFUSED]
            await caller.call(server_id, LINK_PROBE, Probe())  # the refused call's stream was closed, others serve

            port = next(m for m in await server.get_visible_maddrs()).value_for_protocol("tcp")
            await server.shutdown()  # the same peer comes back on its address: a kept stream's end went meanwhile
            server = await asyncio.wait_for(P2P.create(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"],
                                                       identity_path=str(identity)), 30)
            await LinkProbe(peer_id=server_id).add_p2p_handlers(server)
            reply = await caller.call(server_id, LINK_PROBE, Probe(payload=torch.ones(3, dtype=torch.uint8)))
            assert reply.received == 3  # the broken kept stream cost nothing: the call went on a new one

            await server.shutdown()  # gone for good
            started = asyncio.get_running_loop().time()
            with pytest.raises(Exception) as kept_failed:
                await caller.call(server_id, LINK_PROBE, Probe())
            assert asyncio.get_running_loop().time() - started < 5.0  # not the 10 s timeout
            fresh = Caller(p2p=client, peer_id=client.peer_id.to_base58(), codec="none", timeout=10.0)
            with pytest.raises(Exception) as fresh_failed:
                await fresh.call(server_id, LINK_PROBE, Probe())
            assert type(kept_failed.value) is type(fresh_failed.value)  # the dial's failure, as without kept streams
            caller.close()
            assert caller._kept == {}
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


SLOW_PROBE = """
import asyncio, json, sys
from hivemind.p2p import P2P
from p2ptrain.live.probe import LinkProbe

async def main():
    p2p = await P2P.create(host_maddrs=[sys.argv[1]])
    await LinkProbe(peer_id=p2p.peer_id.to_base58(), delay_s=5.0).add_p2p_handlers(p2p)
    print(json.dumps([p2p.peer_id.to_base58(), [str(m) for m in await p2p.get_visible_maddrs()]]), flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep_streams", [False, True], ids=["new-streams", "kept-streams"])
def test_a_call_in_flight_when_its_peer_is_killed_fails_at_once_not_at_its_deadline(keep_streams):
    """The peer (a process and its p2p daemon) is SIGKILLed while it holds a call over a stream an earlier call
    opened. hivemind's own stream reader waits for its writer to end before it ends, and a kept stream's writer waits
    for the next call: read that way, the call hung until its deadline (60 s in a swarm, where the worker making it
    was then counted gone)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    async def main() -> None:
        server = subprocess.Popen([sys.executable, "-c", SLOW_PROBE, LOOPBACK], stdout=subprocess.PIPE,
                                  start_new_session=True)
        try:
            server_id, maddrs = json.loads(await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 60))
            client = await asyncio.wait_for(P2P.create(host_maddrs=[LOOPBACK], initial_peers=maddrs), 30)
            try:
                caller = Caller(p2p=client, peer_id=client.peer_id.to_base58(), codec="none", timeout=30.0,
                                keep_streams=keep_streams)
                await caller.call(server_id, LINK_PROBE, Probe())  # opens the stream the next call goes over
                call = asyncio.create_task(caller.call(server_id, LINK_PROBE, Probe()))
                await asyncio.sleep(1.0)  # the server holds it (5 s)
                os.killpg(server.pid, signal.SIGKILL)
                started = asyncio.get_running_loop().time()
                with pytest.raises(Exception) as failed:
                    await call
                assert not isinstance(failed.value, TimeoutError)
                assert asyncio.get_running_loop().time() - started < 5.0
            finally:
                await client.shutdown()
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    asyncio.run(main())
