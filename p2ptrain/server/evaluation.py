"""Held-out loss through the pipeline: every server holds its stage's parameters (its worker's master copy), so
the data source sends held-out rows to its own stage-0 evaluator, which runs stage 0 forward and hands the hidden
states to a server of stage 1, and so on; the last stage answers with the summed token loss, which travels back
up the chain. Forward only: nothing is stored and no gradient is computed.

Each request names the epoch whose parameters it wants (those after stepping through epoch - 1); a server whose
step of that epoch is still in flight (delayed parameter updates) waits for it, up to the averaging timeout. The
forward runs in the event loop, where the optimizer steps too, so it never sees half a step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import P2PContext

from p2ptrain.client.device import autocast, to_device, to_host
from p2ptrain.compression import BadTensorError, check_tensor
from p2ptrain.protocol.messages import MAX_ROWS, STAGE_EVAL, EvalForward, EvalLoss
from p2ptrain.transport import Caller, Refused, Requests, Responses, Service

if TYPE_CHECKING:
    from p2ptrain.client.worker import Worker

logger = logging.getLogger(__name__)


class StageEvaluator(Service):
    """A server's stage in the evaluation chain (module doc); `servers(stage)` names the servers of a stage."""

    service = STAGE_EVAL

    def __init__(self, *, worker: Worker, caller: Caller, servers: Callable[[int], list[str]]):
        super().__init__(peer_id=worker.worker_id, name=f"stage {worker.stage} evaluation",
                         codec=worker.config.compression)
        self.worker, self.caller, self.servers = worker, caller, servers
        caller.add_local(self)

    def rpc_eval_forward(self, requests: Requests, context: P2PContext) -> Responses:
        return self.serve(requests, context, EvalForward, self.eval_forward)

    async def eval_forward(self, request: EvalForward, sender: str) -> EvalLoss:
        worker, config = self.worker, self.worker.config
        model = worker.master.module
        if request.stage != worker.stage:
            raise Refused(f"this server holds stage {worker.stage}, not {request.stage}")
        rows = request.labels.shape[0] if isinstance(request.labels, torch.Tensor) and request.labels.dim() else 0
        try:
            if not 1 <= rows <= MAX_ROWS:
                raise BadTensorError(f"labels: expected 1 to {MAX_ROWS} rows")
            check_tensor(request.labels, shape=(rows, config.seq_len), dtype=torch.int64, what="labels")
            if model.is_first:
                check_tensor(request.inputs, shape=(rows, config.seq_len), dtype=torch.int64, what="token ids")
            else:
                check_tensor(request.inputs, shape=(rows, config.seq_len, config.model_config.hidden_size),
                             dtype=torch.float32, what="hidden states")
        except BadTensorError as e:
            raise Refused(str(e)) from None
        await self._wait_for(request.epoch)
        device = worker.master.device
        inputs, labels = to_device(request.inputs, device), to_device(request.labels, device)
        with torch.no_grad(), autocast(device, config.precision):
            if model.is_last:
                return EvalLoss(loss_sum=float(model(inputs, labels)), tokens=request.labels.numel())
            hidden = to_host(model(inputs))
        onward = EvalForward(epoch=request.epoch, stage=worker.stage + 1, inputs=hidden, labels=request.labels)
        for server in self.servers(worker.stage + 1):
            try:
                return await self.caller.call(server, STAGE_EVAL, onward, timeout=worker.settings.rpc_timeout_s)
            except Exception as e:  # refused, or failed in transport: another server of the stage may answer
                logger.warning(f"{self.name}: stage {worker.stage + 1} server {server} did not evaluate: {e!r}")
        raise Refused(f"no server of stage {worker.stage + 1} evaluated the rows")

    async def _wait_for(self, epoch: int) -> None:
        master = self.worker.master
        if not await master.reached(epoch, timeout=self.worker.settings.averaging_timeout_s):
            raise Refused(f"this server's parameters are of epoch {master.epoch}, not yet {epoch}")
