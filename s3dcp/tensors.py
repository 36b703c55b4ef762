"""Raw-byte views of tensors: how s3dcp stores a tensor (C-contiguous bytes, no pickling)."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["byte_view", "to_host_contiguous"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over the bytes of a contiguous CPU tensor (no copy).

    Works for every dtype (bfloat16, float8, complex...) and needs no numpy: the view is a
    ctypes array over the tensor's memory that holds a reference to the tensor, so the memory
    stays valid as long as the view (or any slice of it) is alive.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    raw._owner = tensor  # keeps the storage alive for as long as the view
    return memoryview(raw).cast("B")


def to_host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a contiguous CPU tensor: itself when it already is one,
    otherwise one copy (device to host, or a gather of a strided view)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()
