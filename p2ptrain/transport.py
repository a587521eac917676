"""Typed messages over hivemind's libp2p streaming RPCs: a msgpack header plus named tensors.

Tensors always travel as streams of chunks of at most 1 MiB: hivemind refuses unary requests over 4 MiB and a unary
response over 4 MiB hangs the caller (docs/design.md §7). Streaming stubs take no timeout, so every call is wrapped,
in a deadline that follows the link (`protocol.deadlines`): the call's timeout plus the time its request's bytes need
at the rate measured to that peer in earlier calls, times a slack; and each chunk of the reply that arrives moves the
deadline to at least the timeout from then. A big transfer on a slow link that keeps moving never fails; a silent
peer fails it as before. (Chunks handed to the local daemon are no measure: it buffers megabytes.) On the serving
side each chunk that arrives tells the node's `Hearing` that its sender is alive, however slowly it sends.

A caller may keep its streams (`Caller(keep_streams=True)`): a call then goes over a stream left open by an earlier
call to the same service of the same peer (`Service.rpc_calls`, which serves calls on one stream one after another,
its first part naming the handler), and a new one is opened only when none is free. Opening a stream costs more than
a small call itself: a Unix socket to the daemon and a libp2p stream negotiated on the link, about 2.7 ms of CPU
across both processes and their daemons on this machine for a header-only call against 0.5 ms on an open stream (and
a round trip more on a WAN link); a 2-stage swarm makes some 75 calls a second. Peers keep streams by default
(`--keep-streams off` opens one per call).

The caller, not the server, ends every stream. A message's header announces how many tensor chunks follow, so the
caller knows when it holds the whole reply and closes the stream then; the server keeps its end open until that
happens (up to `LINGER_S`). Why: p2pd pipes each libp2p stream to a Unix socket and resets the stream as soon as
either side closes, and a reset discards whatever the receiving daemon had not yet handed to its Python peer, so
a reply the server closed right after writing was sometimes lost on a loaded machine ("the peer sent an empty
stream"; docs/design.md §7). Work a handler leaves for after its reply (`Service.spawn`) runs as a task of the
servicer, not of the stream, so a caller that goes away never cancels it halfway; so does work a handler must not
leave halfway before its reply (`Service.unbroken`).

A servicer (`Service`) decodes every request into its `protocol.messages` type before its handler sees it. A request
that does not decode, or that the handler refuses (`Refused`), is answered with a refusal naming the reason and
logged as a warning naming the sender; no exception escapes a handler. The caller (`Caller.call`) gets the typed
reply, or `Refused` with the server's reason. A request that does not decode, or that claims an authority its sender
lacks (`Forbidden`), is an offence: a peer that offends too often is banned (`protocol.bans`), and its requests are
refused unread until its ban ends.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack
import torch
from hivemind.p2p import P2P, P2PContext, P2PHandlerError, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import achain, as_aiter

from p2ptrain.compression import as_chunks, deserialize, serialize
from p2ptrain.config import RuntimeConfig
from p2ptrain.protocol.bans import BanList
from p2ptrain.protocol.deadlines import Throughput
from p2ptrain.protocol.messages import Message, MessageError, Request
from p2ptrain.traffic import METER

Proto = TypeVar("Proto", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)
# what every handler takes and returns: hivemind reads these hints to register streaming handlers, and it knows
# typing's AsyncIterator only, not collections.abc's
Requests = typing.AsyncIterator[runtime_pb2.ExpertRequest]
Responses = typing.AsyncIterator[runtime_pb2.ExpertResponse]
R = TypeVar("R", bound=Request)
T = TypeVar("T")

logger = logging.getLogger(__name__)

REFUSED = "refused"  # the header key of a refusal; no message has a field of that name...
RETRY_AFTER = "retry_after_s"  # ...nor of this one, a refusal's `Refused.retry_after_s` when set
LINGER_S = 60.0  # longest a server keeps a stream open after its reply, waiting for the caller to close it (or, on
# a kept stream, to send its next call)
KEPT_IDLE_S = 10.0  # a caller opens a new stream rather than use one its calls left idle this long (below LINGER_S)
KEPT_PER_SERVICE = 8  # kept streams a caller holds idle to one service of one peer at most
CALLS = "rpc_calls"  # the handler of every `Service` that serves calls on a kept stream
BANNED_LINGER_S = 1.0  # the same for a banned peer's refusal: long enough on a sound link, and a flood costs little


class Refused(Exception):
    """The peer refused the request (malformed, or not acceptable now); the text is its reason, and `retry_after_s`,
    if set, says that the same request is likely to be served if asked again after that long.

    Handlers raise it to refuse; `Caller.call` raises it when the peer refused."""

    def __init__(self, reason: str, *, retry_after_s: float | None = None):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class Forbidden(Refused):
    """The sender claims an authority it does not have (a role, a task, a layout): no honest peer sends that, so it
    counts towards a ban."""


@dataclass
class Envelope:
    """What travels: a header and named tensors, before they are read as a typed message."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # tensors of `tensors` that the sender encoded already, with the codec it sends with: they travel as these
    # messages, not encoded again (a deposit's sender keeps what its encoding made of its gradients)
    encoded: dict[str, runtime_pb2.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalCall:
    """The context of a call that a `Caller` hands straight to a servicer in its own process."""

    sender: str


@dataclass
class KeptCall:
    """The context of one call on a kept stream (`Service.rpc_calls`): nothing lingers after its reply, and `whole`
    says whether its request was read to its end (else the stream's next part would not start a call)."""

    remote_id: PeerID
    whole: bool = False


def pack(envelope: Envelope, *, codec: str, proto: type[Proto]) -> list[Proto]:
    """Header first, then each tensor's chunks; integer tensors are never compressed."""
    layout, chunks = [], []
    for name, tensor in envelope.tensors.items():
        parts = (as_chunks(envelope.encoded[name]) if name in envelope.encoded
                 else serialize(tensor.detach().contiguous(), codec))
        layout.append([name, len(parts)])
        chunks.extend(parts)
    meta = msgpack.packb({"header": envelope.header, "tensors": layout}, use_bin_type=True)
    return [proto(metadata=meta)] + [proto(tensors=[chunk]) for chunk in chunks]


async def _items(stream: AsyncIterator[Proto] | Iterable[Proto]) -> AsyncIterator[Proto]:
    if hasattr(stream, "__aiter__"):
        async for item in stream:
            yield item
    else:
        for item in stream:
            yield item


async def unpack(stream: AsyncIterator[Proto] | Iterable[Proto]) -> Envelope:
    """Read one whole message: its header, then exactly the tensor chunks the header announces (nothing after them
    is read, so the reader may close the stream at once). ConnectionError if the stream ended early (the caller may
    retry); MessageError if what arrived is not a message."""
    items = _items(stream)
    first = await anext(items, None)
    if first is None:
        raise ConnectionError("the peer sent an empty stream")
    try:
        meta = msgpack.unpackb(first.metadata, raw=False)
        header, layout = meta["header"], [(str(name), int(count)) for name, count in meta["tensors"]]
    except Exception as e:  # msgpack raises several types for garbage
        raise MessageError(f"not a message: {e!r}") from None
    if not isinstance(header, dict):
        raise MessageError(f"not a message: the header is a {type(header).__name__}")
    if any(count < 1 for _, count in layout):
        raise MessageError("the message announced a tensor of no chunks")
    announced, chunks = sum(count for _, count in layout), list(first.tensors)
    while len(chunks) < announced:
        proto = await anext(items, None)
        if proto is None:  # a transport failure like an empty stream: the caller may retry
            raise ConnectionError(f"the stream ended early: {len(chunks)} of {announced} tensor chunks arrived")
        chunks.extend(proto.tensors)
    if len(chunks) > announced:
        raise MessageError(f"the message announced {announced} tensor chunks but {len(chunks)} arrived")
    tensors, position = {}, 0
    for name, count in layout:
        try:
            tensors[name] = deserialize(chunks[position : position + count])
        except Exception as e:  # a corrupt tensor: wrong sizes, unknown dtype or codec
            raise MessageError(f"tensor {name!r} does not decode: {e}") from None
        position += count
    return Envelope(header=header, tensors=tensors)


async def _moving(items: AsyncIterator[Proto], moved: Callable[[Proto], None]) -> AsyncIterator[Proto]:
    """`items`, calling `moved(item)` as each is taken."""
    async for item in items:
        moved(item)
        yield item


class Hearing:
    """When bytes of a request last arrived from each peer, per service, across the servicers of one node
    (`Service.serve`): a peer whose transfer is still arriving is alive, however slow its link, and a server's
    verdicts that a worker is gone ask here too. Times are in `clock`, the servers' own."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._any: dict[str, float] = {}

    def heard(self, peer: str, service: str) -> None:
        self._last[(peer, service)] = self._any[peer] = self.clock()

    def last(self, peer: str, service: str | None = None) -> float:
        """When bytes from `peer` (to `service`, or to any) last arrived; -inf if never."""
        return self._any.get(peer, -math.inf) if service is None else self._last.get((peer, service), -math.inf)


def handle_name(service: str, method: str, namespace: str | None = None) -> str:
    return f"{namespace}::{service}.{method}" if namespace else f"{service}.{method}"


class Service(ServicerBase):
    """A p2ptrain servicer: its handlers are registered as ``{service}.{method}``, so callers name the service
    without importing its class, and `serve` gives every handler typed requests and refusals. Owns the follow-up
    tasks its handlers leave behind (`spawn`, `unbroken`); `shutdown` cancels them."""

    service: ClassVar[str]

    def __init__(self, *, peer_id: str, name: str, codec: str, bans: BanList | None = None,
                 hearing: Hearing | None = None):
        self.peer_id, self.name, self.codec = peer_id, name, codec  # name: how logs call this servicer
        self.bans = BanList() if bans is None else bans
        self.hearing = Hearing() if hearing is None else hearing
        self.logger = logging.getLogger(type(self).__module__)
        self._follow_ups: set[asyncio.Task] = set()

    def spawn(self, work: Awaitable[None], *, what: str) -> None:
        """Run `work` as a task of this servicer; a failure is logged with `what` it was."""
        task = asyncio.ensure_future(self._logged(work, what))
        self._follow_ups.add(task)
        task.add_done_callback(self._follow_ups.discard)

    async def unbroken(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`'s result, with `work` carried to its end even if the caller's stream breaks meanwhile (hivemind then
        cancels the handler that awaits it): a handler's change of state that another peer also makes (a result its
        issuer confirms, then counts) must not stop halfway."""
        task = asyncio.ensure_future(work)
        self._follow_ups.add(task)
        task.add_done_callback(self._follow_ups.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved if nobody awaits it
        return await asyncio.shield(task)

    async def _logged(self, work: Awaitable[None], what: str) -> None:
        try:
            await work
        except Exception:
            self.logger.exception(f"{self.name}: {what} failed")

    async def drain(self) -> None:
        """Until every task its handlers left behind, and those these left in turn, has ended (tests)."""
        while self._follow_ups:
            await asyncio.gather(*self._follow_ups, return_exceptions=True)

    async def shutdown(self) -> None:
        for task in list(self._follow_ups):
            task.cancel()
        await asyncio.gather(*self._follow_ups, return_exceptions=True)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return handle_name(cls.service, method_name, namespace)

    async def serve(self, requests: Requests, context: P2PContext | LocalCall, kind: type[R],
                    handler: Callable[[R, str], Awaitable[Message]]) -> Responses:
        """Decode a `kind` request, run `handler(request, sender)` and stream its reply, or a refusal.

        `sender` is the peer id libp2p authenticated, or the calling peer's own for a call within its process.
        """
        local = isinstance(context, LocalCall)  # this process's own code: never banned
        sender = context.sender if local else context.remote_id.to_base58()
        kept = isinstance(context, KeptCall)
        banned_for = 0.0 if local else self.bans.banned_for(sender, now=time.monotonic())
        traffic, epoch = kind.traffic, None  # what the reply's bytes count as (`p2ptrain.traffic`), and for which epoch
        METER.count_served(kind.method)
        try:
            if banned_for > 0:  # refused unread: a banned peer costs a reply and a stream, not a decode
                raise Refused(f"banned for {banned_for:.0f} more s after repeated malformed or forged requests")
            envelope = await unpack(requests if local else _moving(requests, lambda _: self.hearing.heard(sender, self.service)))
            if kept:
                context.whole = True
            request = kind.from_header(envelope.header, envelope.tensors)
            epoch = getattr(request, "epoch", None)
            reply = await handler(request, sender)
            traffic = reply.traffic_kind() or traffic
            responses = self.pack(reply)
        except ConnectionError as e:  # the request never fully arrived: nobody is left to answer
            self.logger.warning(f"{self.name}: {kind.__name__} from {sender} broke off: {e}")
            return
        except (MessageError, Refused) as e:
            if banned_for == 0:
                self.logger.warning(f"{self.name}: refused {kind.__name__} from {sender}: {e}")
            if isinstance(e, (MessageError, Forbidden)) and not local:
                self._offence(sender)
            responses = self.refusal(str(e), retry_after_s=getattr(e, "retry_after_s", None))
        except Exception as e:  # a bug here must not end the handler silently or stall the caller until timeout
            self.logger.exception(f"{self.name}: failed on {kind.__name__} from {sender}")
            responses = self.refusal(f"internal error: {e!r}")
        if not local:
            METER.count(traffic, sum(response.ByteSize() for response in responses), epoch=epoch)
        for response in responses:
            yield response
        if not local and not kept:  # the caller closes the stream once it holds the reply; that cancels this
            await asyncio.sleep(LINGER_S if banned_for == 0 else BANNED_LINGER_S)

    def rpc_calls(self, requests: Requests, context: P2PContext) -> Responses:
        """Calls on one kept stream, one after another (`Caller(keep_streams=True)`): each message's first part names
        its handler in `uid`. The stream ends when the caller closes it, after LINGER_S without a call, or after a
        call whose request was not read whole (refused unread, malformed, or broken off): its end cannot be told
        from the next call's start."""
        return self._serve_calls(requests, context)

    async def _serve_calls(self, requests: Requests, context: P2PContext) -> Responses:
        handlers = self._handlers()
        while True:
            try:
                first = await asyncio.wait_for(anext(requests), LINGER_S)
            except (StopAsyncIteration, asyncio.TimeoutError):
                return
            call = KeptCall(remote_id=context.remote_id)
            handler = handlers.get(first.uid)
            if handler is None:
                sender = context.remote_id.to_base58()
                self.logger.warning(f"{self.name}: refused a call of {first.uid!r} from {sender}: no such handler")
                self._offence(sender)
                responses = self.refusal(f"{type(self).__name__} has no handler {first.uid!r}")
            else:
                # `achain` leaves `requests` open for the next call: `unpack` asks for one message's parts only
                responses = [response async for response in handler(self, achain(as_aiter(first), requests), call)]
            for response in responses:
                yield response
            if not call.whole:
                if responses:  # the caller closes the stream once it holds the reply
                    await asyncio.sleep(BANNED_LINGER_S)
                return

    @classmethod
    def _handlers(cls) -> dict[str, Callable[..., Responses]]:
        cls._collect_rpc_handlers()
        return {h.method_name: getattr(cls, h.method_name) for h in cls._rpc_handlers if h.method_name != CALLS}

    def _offence(self, sender: str) -> None:
        now = time.monotonic()
        self.bans.forget(now=now)
        ban = self.bans.offend(sender, now=now)
        if ban > 0:
            self.logger.warning(f"{self.name}: {sender} banned for {ban:.0f} s: {self.bans.offences} malformed or "
                                f"forged requests within {self.bans.window_s:.0f} s")

    def pack(self, reply: Message) -> list[runtime_pb2.ExpertResponse]:
        return pack(Envelope(reply.to_header(), reply.tensors()), codec=self.codec, proto=runtime_pb2.ExpertResponse)

    def refusal(self, reason: str, *, retry_after_s: float | None = None) -> list[runtime_pb2.ExpertResponse]:
        header: dict[str, Any] = {REFUSED: reason}
        if retry_after_s is not None:
            header[RETRY_AFTER] = float(retry_after_s)
        return pack(Envelope(header), codec="none", proto=runtime_pb2.ExpertResponse)


async def _aiter(items: list[Proto]) -> AsyncIterator[Proto]:
    for item in items:
        yield item


@dataclass
class KeptStream:
    """A stream to `Service.rpc_calls` that a caller keeps open between calls, read and written directly (hivemind's
    `iterate_protobuf_handler` ends its reader only after its writer: with a writer kept waiting for the next call,
    a stream broken mid-call would hang the call until its deadline)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    async def send(self, requests: list[runtime_pb2.ExpertRequest]) -> None:
        for request in requests:
            await P2P.send_protobuf(request, self.writer)

    async def replies(self) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The parts that arrive, until the stream ends."""
        while True:
            try:
                response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, self.reader)
            except asyncio.IncompleteReadError:
                return
            if error is not None:
                raise P2PHandlerError(f"the peer's handler failed: {error.message}")
            yield response

    def close(self) -> None:
        self.writer.close()


class Caller:
    """Calls the handlers of `Service`s on other peers, as peer `peer_id`; calls to a service in this process
    (`add_local`) go straight to the handler, without the network."""

    def __init__(self, *, p2p: P2P | None, peer_id: str, codec: str, timeout: float,
                 local: dict[tuple[str, str], Service] | None = None, slack: float = RuntimeConfig.deadline_slack,
                 assumed_rate: float = RuntimeConfig().slowest_uplink, rates: dict[str, Throughput] | None = None,
                 keep_streams: bool = RuntimeConfig.keep_streams):
        self.p2p, self.peer_id, self.codec, self.timeout = p2p, peer_id, codec, timeout
        self.keep_streams = keep_streams
        self._kept: dict[tuple[str, str], list[KeptStream]] = {}  # idle kept streams, the most recent last
        self.local = {} if local is None else local  # (peer id, service) -> servicer; tests share one across peers
        # the rate measured to each peer (module doc), shared by the callers of one node
        self.slack, self.assumed_rate = slack, assumed_rate
        self.rates: dict[str, Throughput] = {} if rates is None else rates

    def rate(self, peer: str) -> Throughput:
        if peer not in self.rates:
            self.rates[peer] = Throughput(assumed=self.assumed_rate)
        return self.rates[peer]

    def add_local(self, servicer: Service) -> None:
        self.local[(servicer.peer_id, servicer.service)] = servicer

    async def call(self, peer: str, service: str, request: Request, *, timeout: float | None = None,
                   encoded: dict[str, runtime_pb2.Tensor] | None = None) -> Any:
        """The typed reply (of type ``request.reply``); Refused if the peer refused, MessageError if its reply is not
        one, ConnectionError or TimeoutError if the transport failed. `encoded`: tensors of the request already
        encoded with this caller's codec (`Envelope.encoded`)."""
        envelope = Envelope(request.to_header(), request.tensors(), dict(encoded or {}))
        envelope = await self.exchange(peer, service, request.method, envelope, timeout=timeout,
                                       traffic=request.traffic, epoch=getattr(request, "epoch", None))
        if REFUSED in envelope.header:
            retry = envelope.header.get(RETRY_AFTER)
            raise Refused(str(envelope.header[REFUSED]),
                          retry_after_s=float(retry) if isinstance(retry, (int, float)) and retry >= 0 else None)
        return request.reply.from_header(envelope.header, envelope.tensors)

    async def call_retrying(self, peer: str, service: str, request: Request, *, attempts: int | None,
                            backoff_s: float, backoff_max_s: float, what: str,
                            moot: Callable[[], bool] | None = None) -> Any:
        """`call`, made again after each transport failure (backing off exponentially from `backoff_s` up to
        `backoff_max_s`) up to `attempts` times in all, or until it lands if None, or until `moot()` says the call
        no longer matters (asked after each failure and again after each back-off); the last failure is raised, and
        Refused at once. Only for idempotent requests: a retry may repeat one whose reply alone was lost."""
        attempt = 1
        while True:
            try:
                return await self.call(peer, service, request)
            except Refused:
                raise
            except Exception as e:
                if (attempts is not None and attempt >= attempts) or (moot is not None and moot()):
                    raise
                logger.warning(f"{self.peer_id}: {what} to {peer} failed (attempt {attempt}"
                               + (f" of {attempts}" if attempts else "") + f"), again in {backoff_s:.1f} s: {e!r}")
                failure = e
            await asyncio.sleep(backoff_s)
            if moot is not None and moot():
                raise failure
            backoff_s, attempt = min(2 * backoff_s, backoff_max_s), attempt + 1

    async def exchange(self, peer: str, service: str, method: str, envelope: Envelope, *,
                       timeout: float | None = None, traffic: str = "control", epoch: int | None = None) -> Envelope:
        """One call with untyped envelopes (benchmarks time the transport with it); its bytes count as `traffic`, and
        as bytes for `epoch` when it is for one.
        TimeoutError past the deadline the link allows (module doc), `timeout` (the caller's by default) its floor."""
        floor, loop = timeout or self.timeout, asyncio.get_running_loop()
        requests = pack(envelope, codec=self.codec, proto=runtime_pb2.ExpertRequest)
        sent = sum(request.ByteSize() for request in requests)
        network = (peer, service) not in self.local
        received, started = 0, loop.time()

        def arrived(response: runtime_pb2.ExpertResponse) -> None:
            nonlocal received
            received += response.ByteSize()
            deadline.reschedule(max(deadline.when(), loop.time() + floor))

        # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that comes as the call completes (it returns
        # the reply instead), and a cancelled task then ran on; asyncio.timeout lets every cancellation through
        async with asyncio.timeout(self.rate(peer).deadline_s(sent, floor_s=floor, slack=self.slack)) as deadline:
            reply = await self._exchange(peer, service, method, requests, traffic, sent=sent, arrived=arrived,
                                         epoch=epoch)
        if network:
            self.rate(peer).observe(sent + received, loop.time() - started)
        return reply

    async def _exchange(self, peer: str, service: str, method: str, requests: list[runtime_pb2.ExpertRequest],
                        traffic: str, *, sent: int, arrived: Callable[[runtime_pb2.ExpertResponse], None],
                        epoch: int | None) -> Envelope:
        servicer = self.local.get((peer, service))
        if servicer is not None:
            responses = getattr(servicer, method)(_aiter(requests), LocalCall(sender=self.peer_id))
        elif self.p2p is None:
            raise ConnectionError(f"no {service} of {peer} in this process, and no network")
        else:
            METER.count(traffic, sent, epoch=epoch)
            if self.keep_streams:
                return await self._over_kept_stream(peer, service, method, requests, arrived)
            responses = await self.p2p.iterate_protobuf_handler(
                PeerID.from_base58(peer), handle_name(service, method), _aiter(requests), runtime_pb2.ExpertResponse)
        try:
            return await unpack(_moving(responses, arrived))
        finally:
            await responses.aclose()  # this side ends the stream, once the whole reply is here (see the docstring)

    async def _over_kept_stream(self, peer: str, service: str, method: str,
                                requests: list[runtime_pb2.ExpertRequest],
                                arrived: Callable[[runtime_pb2.ExpertResponse], None]) -> Envelope:
        """The call over a kept stream (module doc): kept again once its reply is whole, closed on any failure (its
        next part would not start a reply) and after a refusal (the server may have ended it). A kept stream that
        breaks with nothing of the reply (its other end went: the peer restarted, or died during the call) has the
        call made once more on a new stream, as it would have been made without kept streams: it reaches a restarted
        peer, and to a peer gone it fails as a call to one does."""
        requests[0].uid = method
        stream, reused = await self._kept_stream(peer, service)
        answered = False

        def moved(response: runtime_pb2.ExpertResponse) -> None:
            nonlocal answered
            answered = True
            arrived(response)

        try:
            await stream.send(requests)
            reply = await unpack(_moving(stream.replies(), moved))
        except ConnectionError:
            stream.close()
            if not reused or answered:
                raise
            for stale in self._kept.pop((peer, service), []):  # kept on the same end that went
                stale.close()
            return await self._over_kept_stream(peer, service, method, requests, arrived)
        except BaseException:
            stream.close()
            raise
        idle = self._kept.setdefault((peer, service), [])
        if REFUSED in reply.header or len(idle) >= KEPT_PER_SERVICE:
            stream.close()
        else:
            stream.idle_since = time.monotonic()
            idle.append(stream)
        return reply

    async def _kept_stream(self, peer: str, service: str) -> tuple[KeptStream, bool]:
        """The most recent idle kept stream, or a new one if there is none or it idled KEPT_IDLE_S (and the older
        ones longer: they are closed); and whether it was kept."""
        idle = self._kept.pop((peer, service), [])
        if idle and time.monotonic() - idle[-1].idle_since < KEPT_IDLE_S:
            stream = idle.pop()
            if idle:
                self._kept[(peer, service)] = idle
            return stream, True
        for stale in idle:
            stale.close()
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                     handle_name(service, CALLS))
        return KeptStream(reader=reader, writer=writer), False

    def close(self) -> None:
        """Close the streams it keeps."""
        kept, self._kept = self._kept, {}
        for streams in kept.values():
            for stream in streams:
                stream.close()
