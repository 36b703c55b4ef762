"""What may change under a background copy, and the check that a staged copy is not torn.

With ``staging="background"`` the training loop runs on while the large tensors are copied; the
contract is that it changes none of them until staging completes. This module checks that it
kept it: :class:`TornGuard` records, before any background copy starts, what each watched
tensor is, and after the last copy landed, compares. Any difference fails the save by name,
before anything is committed (:class:`~s3dcp.errors.TornCheckpointError`; objects already sent
from slabs that were in are deleted).

What a tensor can undergo, and what sees it::

    in-place ops, out= ops, set_, resize_, as_strided_,    the version counter (``_version``), shared
    writes through views and detach()                      by every view and detach() of a tensor
    .data = other, set_ to other memory, a storage         the address of the first byte (``data_ptr``)
    resized or swapped (swap_tensors)                      and the shape
    an in-place op on a DTensor (its local tensor keeps    the DTensor's own version counter
    its count)
    a torch.optim step (fused optimizers, and foreach      none: the step itself waits for the
    ones on DTensors, bump no version counter for what     stages in flight (a global step pre-hook,
    they write)                                            saving/background.py)
    the state dict itself (keys added, values replaced,    nothing to see: the staged dict's structure
    non-tensor values changed)                             and other values were copied before
                                                           stage() returned
    a kernel that writes without a version bump during     nothing: such tensors below 64 KiB (norms'
    the forward pass (BatchNorm's running statistics)      running statistics) are copied before
                                                           stage() returns (saving/copies.py)

Unseen, hence the contract: writes outside an optimizer step that bypass the version counter
to a tensor of 64 KiB or more — through ``t.data`` (a tensor of its own counter), ``t.numpy()``,
DLPack or ``from_blob`` aliases, foreach ops on DTensors, custom kernels, an optimizer that is
not a ``torch.optim.Optimizer`` — and a write undone before the check. A loop that
waits for staging before it changes the state never needs the check.

Owns the snapshot and the comparison; must not copy, nor decide what is copied when
(:mod:`s3dcp.saving.copies`), nor fail the save itself (the stager records the error on the
lease, and ``write_data`` raises it, on every rank through DCP's collective).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import TornCheckpointError

__all__ = ["TornGuard"]

_SHOWN = 5  # tensors an error names (and how many more there are)


def _looks(tensor: torch.Tensor, owner: Any) -> tuple:
    """What is compared: version counters (the tensor's and, for a DTensor, its own), where its
    first byte is, and its shape."""
    own = owner._version if owner is not tensor else -1
    return tensor._version, own, tensor.data_ptr(), tensor.shape


class TornGuard:
    """The watched tensors of one background stage, as they were when stage() was called.

    ``sources[i]`` is held by ``owners[i]`` (a DTensor, or itself); ``watched`` are the indices
    to check. Made on the training thread before any background copy starts; :meth:`check`
    runs after the last copy landed (its events synchronised)."""

    def __init__(self, sources: list[torch.Tensor], owners: list[Any], watched: list[int]) -> None:
        self._watched = [(i, sources[i], owners[i]) for i in watched]
        self._before = [_looks(t, o) for _, t, o in self._watched]

    def changed(self) -> list[int]:
        """The indices of the watched tensors that are not what they were."""
        return [i for (i, t, o), before in zip(self._watched, self._before) if _looks(t, o) != before]

    def check(self, names: Callable[[], list[str]], where: str) -> TornCheckpointError | None:
        """The error for this save if a watched tensor changed (None if none did); ``names()``
        gives every source's name, in order (only asked when something changed; if it fails, the
        error names them by index, ``#i``)."""
        changed = self.changed()
        if not changed:
            return None
        try:
            every = names()
        except Exception:  # noqa: BLE001 - the torn copy is the error to raise; tensors are named by index
            every = []
        shown = ", ".join(every[i] if i < len(every) else f"#{i}" for i in changed[:_SHOWN])
        more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
        return TornCheckpointError(
            f"refusing to save {where}: {shown}{more} changed while staging still copied the state "
            f"(async_save returned with staging in the background, and the training loop changed the "
            f"tensor before staging completed); nothing was committed. Wait for staging before the "
            f"optimizer step (AsyncSaveResponse.staging_completion.result(), CheckpointManager."
            f"wait_staged()), or stage before returning (staging='blocking')", names=[every[i] for i in changed
                                                                                        if i < len(every)])

    def release(self) -> None:
        """Let go of the sources (the loop may free them)."""
        self._watched = []
