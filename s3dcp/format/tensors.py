"""Raw-byte views of tensors: how s3dcp stores a tensor (C-contiguous bytes, no pickling)."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["byte_view", "to_host_contiguous", "has_lazy_bits"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over the bytes of a contiguous CPU tensor (no copy).

    Works for every dtype (bfloat16, float8, complex...) and needs no numpy: the view is a
    ctypes array over the tensor's memory that holds a reference to the tensor, so the memory
    stays valid as long as the view (or any slice of it) is alive.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or has_lazy_bits(tensor):
        raise ValueError("byte_view needs a contiguous CPU tensor whose memory holds its values "
                         "(no lazy conjugate or negative bit)")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    raw._owner = tensor  # keeps the storage alive for as long as the view
    return memoryview(raw).cast("B")


def has_lazy_bits(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory does not hold the values it reads as: a lazy conjugate or
    negative view (``z.conj()`` of a complex tensor), which only a copy (``copy_``,
    ``resolve_conj``) materializes. Its raw bytes would save, or load, the wrong values."""
    return tensor.is_conj() or tensor.is_neg()


def to_host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a contiguous CPU tensor: itself when it already is one,
    otherwise one copy (device to host, a gather of a strided view, or the values of a lazy
    conjugate or negative view)."""
    tensor = tensor.detach().resolve_conj().resolve_neg()  # each returns the tensor itself if no bit
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()
