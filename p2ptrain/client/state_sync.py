"""A joining or restarted worker starts from its stage's current state, downloaded from a server of its stage (every
server holds the state, docs/design.md §6), else from a live stage mate.

Every worker serves its state (`StageStateServer`, service `STAGE_STATE`), and so does every server, whose replica
is a worker that takes no tasks; before its first task, a worker asks its stage's servers, then its other stage
mates, for theirs (`load_state_from_peers`), as hivemind's `DecentralizedAverager` does with
`rpc_download_state` and `load_state_from_peers`. With no mate able to serve, it starts from the seed's weights,
as the first workers of a run do.

What a worker serves. The parameters of its master copy (the one its optimizer steps; `client.worker`) and its
optimizer state, taken in one piece in the event loop: the optimizer steps
synchronously in that loop too, so a snapshot never sees half a step. It refuses (`Refused`) while it holds only
the seed's weights, that is, until it has stepped once since it started or loaded a mate's state
(`StageParams.holds_seed`): a fresh worker that served would hand its seed weights to a
joiner as if they were the stage's. A client-mode worker refuses too: it dials out only, so it is no peer to
download from. The reply's epoch is the epoch the master copy's parameters are current for (`StageParams.epoch`:
the one after its last step); with delayed parameter updates a step in flight is not in them yet.

The reply's `blob` is the state encoded as `state.codec` says, the encoding a checkpoint holds too.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from hivemind.p2p import P2PContext

from p2ptrain.protocol.messages import STAGE_STATE, DownloadState, StageStateReply
from p2ptrain.state.codec import StateMismatch
from p2ptrain.transport import Caller, Refused, Requests, Responses, Service

if TYPE_CHECKING:  # the worker wires this module in; importing it at runtime would only add a cycle's risk
    from p2ptrain.client.worker import Worker
    from p2ptrain.models.base import StageModel
    from p2ptrain.state.params import StageParams

logger = logging.getLogger(__name__)

# Until RuntimeConfig has them: how long one stage mate may take to send its state (a stage of a few GB at tens of
# MB/s takes minutes), and how long a joining worker looks for one at most before it starts from the seed.
STATE_DOWNLOAD_TIMEOUT_S = 120.0
STATE_DOWNLOAD_DEADLINE_S = 300.0
BEHIND_RETRY_S = 1.0  # a peer whose state is behind the asker's says to ask again after this long...
BEHIND_WAIT_S = 30.0  # ...and an asker that only such refusals answered asks again for this long at most


class StageStateServer(Service):
    """Serves a worker's state to stage mates that join (`DownloadState`), under the rules of the module docstring.
    """

    service = STAGE_STATE

    def __init__(self, *, worker: Worker):
        super().__init__(peer_id=worker.worker_id, name=f"stage {worker.stage} state", codec="none")
        self.worker = worker

    def rpc_download_state(self, requests: Requests, context: P2PContext) -> Responses:
        return self.serve(requests, context, DownloadState, self.download_state)

    async def download_state(self, request: DownloadState, sender: str) -> StageStateReply:
        worker, master = self.worker, self.worker.master
        model = master.module
        if (request.stage, request.start, request.end) != (worker.stage, model.start, model.end):
            raise Refused(f"this worker holds layers [{model.start}, {model.end}) of stage {worker.stage}, not "
                          f"[{request.start}, {request.end}) of stage {request.stage}")
        if worker.client_mode:
            raise Refused("a client-mode worker does not serve its state")
        stale = Refused("the stage stepped without it (a failed round, or it was left out and none served it the "
                        "stage's state): its parameters may stand apart from the stage's")
        if worker.stale:  # checked before waiting too: its update in flight may be a reload from the asker
            raise stale
        # with DPU a step may be in flight: the state served is the one after it, so that a joiner is current for the
        # epoch the stage computes (served before it, the joiner would stand an epoch behind and be left out again).
        # Unless that round waits for the asker (it joined the group, then found it must load the state first): then
        # the state before the round, with which the asker takes part in it and steps as its mates do
        if not worker.averages_with(sender):
            await worker.updated()
            if worker.stale:
                raise stale
        # only a step under way will bring it to the asker's epoch: a peer that is itself behind (left out of a
        # group, catching up) refuses at once, or two such servers asking each other would wait on each other; so does
        # one whose round under way waits for the asker, which cannot end while the asker waits for its step
        behind = master.epoch < request.at_least and (worker.stepping != request.at_least - 1
                                                      or worker.averages_with(sender))
        if behind or not await master.reached(request.at_least, timeout=worker.settings.averaging_timeout_s):
            # it may get there soon by itself (stepping, catching up, passing abandoned epochs): ask again
            raise Refused(f"this peer's state is of epoch {master.epoch}, behind the asker's {request.at_least}",
                          retry_after_s=BEHIND_RETRY_S)
        # checked after the wait: a peer whose first step is in flight has only the seed's weights until it lands
        if master.holds_seed:
            raise Refused("this worker holds only the seed's weights: it has not stepped since it started")
        epoch, blob = await master.encoded()
        logger.info(f"worker {worker.worker_id}: sending its state of epoch {epoch} ({blob.numel() / 2**20:.1f} MiB) "
                    f"to {sender}")
        return StageStateReply(epoch=epoch, blob=blob)


class StateTarget(Protocol):
    """What a stage's state downloads into: a worker, or a stage copy that is exported (`node.export`)."""

    worker_id: str  # who asks
    stage: int
    epoch: int  # the state must be current for this epoch at least
    model: StageModel
    master: StageParams

    def load_state(self, *, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], epoch: int
                   ) -> None: ...


async def load_state_from_peers(worker: StateTarget, *, caller: Caller, candidates: Iterable[str],
                                servers: Iterable[str] = (), timeout: float = STATE_DOWNLOAD_TIMEOUT_S,
                                deadline: float = STATE_DOWNLOAD_DEADLINE_S) -> int | None:
    """Load the stage's current state into `worker` from one of its stage's `servers`, else one of `candidates` (its
    other stage mates' peer ids), and return its epoch; None if none could serve one that fits, and the worker keeps
    what it has.

    Servers come first: they are reliable, can be dialed, and hold the state whatever the workers do. Each group is
    tried in random order, so that workers joining together spread over their servers and mates, each peer for at
    most `timeout` seconds and all together for about `deadline` seconds at most. A peer that refuses, fails in
    transport or sends a state that does not fit this worker is logged and skipped; one whose state is only behind
    the asker's epoch (it steps, catches up, or passes epochs the data source abandoned) is asked again every
    `BEHIND_RETRY_S` for up to `BEHIND_WAIT_S`.
    """
    first = [peer for peer in set(servers) if peer != worker.worker_id]
    then = [peer for peer in set(candidates) - set(first) if peer != worker.worker_id]
    random.shuffle(first)
    random.shuffle(then)
    order = first + then
    request = DownloadState(stage=worker.stage, start=worker.model.start, end=worker.model.end, at_least=worker.epoch)
    began = time.monotonic()
    give_up = began + deadline
    retry: list[str] = []  # peers that said to ask again (their state is behind the asker's, and moving)
    while order or retry:
        if not order:  # only such peers are left: the seed's weights are not the stage's, so rather ask them again
            if time.monotonic() - began >= BEHIND_WAIT_S:
                break
            await asyncio.sleep(BEHIND_RETRY_S)
            order, retry = retry, []
        peer = order.pop(0)
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            logger.warning(f"worker {worker.worker_id}: no stage mate sent its state within {deadline:.0f} s")
            break
        started = time.monotonic()
        try:
            reply = await caller.call(peer, STAGE_STATE, request, timeout=min(timeout, remaining))
            model_state, optimizer_state = worker.master.decode(reply.blob)
        except Refused as e:
            logger.info(f"worker {worker.worker_id}: {peer} does not serve its state: {e}")
            if e.retry_after_s is not None:
                retry.append(peer)
            continue
        except StateMismatch as e:
            logger.warning(f"worker {worker.worker_id}: the state of {peer} does not fit this stage: {e}")
            continue
        except Exception as e:  # transport failures come in many types (timeouts, connection and hivemind errors)
            logger.warning(f"worker {worker.worker_id}: downloading the state of {peer} failed: {e!r}")
            continue
        worker.load_state(model_state=model_state, optimizer_state=optimizer_state, epoch=reply.epoch)
        logger.info(f"worker {worker.worker_id}: loaded the state of epoch {reply.epoch} from {peer} "
                    f"({reply.blob.numel() / 2**20:.1f} MiB in {time.monotonic() - started:.1f} s)")
        return reply.epoch
    kept = "starting from the seed's weights" if worker.master.holds_seed else "keeping its own parameters"
    logger.info(f"worker {worker.worker_id}: no stage mate served its state; {kept}")
    return None
