"""Per-stage gradient averaging at each global batch with hivemind's butterfly all-reduce.

The group is not found by DHT matchmaking: when an epoch closes, the stage's first FS fixes the group (the
workers it has seen) and hands the same list to every worker, so all agree on peers, order and group id at
once. (hivemind's matchmaking left peers out of rounds on a loaded 2-core machine and costs its waiting time.)
Each worker hands in its mean gradient weighted by the rows it computed, so the average is the gradient of
the whole batch. A worker behind NAT (client mode) sends its part and receives the result but reduces none.

Every round proves it averaged: beside the gradients each member hands in a marker, a vector with one entry per
member that is 1 at its own place and 0 elsewhere. Averaged, entry j is member j's share of the weights, so a
member whose marker comes back with another member's entry at 0 knows that member's part never reached the
average; all at 0 is a round that averaged nothing (hivemind's 8-bit codecs fail that way on this stack,
docs/design.md §7). Such a round counts as failed.

The gradients travel as float64, uncompressed, so that every member ends with the same average. hivemind's runner
hands each member its own tensor plus (average - its tensor), rounded in the tensor's dtype: in float32 the
members' results differ by a few ulps of their own gradients, which is large where the average cancels, and
AdamW's early steps move a weight by about ±lr whatever its gradient's size, so stage mates drifted apart (1e-6
relative after one step here). Summed in float64 from float32 values, each member's result rounds back to the same
float32 but for a chance of about 1e-9 per entry. This doubles the averaging bytes (the planner's P counts them),
which delayed parameter updates hide behind the next epoch; a lossy codec here would be the one place where
workers' steps differ by more than rounding.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression import CompressionBase, NoCompression
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

from p2ptrain.live.probe import dial_failure
from p2ptrain.protocol.messages import GroupMember
from p2ptrain.protocol.optimization import Digest
from p2ptrain.transport import Caller

logger = logging.getLogger(__name__)

# hivemind needs a positive weight; a worker without rows this epoch still takes part and gets the result
NO_ROWS_WEIGHT = 1e-9


@dataclass(frozen=True)
class RoundResult:
    group_size: int  # workers in the all-reduce; 1 for a lone worker, 0 if the round failed
    ok: bool
    rows_lost: int = 0  # rows of groupmates that died in the round, whose gradients are not in the average


def missing_parts(marker: torch.Tensor, group: tuple[GroupMember, ...], me: str) -> list[str]:
    """The members whose part did not reach the average, read from this member's averaged marker (module doc)."""
    return [member.peer_id for member, share in zip(group, marker.tolist())
            if member.peer_id != me and not share > 0]


def parameter_digest(params: list[torch.Tensor]) -> Digest:
    """A short digest of a stage's parameters, to compare across its workers (`protocol.optimization`)."""
    total, squares, weighted = 0.0, 0.0, 0.0
    with torch.no_grad():
        for position, param in enumerate(params, start=1):
            values = param.detach().double()
            part = values.sum().item()
            total, squares, weighted = total + part, squares + values.square().sum().item(), weighted + position * part
    return (float(sum(p.numel() for p in params)), float(len(params)), total, squares, weighted)


class StageAllReduce(ServicerBase):
    """One worker's side of its stage's all-reduce rounds; registered under a per-stage namespace.

    While a round runs, the groupmates' link probes are pinged every `probe_every_s`: hivemind's runner waits for a
    groupmate that died until `timeout`, and a dead process is known at once (its dial fails), so the round fails
    then instead."""

    def __init__(self, *, p2p: P2P | None, run_id: str, stage: int, timeout: float, caller: Caller,
                 probe_every_s: float = 1.0, probe_timeout_s: float = 2.0,
                 compression: CompressionBase = NoCompression()):
        self.p2p, self.timeout, self.caller, self.compression = p2p, timeout, caller, compression
        self.probe_every_s, self.probe_timeout_s = probe_every_s, probe_timeout_s
        self.stage, self.prefix = stage, f"{run_id}_stage{stage}_allreduce"
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
            yield message

    async def average(self, grads: list[torch.Tensor], *, epoch: int, rows: int, group: tuple[GroupMember, ...]
                      ) -> tuple[list[torch.Tensor], RoundResult]:
        """Average `grads` with the group; on failure the local gradients come back, and the result says so.

        A groupmate that dies in the round fails it for all (hivemind's runner loses the parts it reduced). The
        survivors each find the dead by probing every groupmate (a dead process's dial fails at once, alike for all),
        and average again among themselves, under a group id of the survivors' ids; the dead members' rows are then
        missing from the average (`rows_lost`; none for a server that only holds the state)."""
        members, lost = group, 0
        while len(members) > 1:
            averaged, ok = await self._round(grads, epoch=epoch, rows=rows, group=members)
            if ok:
                return averaged, RoundResult(group_size=len(members), ok=True, rows_lost=lost)
            me = self.caller.peer_id
            failures = await asyncio.gather(*(dial_failure(self.caller, m.peer_id, timeout=self.probe_timeout_s)
                                              for m in members if m.peer_id != me))
            dead = {m.peer_id for m, failure in zip([m for m in members if m.peer_id != me], failures)
                    if failure is not None}
            if not dead:
                return grads, RoundResult(group_size=0, ok=False)
            members = tuple(m for m in members if m.peer_id not in dead)
            lost += sum(m.rows for m in group if m.peer_id in dead)
            logger.warning(f"stage {self.stage} all-reduce of epoch {epoch}: {len(dead)} groupmate(s) died "
                           f"({', '.join(sorted(dead))}); averaging again among the {len(members)} alive")
        return grads, RoundResult(group_size=1, ok=True, rows_lost=lost)

    async def _round(self, grads: list[torch.Tensor], *, epoch: int, rows: int, group: tuple[GroupMember, ...]
                     ) -> tuple[list[torch.Tensor], bool]:
        """One all-reduce among `group`: the averaged gradients and True, or the local ones and False."""
        members = ",".join(m.peer_id for m in group)
        group_id = hashlib.sha256(f"{self.prefix}:{epoch}:{members}".encode()).digest()
        me = self.caller.peer_id
        marker = torch.tensor([1.0 if member.peer_id == me else 0.0 for member in group])
        tensors = [grad.detach().double() for grad in grads] + [marker.double()]
        modes = [AveragingMode.CLIENT if m.client_mode else AveragingMode.NODE for m in group]
        if AveragingMode.NODE not in modes:  # hivemind asserts; a round nobody can reduce fails like any other
            logger.warning(f"all-reduce of epoch {epoch} among {len(group)} workers failed: every member dials out "
                           "only (client mode), none can reduce")
            return grads, False
        runner = AllReduceRunner(
            p2p=self.p2p, servicer_type=StageAllReduce, prefix=self.prefix, group_id=group_id, tensors=tensors,
            weight=float(rows) if rows else NO_ROWS_WEIGHT,
            ordered_peer_ids=[PeerID.from_base58(m.peer_id) for m in group],
            peer_fractions=tuple(0.0 if mode == AveragingMode.CLIENT else 1.0 for mode in modes), modes=modes,
            compression=self.compression,
        )
        self._runner(group_id).set_result(runner)

        updates = runner.run()

        async def reduce() -> None:
            # the runner yields one update per tensor, in order (not hivemind's azip: its gather leaves futures whose
            # cancellation nobody retrieves when a round is cancelled)
            for tensor in tensors:
                tensor.add_(await anext(updates))

        rounds = asyncio.create_task(reduce())
        watch = asyncio.create_task(self._watch([m.peer_id for m in group]))
        try:
            async with asyncio.timeout(self.timeout):
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
            return grads, False
        finally:
            for task in (rounds, watch):
                task.cancel()
            await asyncio.gather(rounds, watch, return_exceptions=True)
            self._runners.pop(group_id, None)
            # the runner's reducer may still be sending this peer's share to slower groupmates: it finishes in the
            # background, and leaves nothing for the garbage collector to finalize and log from wherever that runs
            # (it once broke an ast.parse in the same thread)
            self._finishing.add(task := asyncio.create_task(self._finish(runner, updates)))
            task.add_done_callback(self._finishing.discard)
        return [tensor.float() for tensor in tensors[:-1]], True

    async def _finish(self, runner: AllReduceRunner, updates: AsyncIterator[torch.Tensor]) -> None:
        """Let a round's runner end as hivemind ends it (after its last update it finalizes and awaits its tasks),
        within the round's timeout; then take the outcome its own future holds, which hivemind gives no public way
        to await."""
        try:
            await asyncio.wait_for(anext(updates, None), self.timeout)
        except Exception:  # failed or timed out: the round's result was taken already
            runner.finalize(cancel=True)
        finally:
            if runner._future.done() and not runner._future.cancelled():
                runner._future.exception()

    async def _watch(self, peers: list[str]) -> str:
        """Returns the first of `peers` whose process cannot be reached; runs until cancelled otherwise."""
        others = [peer for peer in peers if peer != self.caller.peer_id]
        while True:
            await asyncio.sleep(self.probe_every_s)
            for peer in others:  # one only slow or busy is left to the round's own timeout
                if await dial_failure(self.caller, peer, timeout=self.probe_timeout_s) is not None:
                    return peer
