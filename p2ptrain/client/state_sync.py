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
the seed's weights, that is, until it has stepped once since it started (`Worker.master_epoch` is past 0) or loaded
a mate's state (`Worker.loaded_state`): a fresh worker that served would hand its seed weights to a
joiner as if they were the stage's. A client-mode worker refuses too: it dials out only, so it is no peer to
download from. The reply's epoch is the epoch the master copy's parameters are current for (`Worker.master_epoch`:
the one after its last step); with delayed parameter updates a step in flight is not in them yet.

The encoding of the reply's `blob` (one uint8 tensor): the bytes of one safetensors buffer
(`safetensors.torch.save`) holding

- ``model/<name>``: every entry of ``model.state_dict()``, parameters and buffers;
- ``optimizer/<index>/<name>``: every tensor of ``optimizer.state_dict()["state"][index]`` (AdamW's moments and
  its `step` count; an entry that is itself a map, as bitsandbytes' LAMB keeps its statistics, as
  ``<name>:<inner name>``);

and, in the buffer's own metadata under `STATE_METADATA`, a JSON object for what is not a tensor:
``{"format": FORMAT, "scalars": {"<index>": {"<name>": number}}, "param_groups": [...]}``, where `scalars` holds
the non-tensor entries of the optimizer's per-parameter state and `param_groups` its groups as `state_dict()` gives
them (hyperparameters and parameter indices). A tensor of the blob and its metadata are thus read with any
safetensors reader. The receiver checks the whole snapshot against its own model and optimizer before loading
anything (`decode_state`): the same state-dict names, shapes and dtypes; the same parameter groups with the same
hyperparameter names; per-parameter state only for its own parameters, each tensor a scalar or shaped like its
parameter.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from hivemind.p2p import P2PContext
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from p2ptrain.protocol.messages import STAGE_STATE, DownloadState, StageStateReply
from p2ptrain.transport import Caller, Refused, Requests, Responses, Service

if TYPE_CHECKING:  # the worker wires this module in; importing it at runtime would only add a cycle's risk
    from p2ptrain.client.worker import Worker

logger = logging.getLogger(__name__)

FORMAT = 1  # of the blob's encoding; a receiver refuses others
STATE_METADATA = "p2ptrain.stage_state"  # the safetensors metadata key that holds the JSON part
MODEL, OPTIMIZER = "model/", "optimizer/"
NESTED = ":"  # joins the names of a nested optimizer entry (`_flatten`)

# Until RuntimeConfig has them: how long one stage mate may take to send its state (a stage of a few GB at tens of
# MB/s takes minutes), and how long a joining worker looks for one at most before it starts from the seed.
STATE_DOWNLOAD_TIMEOUT_S = 120.0
STATE_DOWNLOAD_DEADLINE_S = 300.0


class StateMismatch(ValueError):
    """A downloaded snapshot does not fit the local model or optimizer (or is no snapshot); the text says where."""


OptimizerState = dict[str, Any]  # what torch.optim.Optimizer.state_dict() returns and load_state_dict() takes


def encode_state(model_state: dict[str, torch.Tensor], optimizer_state: OptimizerState) -> torch.Tensor:
    """The blob of a snapshot (see the module docstring); the tensors must not share memory (take copies)."""
    tensors = {MODEL + name: tensor for name, tensor in model_state.items()}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in optimizer_state["state"].items():
        for name, value in _flatten(entries):
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER}{index}/{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {"format": FORMAT, "scalars": scalars, "param_groups": optimizer_state["param_groups"]}
    data = save_safetensors(tensors, metadata={STATE_METADATA: json.dumps(meta)})
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a writable copy: torch warns on read-only memory


def decode_state(blob: object, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                 ) -> tuple[dict[str, torch.Tensor], OptimizerState]:
    """The model and optimizer state of a blob, checked against `model` and `optimizer` (which it does not touch);
    StateMismatch names the first entry that does not fit."""
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise StateMismatch("the state is not a 1-d uint8 tensor")
    data = blob.numpy().tobytes()
    try:
        tensors = load_safetensors(data)
        meta = json.loads(_safetensors_metadata(data)[STATE_METADATA])
        scalars, param_groups = meta["scalars"], meta["param_groups"]
        version = meta["format"]
    except Exception as e:  # safetensors, json and the lookups raise several types for garbage
        raise StateMismatch(f"the state does not decode: {e!r}") from None
    if version != FORMAT:
        raise StateMismatch(f"the state is in format {version}, this peer reads format {FORMAT}")
    model_state = _model_state(tensors, model)
    return model_state, _optimizer_state(tensors, scalars, param_groups, optimizer)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer: it starts with its JSON header's length, 8 bytes little-endian
    (the format's specification); `safetensors.torch.load` has already checked the buffer."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length])["__metadata__"]


def _model_state(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    local = model.state_dict()
    received = {name[len(MODEL):]: tensor for name, tensor in tensors.items() if name.startswith(MODEL)}
    missing, unknown = sorted(local.keys() - received.keys()), sorted(received.keys() - local.keys())
    if missing or unknown:
        raise StateMismatch(f"the state's model entries differ from this stage's: missing {missing[:3]}, "
                            f"unknown {unknown[:3]}")
    for name, expected in local.items():  # in the model's order, so that the first misfit named is the first layer's
        tensor = received[name]
        if (tensor.shape, tensor.dtype) != (expected.shape, expected.dtype):
            raise StateMismatch(f"model entry {name!r} is {tensor.dtype} {list(tensor.shape)}, this stage's is "
                                f"{expected.dtype} {list(expected.shape)}")
    return received


def _optimizer_state(tensors: dict[str, torch.Tensor], scalars: object, param_groups: object,
                     optimizer: torch.optim.Optimizer) -> OptimizerState:
    local_groups = optimizer.state_dict()["param_groups"]
    if not isinstance(param_groups, list) or len(param_groups) != len(local_groups):
        raise StateMismatch(f"the state's optimizer has other parameter groups than this stage's "
                            f"{len(local_groups)}")
    groups = []
    for k, (group, local_group) in enumerate(zip(param_groups, local_groups)):
        if not isinstance(group, dict) or group.keys() != local_group.keys():
            raise StateMismatch(f"the state's optimizer parameter group {k} has other settings than this stage's")
        if group["params"] != local_group["params"]:
            raise StateMismatch(f"the state's optimizer parameter group {k} holds other parameters")
        # JSON turns tuples (AdamW's betas) into lists; give each value the local group's container type back
        groups.append({key: tuple(value) if isinstance(local_group[key], tuple) else value
                       for key, value in group.items()})
    params = {index: param for group, local in zip(local_groups, optimizer.param_groups)
              for index, param in zip(group["params"], local["params"])}
    if not isinstance(scalars, dict):
        raise StateMismatch("the state's optimizer scalars are not a map")
    state: dict[int, dict[str, Any]] = {}
    for index, entries in scalars.items():
        if not isinstance(entries, dict):
            raise StateMismatch(f"the state's optimizer scalars of parameter {index} are not a map")
        state.setdefault(_param_index(index, params), {}).update(entries)
    for name, tensor in tensors.items():
        if name.startswith(MODEL):
            continue
        if not name.startswith(OPTIMIZER) or name.count("/") != 2:
            raise StateMismatch(f"the state holds an unknown tensor {name!r}")
        _, index, entry = name.split("/")
        number = _param_index(index, params)
        param = params[number]
        # per-parameter optimizer state is either a scalar (a step count, a norm) or a statistic shaped like its
        # parameter
        if tensor.numel() > 1 and (tensor.shape, tensor.dtype) != (param.shape, param.dtype):
            raise StateMismatch(f"optimizer entry {name!r} is {tensor.dtype} {list(tensor.shape)}, its parameter is "
                                f"{param.dtype} {list(param.shape)}")
        state.setdefault(number, {})[entry] = tensor
    return {"state": {number: _nest(entries) for number, entries in state.items()}, "param_groups": groups}


def _flatten(entries: dict[str, Any]) -> list[tuple[str, Any]]:
    """An optimizer's per-parameter state as flat (name, value) pairs: a nested map (bitsandbytes keeps its
    statistics in one) becomes ``outer:inner`` names."""
    return [(f"{name}{NESTED}{inner}", value) for name, nested in entries.items() if isinstance(nested, dict)
            for inner, value in nested.items()] + [(name, v) for name, v in entries.items() if not isinstance(v, dict)]


def _nest(entries: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name, value in entries.items():
        outer, _, inner = name.partition(NESTED)
        if inner:
            nested.setdefault(outer, {})[inner] = value
        else:
            nested[name] = value
    return nested


def _param_index(index: str, params: dict[int, torch.nn.Parameter]) -> int:
    if not index.isdigit() or int(index) not in params:
        raise StateMismatch(f"the state's optimizer holds state of a parameter {index!r} this stage does not have")
    return int(index)


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
        worker, model = self.worker, self.worker.master
        if (request.stage, request.start, request.end) != (worker.stage, model.start, model.end):
            raise Refused(f"this worker holds layers [{model.start}, {model.end}) of stage {worker.stage}, not "
                          f"[{request.start}, {request.end}) of stage {request.stage}")
        if worker.client_mode:
            raise Refused("a client-mode worker does not serve its state")
        stale = Refused("its last averaging round failed: its parameters may stand apart from the stage's")
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
        # group, catching up) refuses at once, or two such servers asking each other would wait on each other
        behind = worker.master_epoch < request.at_least and worker.stepping != request.at_least - 1
        if behind or not await worker.reached(request.at_least, timeout=worker.settings.averaging_timeout_s):
            raise Refused(f"this peer's state is of epoch {worker.master_epoch}, behind the asker's "
                          f"{request.at_least}")
        # checked after the wait: a peer whose first step is in flight has only the seed's weights until it lands
        if not (worker.master_epoch or worker.loaded_state):
            raise Refused("this worker holds only the seed's weights: it has not stepped since it started")
        # serializing the snapshot may take its time in a thread while the worker trains on
        epoch, model_state, optimizer_state = worker.snapshot()
        blob = await asyncio.to_thread(encode_state, model_state, optimizer_state)
        logger.info(f"worker {worker.worker_id}: sending its state of epoch {epoch} ({blob.numel() / 2**20:.1f} MiB) "
                    f"to {sender}")
        return StageStateReply(epoch=epoch, blob=blob)


async def load_state_from_peers(worker: Worker, *, caller: Caller, candidates: Iterable[str],
                                servers: Iterable[str] = (), timeout: float = STATE_DOWNLOAD_TIMEOUT_S,
                                deadline: float = STATE_DOWNLOAD_DEADLINE_S) -> int | None:
    """Load the stage's current state into `worker` from one of its stage's `servers`, else one of `candidates` (its
    other stage mates' peer ids), and return its epoch; None if none could serve one that fits, and the worker keeps
    what it has.

    Servers come first: they are reliable, can be dialed, and hold the state whatever the workers do. Each group is
    tried in random order, so that workers joining together spread over their servers and mates, each peer for at
    most `timeout` seconds and all together for about `deadline` seconds at most. A peer that refuses, fails in
    transport or sends a state that does not fit this worker is logged and skipped.
    """
    first = [peer for peer in set(servers) if peer != worker.worker_id]
    then = [peer for peer in set(candidates) - set(first) if peer != worker.worker_id]
    random.shuffle(first)
    random.shuffle(then)
    order = first + then
    request = DownloadState(stage=worker.stage, start=worker.model.start, end=worker.model.end, at_least=worker.epoch)
    give_up = time.monotonic() + deadline
    for peer in order:
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            logger.warning(f"worker {worker.worker_id}: no stage mate sent its state within {deadline:.0f} s")
            break
        started = time.monotonic()
        try:
            reply = await caller.call(peer, STAGE_STATE, request, timeout=min(timeout, remaining))
            model_state, optimizer_state = decode_state(reply.blob, worker.master, worker.optimizer)
        except Refused as e:
            logger.info(f"worker {worker.worker_id}: {peer} does not serve its state: {e}")
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
    logger.info(f"worker {worker.worker_id}: no stage mate served its state; starting from the seed's weights")
    return None
