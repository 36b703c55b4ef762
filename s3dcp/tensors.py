"""Raw-byte views of tensors: how s3dcp stores a tensor (C-contiguous bytes, no pickling)."""

from __future__ import annotations

import torch

__all__ = ["byte_view", "to_host_contiguous"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over the bytes of a contiguous CPU tensor (no copy).

    Works for every dtype, including bfloat16, float8 and complex, which numpy cannot
    represent directly: the tensor is reinterpreted as uint8 first.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def to_host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a contiguous CPU tensor: itself when it already is one,
    otherwise one copy (device to host, or a gather of a strided view)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()
