"""Per-stage gradient averaging at each global batch with hivemind's butterfly all-reduce.

The group is not found by DHT matchmaking: when an epoch closes, the stage's first FS fixes the group (the
workers it has seen) and hands the same list to every worker, so all agree on peers, order and group id at
once. (hivemind's matchmaking left peers out of rounds on a loaded 2-core machine and costs its waiting time.)
Each worker hands in its mean gradient weighted by the rows it computed, so the average is the gradient of
the whole batch. A worker behind NAT (client mode) sends its part and receives the result but reduces none; nor
does a member without rows (a server keeping its stage's replica) while a member with rows can (`reducer_modes`).

Every round proves it averaged: beside the gradients each member hands in a marker, a vector with one entry per
member that is 1 at its own place and 0 elsewhere. Averaged, entry j is member j's share of the weights, so a
member whose marker comes back with another member's entry at 0 knows that member's part never reached the
average; all at 0 is a round that averaged nothing (hivemind's 8-bit codecs fail that way on this stack,
docs/design.md §7). Such a round counts as failed. With fp16 the marker carries one entry more: 1 from a member whose
gradients overflowed (it hands in zeros for them), 0 from the others; averaged, it is above 0 if any member's was, so
every member reads the same decision to skip the step from the same average, never its own alone.

A groupmate that dies in a round fails it for all (hivemind's runner loses the parts it reduced). The survivors
find the dead by probing (a dead process's dial fails at once, alike for all) and average again among themselves.
What the dead brought is not lost: once every row of an epoch is back, every worker holding some deposits its
gradients with the stage's first FS (`GradientDeposits`, reliable and reachable, in every round), and the FS counts
a worker ready to average only after its deposit (`FrontalServer.close_ready`): a worker that dies before is gone
before the closure and its rows are redone by others. In the round run again that server brings the deposits of the
dead beside its own part, weighted by their rows. Each survivor reads how many rows the average holds from the round
itself (its own weight divided by its own marker entry is the round's total weight), so `rows_lost` counts only
what no deposit brought back (the FS holding them died too). A deposit costs one more transfer of each worker's
gradients per epoch, to one server, before the round.

A round of two, one worker with rows and the server that holds its deposit of the epoch (one volunteer in a stage
with its FS replica), needs no all-reduce: the average is the deposit, which the server holds already and the worker
holds as it sent it (its gradients through the averaging codec). Both tell it from the group and their deposits
alike, and step on the same bits; the round's transfer to the server, its latency and its way to fail are gone. With
more members the round runs as above.

Under delayed parameter updates with a look-ahead (`client.worker`), each worker asks the server that holds its
deposit of an epoch for the mean of its group's deposits there (`GradientDeposits.mean`, once per epoch for all who
ask, in int8) and computes the next epoch where a step on it takes the stage, while the round runs in the background.

Every member ends with the very same average, bit for bit, whatever the codec (`--averaging-codec`): a reducer hands
back the average of its share itself, encoded once, the same bytes to every member (`CodecAllReduceRunner`).
hivemind's runner hands each member its own difference from the average instead, rounded apart: in float32 the
members' results differed by a few ulps of their own gradients, large where the average cancels, and AdamW's early
steps move a weight by about ±lr whatever its gradient's size, so stage mates drifted apart (1e-6 relative after
one step here); under a lossy codec they would drift by the codec's error. fp32 sends the gradients exact, fp16 in
half the bytes, int8 (blockwise, bitsandbytes, as the activations use) in about a quarter; a member's deposit travels
in the same codec. The marker always travels exact.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException
from hivemind.compression import CompressionBase, NoCompression, PerTensorCompression
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished

from p2ptrain.compression import BadTensorError, WireCodec, check_tensor, decode, encode
from p2ptrain.config import WIRE_BYTES, RuntimeConfig
from p2ptrain.live.probe import dial_failure
from p2ptrain.protocol.deadlines import Throughput, all_reduce_bytes
from p2ptrain.protocol.messages import GRADIENT_DEPOSITS, Ack, DepositGrads, GroupMember, StageMean, TakeStageMean
from p2ptrain.traffic import METER
from p2ptrain.transport import Caller, Hearing, Refused, Requests, Responses, Service

logger = logging.getLogger(__name__)

# hivemind needs a positive weight; a worker without rows this epoch still takes part and gets the result
NO_ROWS_WEIGHT = 1e-9
PART_BYTES = 2**19  # hivemind's default part size, named here because the stall deadline counts on it
DEPOSITS_KEPT = 4  # epochs back a worker remembers where it deposited (`StageAllReduce._handed_over`)
STAGE_MEAN_CODEC = "int8"  # how `GradientDeposits` hands out the mean of an epoch's deposits for a look-ahead
REDUCER_LINGER_S = 5.0  # how long a reducer keeps a sender's stream open after its last part (`rpc_aggregate_part`)


@dataclass(frozen=True)
class RoundResult:
    group_size: int  # workers in the all-reduce; 1 for a lone worker, 0 if the round failed
    ok: bool
    rows_lost: int = 0  # rows of groupmates that died in the round, whose gradients are not in the average
    reason: str = ""  # why it failed
    overflow: bool = False  # fp16: some member's (or a deposit's) gradients overflowed: the stage skips the step


class RoundFailed(Exception):
    """One all-reduce round did not average; the text says why."""


class GradientDeposits(Service):
    """A server's store of the gradients its stage's workers bring to each epoch's all-reduce (module doc): per
    epoch, per worker, its deposit: its rows, its mean gradient as one flat float32 vector of `numel` entries, and
    whether they overflowed. Only the newest `kept` epochs are held; a deposit is keyed by its sender, so a peer can
    deposit only for itself. It also hands out the mean of an epoch's deposits (`TakeStageMean`), in int8: a
    worker's look-ahead estimates a step with it, and a quarter of fp32's bytes at the epoch's boundary matters more
    than an error of under 1.4% of each block's largest entry (`compression.int8_error_bound`)."""

    service = GRADIENT_DEPOSITS

    def __init__(self, *, peer_id: str, stage: int, numel: int, kept: int, hearing: Hearing | None = None):
        super().__init__(peer_id=peer_id, name=f"stage {stage} gradient deposits", codec=STAGE_MEAN_CODEC,
                         hearing=hearing)
        self.numel, self.kept = numel, kept
        self._held: dict[int, dict[str, DepositGrads]] = {}
        self._means: dict[tuple[int, frozenset[str]], asyncio.Future[StageMean | None]] = {}  # each mate asks

    def rpc_deposit_grads(self, requests: Requests, context: P2PContext) -> Responses:
        return self.serve(requests, context, DepositGrads, self.deposit_grads)

    async def deposit_grads(self, request: DepositGrads, sender: str) -> Ack:
        try:
            check_tensor(request.grads, shape=(self.numel,), dtype=torch.float32, what="grads")
        except BadTensorError as e:
            raise Refused(str(e)) from None
        return self.hold(request, sender)

    def hold(self, request: DepositGrads, sender: str) -> Ack:
        """Keep `sender`'s deposit (its newest for the epoch); a server that also computes holds its own here."""
        if self._held and request.epoch <= max(self._held) - self.kept:
            raise Refused(f"epoch {request.epoch} closed long ago")
        held = self._held.setdefault(request.epoch, {})
        again = sender in held
        held[sender] = request
        for old in [epoch for epoch in self._held if epoch <= max(self._held) - self.kept]:
            del self._held[old]
        for key in [key for key in self._means if key[0] not in self._held or key[0] == request.epoch]:
            del self._means[key]  # a deposit again changes the mean
        return Ack(again=again)

    def of(self, epoch: int, peers: set[str]) -> list[DepositGrads]:
        """What `peers` deposited for `epoch`, where they did."""
        held = self._held.get(epoch, {})
        return [held[peer] for peer in sorted(peers) if peer in held]

    def rpc_stage_mean(self, requests: Requests, context: P2PContext) -> Responses:
        return self.serve(requests, context, TakeStageMean, self.stage_mean)

    async def stage_mean(self, request: TakeStageMean, sender: str) -> StageMean:
        if sender not in self._held.get(request.epoch, {}):  # the mean costs a pass over the stage's gradients
            raise Refused(f"only a peer that deposited gradients of epoch {request.epoch} here may ask for their mean")
        mean = await self.mean(request.epoch, set(request.peers))
        if mean is None:
            raise Refused(f"no deposit of epoch {request.epoch} from those peers is held here")
        return mean

    async def mean(self, epoch: int, peers: set[str]) -> StageMean | None:
        """The mean of what `peers` deposited for `epoch` here, weighted by their rows; None if none did. Computed
        once for all the mates that ask, off the event loop, which serves the stage's polls meanwhile."""
        key = (epoch, frozenset(peers))
        if key not in self._means:
            self._means[key] = asyncio.ensure_future(asyncio.to_thread(self._mean, self.of(epoch, peers)))
        return await asyncio.shield(self._means[key])

    def _mean(self, deposits: list[DepositGrads]) -> StageMean | None:
        if not deposits:
            return None
        rows, flat = sum(d.rows for d in deposits), torch.zeros(self.numel)
        for deposit in deposits:  # in float32: a look-ahead's estimate, not the round's average
            flat.add_(deposit.grads, alpha=deposit.rows / rows)
        return StageMean(rows=rows, grads=flat)


def flatten(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A stage's gradients as one flat vector in `dtype`, in parameter order (how deposits hold them)."""
    return torch.cat([grad.detach().reshape(-1).to(dtype) for grad in grads])


def unflatten(flat: torch.Tensor, *, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """A flat vector (`flatten`) back as tensors of the shapes and dtypes of `like`."""
    parts = flat.split([tensor.numel() for tensor in like])
    return [part.reshape(tensor.shape).to(tensor.dtype) for part, tensor in zip(parts, like)]


def missing_parts(marker: torch.Tensor, group: tuple[GroupMember, ...], me: str) -> list[str]:
    """The members whose part did not reach the average, read from this member's averaged marker (module doc)."""
    return [member.peer_id for member, share in zip(group, marker.tolist())
            if member.peer_id != me and not share > 0]


def reducer_modes(group: tuple[GroupMember, ...]) -> list[AveragingMode]:
    """Who reduces a share of the round: the members that hand in rows and take calls. A member without rows (a
    server keeping its stage's replica) sends zeros, which travel as their shape alone (`compression.encode_zeros`),
    and only receives the average: as a reducer it would also take the others' parts of its share and send its
    average back, bytes and work for a share that weighs nothing. It reduces only when no member with rows can."""
    reachable = [not m.client_mode for m in group]
    with_rows = [ok and m.rows > 0 for ok, m in zip(reachable, group)]
    reduces = with_rows if any(with_rows) else reachable
    return [AveragingMode.NODE if r else AveragingMode.CLIENT for r in reduces]


class CodecAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, but a reducer hands back the average of its share itself, encoded once in the
    share's codec, the same bytes to every member (module doc), and decodes what it receives with
    `p2ptrain.compression.decode`, which knows the int8 codec. A reducer's own part goes through the codec as a
    groupmate's does. A part whose reducer failed comes back as this member's own values (counted in
    `tensor_part_container.failed_size`). The parts this member sends are counted as averaging traffic."""

    def __init__(self, *, epoch: int, **kwargs):
        super().__init__(**kwargs)
        self.epoch = epoch  # the bytes this member sends are counted as this epoch's (`p2ptrain.traffic`)
        container = self.tensor_part_container
        container.return_deltas = False  # what comes back is the average, not this member's difference from it
        me = self.ordered_peer_ids.index(self.peer_id)
        # how each share of this member's is encoded; hivemind keeps them beside the parts only
        self._own_infos = [info for _, info in container._input_parts_by_peer[me]]
        self._averages: dict[int, asyncio.Future] = {}

    async def _encoded_average(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """The average of this reducer's part `part_index`, encoded once for every member."""
        if part_index not in self._averages:
            codec, info = self.tensor_part_container.compression, self._own_infos[part_index]
            self._averages[part_index] = asyncio.get_running_loop().run_in_executor(
                None, codec.compress, averaged, info)
        return await asyncio.shield(self._averages[part_index])  # one member's stream ending cancels no other's

    def _checked_part(self, message: averaging_pb2.AveragingData, part_index: int) -> torch.Tensor:
        if part_index >= len(self.parts_for_local_averaging):
            raise AllreduceException(f"a sender sent more than the {len(self.parts_for_local_averaging)} parts")
        part = decode(message.tensor_part)
        check_tensor(part, shape=tuple(self.parts_for_local_averaging[part_index].shape), dtype=torch.float32,
                     what=f"all-reduce part {part_index}")
        return part

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        try:
            async for message in stream:
                part = await asyncio.get_running_loop().run_in_executor(None, self._checked_part, message, part_index)
                if self.tensor_part_reducer.finished.is_set():
                    # the round ended (failed) while this part was on its way: hivemind's reducer has dropped its
                    # accumulator and would fail on it with an AttributeError, logged as the sender's fault
                    break
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                              weight=message.weight)
                except BannedException:  # this sender failed already; its part is not needed
                    break
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                                  tensor_part=await self._encoded_average(part_index - 1, averaged))
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            if peer_id == self.peer_id:
                await self._reduce_own_share(peer_index)
            else:
                await self._exchange_with(peer_id, peer_index)
        except BaseException as e:
            self.tensor_part_container.register_failed_reducer(peer_index)
            if peer_id == self.peer_id and isinstance(e, Exception):  # the groupmates' parts of it wait for none
                await self._ban_sender(self.peer_id)
            raise

    async def _reduce_own_share(self, peer_index: int) -> None:
        container, loop = self.tensor_part_container, asyncio.get_running_loop()
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, (part, info) in enumerate(zip(self.parts_for_local_averaging, self._own_infos)):
            sent = await loop.run_in_executor(None, lambda: decode(container.compression.compress(part, info)))
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, sent,
                                                                      weight=self.weight)
            average = await loop.run_in_executor(None, decode, await self._encoded_average(part_index, averaged))
            container.register_processed_part(peer_index, part_index, average)

    async def _exchange_with(self, peer_id: PeerID, peer_index: int) -> None:
        container = self.tensor_part_container
        done_sending = asyncio.Event()
        parts = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(parts)
        if self.should_delay_results(self.peer_id):
            await done_sending.wait()
        received = 0
        async for average in amap_in_executor(self._average_from, aiter_with_timeout(stream, self.reducer_timeout),
                                              max_prefetch=container.prefetch):
            container.register_processed_part(peer_index, received, average)
            received += 1
        if received != container.num_parts_by_peer[peer_index]:
            raise AllreduceException(f"{peer_id} sent {received} averaged parts of "
                                     f"{container.num_parts_by_peer[peer_index]}")

    @staticmethod
    def _average_from(message: averaging_pb2.AveragingData) -> torch.Tensor:
        if message.code != averaging_pb2.AVERAGED_PART:
            raise AllreduceException(f"the reducer sent {averaging_pb2.MessageCode.Name(message.code)}")
        return decode(message.tensor_part)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            METER.count("averaging", message.ByteSize(), epoch=self.epoch)
            yield message


class StageAllReduce(ServicerBase):
    """One worker's side of its stage's all-reduce rounds; registered under a per-stage namespace.

    A round's deadlines follow the link (`protocol.deadlines`): it fails once a groupmate sends no part for `timeout`
    plus the time a part's bytes need at the rate measured in this member's earlier rounds (`throughput`, assumed
    slow until one was timed), times `slack` (hivemind's sender and reducer timeouts), or once the whole round took
    `timeout` plus its bytes' time. While a round runs, the groupmates' link probes are pinged every `probe_every_s`:
    a dead process is known at once (its dial fails), so the round fails then instead."""

    def __init__(self, *, p2p: P2P | None, run_id: str, stage: int, timeout: float, caller: Caller,
                 throughput: Throughput | None = None, slack: float = RuntimeConfig.deadline_slack,
                 probe_every_s: float = 1.0, probe_timeout_s: float = 2.0,
                 codec: str = "none", deposits: GradientDeposits | None = None, namespace: str | None = None):
        self.p2p, self.timeout, self.caller = p2p, timeout, caller
        self.wire: CompressionBase = WireCodec(codec)  # how gradients travel (module doc); `codec` is one of CODECS
        self.itemsize = WIRE_BYTES[codec]
        self.throughput = Throughput(assumed=RuntimeConfig().slowest_uplink) if throughput is None else throughput
        self.slack = slack
        self.deposits = deposits  # a server's: it brings the deposits of groupmates that died (module doc)
        # deposits travel in the averaging codec, not the activations'
        self._depositor = Caller(p2p=p2p, peer_id=caller.peer_id, codec=codec, timeout=timeout, slack=caller.slack,
                                 assumed_rate=caller.assumed_rate, rates=caller.rates, keep_streams=caller.keep_streams)
        self.probe_every_s, self.probe_timeout_s = probe_every_s, probe_timeout_s
        # the stage's own rounds, or (`namespace`) another kind of round its members take part in
        self.stage, self.prefix = stage, f"{run_id}_{namespace or f'stage{stage}'}_allreduce"
        self._deposited: dict[int, tuple[int, str]] = {}  # this worker's deposits of recent epochs: rows, server
        # the epoch and flat values of its last deposit as they reached the server, where the codec changes them
        self._arrived: tuple[int, torch.Tensor] | None = None
        self._runners: dict[bytes, asyncio.Future] = {}
        self._finishing: set[asyncio.Task] = set()  # runners of rounds already averaged, ending (`_finish`)

    async def start(self) -> None:
        await self.add_p2p_handlers(self.p2p, namespace=self.prefix)

    def _runner(self, group_id: bytes) -> asyncio.Future:
        return self._runners.setdefault(group_id, asyncio.get_running_loop().create_future())

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's part; it may arrive before this peer started the round, so wait for the runner."""
        request = await anext(stream)
        try:
            runner = await asyncio.wait_for(asyncio.shield(self._runner(request.group_id)), self.timeout)
        except asyncio.TimeoutError:
            self._runners.pop(request.group_id, None)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            METER.count("averaging", message.ByteSize(), epoch=runner.epoch)
            yield message
        # hivemind's handler ends its stream right after the last averaged part, and p2pd resets a stream that one
        # side closes, dropping what the other side's daemon had not yet handed on: under load the sender lost that
        # part ("... of the averaged values did not come back") while this reducer's own round had succeeded. The
        # sender closes the stream once it has read everything; until then this end stays open
        await asyncio.sleep(REDUCER_LINGER_S)

    async def deposit(self, server: str, grads: list[torch.Tensor], *, epoch: int, rows: int,
                      overflow: bool = False) -> bool:
        """Hand this worker's gradients of `epoch` (and whether they overflowed) to `server` before the stage counts it
        ready to average (module doc); False if it failed (it asks again at its next poll)."""
        flat, encoded, arrived = flatten(grads, torch.float32), {}, None
        if not self._exact(grads):
            # encoded once, off the event loop; what the server will hold is decoded beside the call, which waits on
            # nothing of it: at an epoch's close the stage's next epoch waits on the deposit
            message = await asyncio.to_thread(encode, flat, self.wire.codec)
            encoded = {"grads": message}
            arrived = asyncio.ensure_future(asyncio.to_thread(decode, message))
        try:
            if server == self.caller.peer_id and self.deposits is not None:  # an FS that computes: no call to itself
                held = await arrived if arrived is not None else flat
                self.deposits.hold(DepositGrads(epoch=epoch, rows=rows, grads=held, overflow=overflow), server)
            else:
                request = DepositGrads(epoch=epoch, rows=rows, grads=flat, overflow=overflow)
                await self._depositor.call(server, GRADIENT_DEPOSITS, request, encoded=encoded)
        except Exception as e:
            if arrived is not None:
                arrived.cancel()
            logger.warning(f"stage {self.stage}: depositing the gradients of epoch {epoch} with {server} failed: "
                           f"{e!r}")
            return False
        self._deposited[epoch] = (rows, server)
        self._arrived = (epoch, await arrived) if arrived is not None else None
        for stale in [e for e in self._deposited if e < epoch - DEPOSITS_KEPT]:
            del self._deposited[stale]
        return True

    async def stage_mean(self, like: list[torch.Tensor], *, epoch: int, group: tuple[GroupMember, ...]
                         ) -> tuple[list[torch.Tensor], int] | None:
        """The mean of the deposits of `group` for `epoch` at the server this worker deposited its own with, shaped
        `like` (this worker's own gradients, which it is where no mate has rows), and the rows it covers; None if this
        worker deposited none of `epoch` or the server has none."""
        if epoch not in self._deposited:
            return None
        server, peers = self._deposited[epoch][1], tuple(member.peer_id for member in group if member.rows)
        if peers == (self.caller.peer_id,):
            # the stage's only rows are this worker's: its mean is its own, as its deposit brought it (the round's
            # average)
            return await self._travelled(like, epoch=epoch), self._deposited[epoch][0]
        try:
            if server == self.caller.peer_id and self.deposits is not None:
                if (mean := await self.deposits.mean(epoch, set(peers))) is None:
                    return None
            else:
                mean = await self._depositor.call(server, GRADIENT_DEPOSITS, TakeStageMean(epoch=epoch, peers=peers))
            check_tensor(mean.grads, shape=(sum(t.numel() for t in like),), dtype=torch.float32, what="grads")
        except Exception as e:  # a prediction only: the worker looks ahead on its own gradients instead
            logger.info(f"stage {self.stage}: no mean of the deposits of epoch {epoch} from {server}: {e!r}")
            return None
        return unflatten(mean.grads, like=like), mean.rows

    async def average(self, grads: list[torch.Tensor], *, epoch: int, rows: int, group: tuple[GroupMember, ...],
                      overflow: bool = False, deposited: bool = False) -> tuple[list[torch.Tensor], RoundResult]:
        """Average `grads` with the group; on failure the local gradients come back, and the result says so.

        A groupmate that dies in the round fails it for all; the survivors average again among themselves under a
        group id of their ids, a server bringing the deposits of the dead (module doc). `rows_lost`: the rows of the
        group that the average does not hold; `overflow` (fp16): whether this member's gradients overflowed, and in
        the result, whether any member's or deposit's in the average did. `deposited`: the round averages the
        epoch's gradients, which its members with rows deposited before it (`deposit`): a worker and the server
        holding its deposit take that as the average without a round (module doc)."""
        if deposited:
            handed = await self._handed_over(grads, epoch=epoch, rows=rows, group=group, overflow=overflow)
            if self._arrived is not None and self._arrived[0] <= epoch:
                self._arrived = None  # past their last use (the look-ahead came before): a stage's gradients' memory
            if handed is not None:
                return handed
        members, mine, weight, dead, flagged = group, grads, rows, set(), overflow
        expected = sum(member.rows for member in group)
        while len(members) > 1:
            try:
                averaged, total, any_overflow = await self._round(mine, epoch=epoch, weight=weight, group=members,
                                                                  overflow=flagged)
            except RoundFailed as e:
                failure = str(e)
            else:
                lost = max(0, expected - round(total))
                if lost:
                    logger.warning(f"stage {self.stage} all-reduce of epoch {epoch}: {lost} rows of groupmates that "
                                   "died are not in the average (no deposit of theirs reached a server)")
                return averaged, RoundResult(group_size=len(members), ok=True, rows_lost=lost, overflow=any_overflow)
            me = self.caller.peer_id
            others = [m for m in members if m.peer_id != me]
            failures = await asyncio.gather(*(dial_failure(self.caller, m.peer_id, timeout=self.probe_timeout_s)
                                              for m in others))
            died = {m.peer_id for m, failure in zip(others, failures) if failure is not None}
            if not died:
                return grads, RoundResult(group_size=0, ok=False, reason=failure)
            dead |= died
            members = tuple(m for m in members if m.peer_id not in died)
            mine, weight, flagged = self._with_deposits(grads, rows=rows, epoch=epoch, dead=dead, overflow=overflow)
            logger.warning(f"stage {self.stage} all-reduce of epoch {epoch}: {len(died)} groupmate(s) died "
                           f"({', '.join(sorted(died))}); averaging again among the {len(members)} alive"
                           + (f", bringing {weight - rows} of their rows from their deposits" if weight > rows else ""))
        lost = max(0, expected - weight)
        return mine, RoundResult(group_size=1, ok=True, rows_lost=lost, overflow=flagged)

    async def _handed_over(self, grads: list[torch.Tensor], *, epoch: int, rows: int,
                           group: tuple[GroupMember, ...], overflow: bool
                           ) -> tuple[list[torch.Tensor], RoundResult] | None:
        """The average of a round of two whose only member with rows deposited its gradients of `epoch` with the
        other (module doc), as the other holds it; None if `group` is no such round. The worker's test (its deposit
        of this epoch was of these rows, with that member) holds exactly when the server's does (it holds that
        deposit, of the rows the group gives the worker): the server counts a worker ready only once it deposited
        its current rows, so they do not part on whether to run the round (unless one averages more than
        DEPOSITS_KEPT epochs late)."""
        contributors = [member for member in group if member.rows > 0]
        if len(group) != 2 or len(contributors) != 1:
            return None
        (contributor,), me = contributors, self.caller.peer_id
        holder = next(member for member in group if member is not contributor)
        if contributor.peer_id == me and self._deposited.get(epoch) == (rows, holder.peer_id):
            return await self._travelled(grads, epoch=epoch), RoundResult(group_size=2, ok=True, overflow=overflow)
        if holder.peer_id == me and self.deposits is not None:
            held = self.deposits.of(epoch, {contributor.peer_id})
            if not held or held[0].rows != contributor.rows:
                return None
            return unflatten(held[0].grads, like=grads), RoundResult(group_size=2, ok=True, overflow=held[0].overflow)
        return None

    def _exact(self, grads: list[torch.Tensor]) -> bool:
        """Whether a deposit of `grads` reaches its server as these very values."""
        return self.wire.codec == "none" and all(grad.dtype == torch.float32 for grad in grads)

    def _encoded(self, flat: torch.Tensor) -> tuple[runtime_pb2.Tensor, torch.Tensor]:
        """`flat` as the averaging codec sends it, and as its receiver decodes it."""
        message = encode(flat, self.wire.codec)
        return message, decode(message)

    async def _travelled(self, grads: list[torch.Tensor], *, epoch: int) -> list[torch.Tensor]:
        """`grads`, this worker's gradients of `epoch`, as its deposit of them reached its server: through the
        averaging codec, in float32 (kept from the deposit, which encoded them)."""
        if self._exact(grads):
            return list(grads)
        if self._arrived is not None and self._arrived[0] == epoch:
            return unflatten(self._arrived[1], like=grads)
        _, flat = await asyncio.to_thread(self._encoded, flatten(grads, torch.float32))
        return unflatten(flat, like=grads)

    def _with_deposits(self, grads: list[torch.Tensor], *, rows: int, epoch: int, dead: set[str], overflow: bool
                       ) -> tuple[list[torch.Tensor], int, bool]:
        """This member's part, rows and overflow once it brings the deposits of `dead` (none unless it holds some):
        the row-weighted mean of its own gradients and theirs, flagged if any of them overflowed."""
        deposited = self.deposits.of(epoch, dead) if self.deposits is not None else []
        if not deposited:
            return grads, rows, overflow
        total = rows + sum(d.rows for d in deposited)
        flat = sum((d.rows * d.grads.double() for d in deposited), start=rows * flatten(grads, torch.float64)) / total
        return unflatten(flat, like=grads), total, overflow or any(d.overflow for d in deposited)

    def deadline_s(self, numel: int, *, members: int, reducers: int | None = None) -> float:
        """How long a round over `numel` values among `members`, `reducers` of them (all by default) reducing, may
        take (class doc)."""
        sent = all_reduce_bytes(numel, members=members, itemsize=self.itemsize, reducers=reducers)
        return self.throughput.deadline_s(sent, floor_s=self.timeout, slack=self.slack)

    async def _round(self, grads: list[torch.Tensor], *, epoch: int, weight: int, group: tuple[GroupMember, ...],
                     overflow: bool) -> tuple[list[torch.Tensor], float, bool]:
        """One all-reduce among `group`, this member's part weighing `weight` rows and flagged by `overflow`: the
        averaged gradients, the round's total weight (in rows) and whether any member flagged its part; RoundFailed
        if it did not average."""
        members = ",".join(m.peer_id for m in group)
        group_id = hashlib.sha256(f"{self.prefix}:{epoch}:{members}".encode()).digest()
        me = self.caller.peer_id
        marker = torch.tensor([1.0 if member.peer_id == me else 0.0 for member in group] + [float(overflow)])
        tensors = [grad.detach().to(torch.float32, copy=True) for grad in grads] + [marker]
        own = float(weight) if weight else NO_ROWS_WEIGHT
        modes = reducer_modes(group)
        if AveragingMode.NODE not in modes:  # hivemind asserts; a round nobody can reduce fails like any other
            logger.warning(f"all-reduce of epoch {epoch} among {len(group)} workers not started: every member dials "
                           "out only (client mode), none can reduce")
            raise RoundFailed("every member dials out only (client mode), none can reduce")
        numel = sum(tensor.numel() for tensor in tensors)
        reducers = modes.count(AveragingMode.NODE)
        deadline = self.deadline_s(numel, members=len(group), reducers=reducers)
        # a part on its way while this member's uplink carries one to each groupmate and an average back to each
        stall = self.throughput.deadline_s(2 * (len(group) - 1) * PART_BYTES, floor_s=self.timeout, slack=self.slack)
        runner = CodecAllReduceRunner(
            epoch=epoch, p2p=self.p2p, servicer_type=StageAllReduce, prefix=self.prefix, group_id=group_id,
            tensors=tensors, weight=own,
            ordered_peer_ids=[PeerID.from_base58(m.peer_id) for m in group],
            peer_fractions=tuple(0.0 if mode == AveragingMode.CLIENT else 1.0 for mode in modes), modes=modes,
            compression=PerTensorCompression([self.wire] * len(grads) + [NoCompression()]), part_size_bytes=PART_BYTES,
            sender_timeout=stall, reducer_timeout=2 * stall,
        )
        self._runner(group_id).set_result(runner)

        updates = runner.run()

        async def reduce() -> None:
            # the runner yields one average per tensor, in order (not hivemind's azip: its gather leaves futures whose
            # cancellation nobody retrieves when a round is cancelled)
            for tensor in tensors:
                tensor.copy_(await anext(updates))

        rounds = asyncio.create_task(reduce())
        watched = asyncio.Event()  # set when the round ends: the watch stops even if a cancellation got lost
        watch = asyncio.create_task(self._watch([m.peer_id for m in group], until=watched))
        started = time.monotonic()
        try:
            async with asyncio.timeout(deadline):
                await asyncio.wait([rounds, watch], return_when=asyncio.FIRST_COMPLETED)
            if not rounds.done():
                raise ConnectionError(f"groupmate {watch.result()} cannot be reached")
            rounds.result()
            lost = runner.tensor_part_container.failed_size  # parts whose reducer failed come back as local values
            if lost:
                raise RuntimeError(f"{lost} of the averaged values did not come back")
            missing = missing_parts(tensors[-1], group, me)
            if missing:
                raise RuntimeError("the round averaged nothing" if len(missing) == len(group) - 1 else
                                   f"the parts of {', '.join(missing)} are not in the average")
        except Exception as e:
            logger.warning(f"all-reduce of epoch {epoch} among {len(group)} workers failed: {e!r}")
            runner.finalize(cancel=True)
            raise RoundFailed(repr(e)) from None
        finally:
            watched.set()
            for task in (rounds, watch):
                task.cancel()
            await asyncio.gather(rounds, watch, return_exceptions=True)
            self._runners.pop(group_id, None)
            # the runner's reducer may still be sending this peer's share to slower groupmates: it finishes in the
            # background, and leaves nothing for the garbage collector to finalize and log from wherever that runs
            # (it once broke an ast.parse in the same thread)
            self._finishing.add(task := asyncio.create_task(self._finish(runner, updates, deadline)))
            task.add_done_callback(self._finishing.discard)
        self.throughput.observe(all_reduce_bytes(numel, members=len(group), itemsize=self.itemsize, reducers=reducers),
                                time.monotonic() - started)
        # entry `me` of the averaged marker is this member's weight over the round's total
        total = own / tensors[-1][[member.peer_id for member in group].index(me)].item()
        return tensors[:-1], total, tensors[-1][-1].item() > 0

    async def _finish(self, runner: AllReduceRunner, updates: AsyncIterator[torch.Tensor], deadline: float) -> None:
        """Let a round's runner end as hivemind ends it (after its last update it finalizes and awaits its tasks),
        within the round's `deadline`; then take the outcome its own future holds, which hivemind gives no public way
        to await."""
        try:
            await asyncio.wait_for(anext(updates, None), deadline)
        except Exception:  # failed or timed out: the round's result was taken already
            runner.finalize(cancel=True)
        finally:
            if runner._future.done() and not runner._future.cancelled():
                runner._future.exception()

    async def _watch(self, peers: list[str], *, until: asyncio.Event) -> str | None:
        """Returns the first of `peers` whose process cannot be reached; runs until cancelled or `until` is set
        otherwise (then None)."""
        others = [peer for peer in peers if peer != self.caller.peer_id]
        while not until.is_set():
            await asyncio.sleep(self.probe_every_s)
            for peer in others:  # one only slow or busy is left to the round's own timeout
                if await dial_failure(self.caller, peer, timeout=self.probe_timeout_s) is not None:
                    return peer
        return None
