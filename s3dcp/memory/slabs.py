"""Shared-memory files that staged tensors live in, and the file behind any tensor's memory.

    Slab: one file in shared memory (torch's file-descriptor storage: a /dev/shm file, unlinked,
          its descriptor kept open) mapped once into this process; tensors are carved from it
    file_of(tensor): the file (``/proc/self/fd/N``) and offset behind a tensor's bytes, when its
          memory is such a file — a slab of this process, or one a parent sent to DCP's process
          executor (torch sends the descriptor, not the bytes)

A slab is what the CRT uploads from: ``send_filepath=slab.path`` with a ``Content-Length`` of
the object's length sends the first bytes of the file, read on the CRT's own threads part by
part, with no copy into the CRT's buffers and no Python in the loop. So one slab holds one data
object's bytes, and the staged tensors of that object are views of it.

Owns :class:`Slab` (allocation, pinning for CUDA, the path) and :func:`file_of`. It must not
decide where tensors go in which slab (:mod:`s3dcp.memory.pool`) nor upload anything.

The path names this process's descriptor: it stays valid exactly while the storage lives, so
whoever hands the path to the CRT keeps the slab (or the tensor) referenced until the request
has ended; a descriptor number closed and reused meanwhile would name another file.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Slab", "FileSpan", "file_of", "files_supported", "staged_in_files", "can_pin"]

log = logging.getLogger("s3dcp")

_PROC_FD = "/proc/self/fd"


def files_supported() -> bool:
    """Whether staged memory can be shared-memory files the CRT reads by path: Linux's
    ``/proc/self/fd`` and torch's file-descriptor storages."""
    return os.path.isdir(_PROC_FD) and hasattr(torch.UntypedStorage, "_new_using_fd_cpu")


@dataclass(frozen=True)
class FileSpan:
    """Where a tensor's bytes are in a shared-memory file: its path in this process, the offset
    of the tensor's first byte, and the file's length. ``owner`` (the storage) keeps the
    descriptor open: hold it for as long as the path is in use."""

    path: str
    offset: int
    file_bytes: int
    owner: torch.UntypedStorage

    @property
    def address(self) -> int:
        """Where the file is mapped in this process (tells files apart while they live)."""
        return self.owner.data_ptr()


def file_of(tensor: torch.Tensor) -> FileSpan | None:
    """The shared-memory file behind ``tensor``'s bytes, or None (ordinary memory, a GPU tensor,
    or not contiguous). Never moves a storage: a storage that is not already a file-descriptor
    share is left alone (torch's ``_share_fd_cpu_`` would copy it into a new one)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    try:
        fd = storage._get_shared_fd()
    except (RuntimeError, AttributeError):
        return None
    offset = tensor.data_ptr() - storage.data_ptr()
    return FileSpan(f"{_PROC_FD}/{fd}", offset, storage.nbytes(), storage)


class Slab:
    """One shared-memory file of ``capacity`` bytes mapped once, as the uint8 tensor
    :attr:`buffer` (pinned when ``pinned`` and CUDA can: ``cudaHostRegister`` of its pages),
    and :attr:`path`, the file's name in this process (None where :func:`files_supported` is
    not: the slab is then ordinary memory)."""

    def __init__(self, capacity: int, pinned: bool, prefault: bool = True) -> None:
        self.capacity = capacity
        self.storage, self.path = _shared_file(capacity)
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(self.storage)[:capacity]
        if prefault and capacity:
            self.buffer.zero_()  # tmpfs pages allocated now, not inside the first stall
        unpin = _register(self.buffer) if pinned and can_pin() and capacity else None
        self.pinned = unpin is not None
        # Unpinned before the memory can be freed: the pool closes a slab it drops, and a
        # collected slab's finalizer runs while its storage is still alive.
        self._unpin = weakref.finalize(self, unpin) if unpin is not None else None

    @property
    def address(self) -> int:
        """Where the file's first byte is mapped in this process."""
        return self.storage.data_ptr()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of this slab (and the slab is still its storage: a
        storage moved elsewhere by a pickler no longer is)."""
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() == self.address

    def unpin(self) -> None:
        """Unregister the memory from CUDA now; it stays usable as ordinary memory."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False

    def close(self) -> None:
        """Unpin; the file and its mapping go once no tensor (nor request) holds the storage."""
        self.unpin()


def _shared_file(capacity: int) -> tuple[torch.UntypedStorage, str | None]:
    """A shared-memory file of ``capacity`` bytes and its path; ordinary memory (and no path)
    where there is no ``/proc`` (not Linux) or ``/dev/shm`` cannot hold it (torch allocates the
    file's pages at once, so a full ``/dev/shm`` is an error here, not a SIGBUS later)."""
    global _WARNED_NO_SHM
    if files_supported():
        try:
            storage = torch.UntypedStorage._new_using_fd_cpu(max(capacity, 1))
            _LAST_WAS_FILE[0] = True
            return storage, f"{_PROC_FD}/{storage._get_shared_fd()}"
        except RuntimeError as e:
            _LAST_WAS_FILE[0] = False
            if not _WARNED_NO_SHM:
                _WARNED_NO_SHM = True
                log.warning("staging memory is ordinary memory, not shared-memory files (%s): uploads then go "
                            "through a stream the CRT copies, at more CPU; give /dev/shm room for the state "
                            "(a container's --shm-size; docs/memory.md)", e)
    return torch.UntypedStorage(max(capacity, 1)), None


_WARNED_NO_SHM = False
_LAST_WAS_FILE = [True]  # whether the last slab made was a shared-memory file


def staged_in_files() -> bool:
    """Whether staging memory is shared-memory files now: where the last slab made fell back
    to ordinary memory (``/dev/shm`` full), copying more bytes into slabs buys no file upload."""
    return files_supported() and _LAST_WAS_FILE[0]


def can_pin() -> bool:
    """Whether this process can pin memory: CUDA is there, and this is not a child forked after
    its parent initialised CUDA."""
    return torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()


def _register(buf: torch.Tensor) -> Callable[[], None] | None:
    """Register ``buf`` with CUDA; return how to unregister it, or None if registering failed
    (the slab then works as ordinary memory: staging copies are synchronous)."""
    cudart = torch.cuda.cudart()
    ptr, pid = buf.data_ptr(), os.getpid()
    err = cudart.cudaHostRegister(ptr, buf.numel(), 0)
    if int(err) != 0:
        _clear_cuda_error()
        log.warning("cudaHostRegister of %d bytes of shared memory failed (%s); staging copies into it "
                    "are synchronous", buf.numel(), cudart.cudaGetErrorString(err))
        return None

    def unpin() -> None:
        if os.getpid() == pid:  # a forked child cannot call CUDA, and never registered it
            cudart.cudaHostUnregister(ptr)

    return unpin


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a failed call. torch's binding of ``cudaHostRegister``
    leaves it set, and the next kernel launch anywhere in the process would report it as its
    own failure. Best effort: through the libcudart torch loaded."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        log.debug("could not reset CUDA's last error", exc_info=True)
