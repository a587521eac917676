"""Per-stage gradient averaging at each global batch with hivemind's butterfly all-reduce.

The group is not found by DHT matchmaking: when an epoch closes, the stage's first FS fixes the group (the
workers it has seen) and hands the same list to every worker, so all agree on peers, order and group id at
once. (hivemind's matchmaking left peers out of rounds on a loaded 2-core machine and costs its waiting time.)
Each worker hands in its mean gradient weighted by the rows it computed, so the average is the gradient of
the whole batch. A worker behind NAT (client mode) sends its part and receives the result but reduces none.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter, azip

from p2ptrain.live.probe import dial_failure
from p2ptrain.protocol.messages import GroupMember
from p2ptrain.transport import Caller

logger = logging.getLogger(__name__)

# hivemind needs a positive weight; a worker without rows this epoch still takes part and gets the result
NO_ROWS_WEIGHT = 1e-9


@dataclass(frozen=True)
class RoundResult:
    group_size: int  # workers in the all-reduce; 1 for a lone worker, 0 if the round failed
    ok: bool


class StageAllReduce(ServicerBase):
    """One worker's side of its stage's all-reduce rounds; registered under a per-stage namespace.

    While a round runs, the groupmates' link probes are pinged every `probe_every_s`: hivemind's runner waits for a
    groupmate that died until `timeout`, and a dead process is known at once (its dial fails), so the round fails
    then instead."""

    def __init__(self, *, p2p: P2P | None, run_id: str, stage: int, timeout: float, caller: Caller,
                 probe_every_s: float = 1.0, probe_timeout_s: float = 2.0):
        self.p2p, self.timeout, self.caller = p2p, timeout, caller
        self.probe_every_s, self.probe_timeout_s = probe_every_s, probe_timeout_s
        self.prefix = f"{run_id}_stage{stage}_allreduce"
        self._runners: dict[bytes, asyncio.Future] = {}

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
        """Average `grads` with the group; on failure the local gradients come back, and the result says so."""
        if len(group) <= 1:
            return grads, RoundResult(group_size=1, ok=True)
        group_id = hashlib.sha256(f"{self.prefix}:{epoch}".encode()).digest()
        tensors = [grad.detach().clone() for grad in grads]
        modes = [AveragingMode.CLIENT if m.client_mode else AveragingMode.NODE for m in group]
        runner = AllReduceRunner(
            p2p=self.p2p, servicer_type=StageAllReduce, prefix=self.prefix, group_id=group_id, tensors=tensors,
            weight=float(rows) if rows else NO_ROWS_WEIGHT,
            ordered_peer_ids=[PeerID.from_base58(m.peer_id) for m in group],
            peer_fractions=tuple(0.0 if mode == AveragingMode.CLIENT else 1.0 for mode in modes), modes=modes,
        )
        self._runner(group_id).set_result(runner)

        async def reduce() -> None:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update)

        rounds = asyncio.create_task(reduce())
        watch = asyncio.create_task(self._watch([m.peer_id for m in group]))
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.wait([rounds, watch], return_when=asyncio.FIRST_COMPLETED)
            if not rounds.done():
                raise ConnectionError(f"groupmate {watch.result()} cannot be reached")
            rounds.result()
        except Exception as e:
            logger.warning(f"all-reduce of epoch {epoch} among {len(group)} workers failed: {e!r}")
            return grads, RoundResult(group_size=0, ok=False)
        finally:
            for task in (rounds, watch):
                task.cancel()
            await asyncio.gather(rounds, watch, return_exceptions=True)
            self._runners.pop(group_id, None)
        return tensors, RoundResult(group_size=len(group), ok=True)

    async def _watch(self, peers: list[str]) -> str:
        """Returns the first of `peers` whose process cannot be reached; runs until cancelled otherwise."""
        others = [peer for peer in peers if peer != self.caller.peer_id]
        while True:
            await asyncio.sleep(self.probe_every_s)
            for peer in others:  # one only slow or busy is left to the round's own timeout
                if await dial_failure(self.caller, peer, timeout=self.probe_timeout_s) is not None:
                    return peer
