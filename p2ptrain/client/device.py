"""Where and in what a worker computes: its device (`--device`), the run's precision (`--precision`), and the one
place tensors cross between the device and the host.

A stage's weights live on the device in the run's precision, its fp32 master copy, accumulated gradients and optimizer
state there too or, offloaded (`--offload-optimizer`), in host memory; what travels (activations, gradients, averaging
rounds, states) is fp32 on the host. bf16 and fp16 runs compute under autocast with weights of that type, so the master
weights and the optimizer step stay fp32; fp16's narrow range needs a loss scale besides (`state.params.LossScale`).
"""
from __future__ import annotations

import contextlib

import torch

from p2ptrain.config import ConfigError, check_device

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when there is one, else the CPU), `cpu`, `cuda` or `cuda:N`; a ConfigError names what is not
    here. A CUDA device comes back with its index, as tensors report theirs (`cuda` is not equal to `cuda:0`)."""
    check_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ConfigError("device", name, "this machine has no CUDA device torch can use; use --device cpu or auto")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError("device", name, f"this machine has {torch.cuda.device_count()} CUDA device(s), "
                                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def place(model: torch.nn.Module, device: torch.device, precision: str) -> torch.nn.Module:
    """The model a worker computes with: on its device, its weights in the run's precision (autocast then computes
    the ops that need it, norms and softmax, in fp32)."""
    return model.to(device=device, dtype=DTYPES[precision])


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context a stage's forward (and its recomputation) runs in; backward follows the forward's dtypes."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def to_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A tensor from the wire onto the device (pinned and non-blocking from a CUDA device's host side)."""
    if tensor is None or tensor.device == device:
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor for the wire: detached, fp32 (integer tensors as they are), on the host."""
    tensor = tensor.detach()
    if tensor.is_floating_point() and tensor.dtype != torch.float32:
        tensor = tensor.float()
    return tensor.cpu()
