"""The encoding of a stage's state (its parameters and optimizer state) as one blob of bytes: what a stage mate
downloads (`client.state_sync`) and what a checkpoint holds on disk (`state.checkpoint`).

The blob (one uint8 tensor) is the bytes of one safetensors buffer (`safetensors.torch.save`) holding

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
hyperparameter names; per-parameter state only for its own parameters, each tensor a scalar or shaped as the local
optimizer keeps it for that parameter (like the parameter for AdamW's moments; bitsandbytes' 8-bit AdamW keeps
uint8 moments, their blockwise absmax and quantization maps).
"""
from __future__ import annotations

import inspect
import json
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

FORMAT = 1  # of the blob's encoding; a receiver refuses others
STATE_METADATA = "p2ptrain.stage_state"  # the safetensors metadata key that holds the JSON part
MODEL, OPTIMIZER = "model/", "optimizer/"
NESTED = ":"  # joins the names of a nested optimizer entry (`_flatten`)
IMPLEMENTATION = ("fused", "foreach")  # optimizer group settings that say how it steps, not what its state is


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
        # JSON turns tuples (AdamW's betas) into lists; give each value the local group's container type back. How
        # the optimizer steps (fused or not) is this holder's, fit to its device: a state stepped another way is the same
        groups.append({key: local_group[key] if key in IMPLEMENTATION else
                       tuple(value) if isinstance(local_group[key], tuple) else value for key, value in group.items()})
    params = {index: param for group, local in zip(local_groups, optimizer.param_groups)
              for index, param in zip(group["params"], local["params"])}
    expected: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
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
        # per-parameter optimizer state is either a scalar (a step count, a norm) or a statistic as the local
        # optimizer keeps it for this parameter
        if number not in expected:
            expected[number] = reference_state(optimizer, param)
        shape, dtype = expected[number].get(entry, ((), None))
        if tensor.numel() > 1 and (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
            raise StateMismatch(f"optimizer entry {name!r} is {tensor.dtype} {list(tensor.shape)}, this stage's "
                                f"optimizer keeps {dtype} {list(shape)} there")
        state.setdefault(number, {})[entry] = tensor
    return {"state": {number: _nest(entries) for number, entries in state.items()}, "param_groups": groups}


def reference_state(optimizer: torch.optim.Optimizer, param: torch.Tensor
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each tensor `optimizer`'s kind keeps for a parameter like `param`: what one step of a
    fresh optimizer of its kind and settings leaves on a zero copy of it, flattened as the blob names it."""
    probe = torch.nn.Parameter(torch.zeros_like(param))
    probe.grad = torch.zeros_like(param)
    kind = type(optimizer)
    accepted = inspect.signature(kind).parameters  # `defaults` may hold settings its constructor derives
    fresh = kind([probe], **{key: value for key, value in optimizer.defaults.items() if key in accepted})
    fresh.step()
    return {name: (tuple(value.shape), value.dtype) for name, value in _flatten(fresh.state_dict()["state"][0])
            if isinstance(value, torch.Tensor)}


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
