"""DCP's "torch.distributed is disabled ... assuming the intent is to save in a single process"
warning, hidden for the DCP calls s3dcp makes itself (the one-call API, the manager) and for no
other.

Without torch.distributed, ``dcp.save``/``dcp.load`` warn on every call; for ``s3dcp.save`` or a
:class:`~s3dcp.CheckpointManager` in one process, a single process is what the caller asked for.
The warning of an asynchronous save comes from DCP's upload thread, after ``async_save`` has
returned, so ``warnings.catch_warnings()`` around the call (process-wide, not thread-safe)
cannot hide it. Instead one filter entry stays in ``warnings.filters``: its message matcher
(an object with ``match``, as the warnings machinery calls it) looks at the DCP call that warns
and matches only when that call's ``storage_writer``/``storage_reader`` is one s3dcp made for its
own call (:func:`ours`). A user's own ``dcp.save(..., storage_writer=S3StorageWriter(...))``
still warns as DCP means it to.
"""

from __future__ import annotations

import sys
import warnings
import weakref

__all__ = ["ours"]

_PREFIX = "torch.distributed is disabled"
_FRAMES = 4  # how far up from the matcher to look for DCP's save/load frame
_OURS: "weakref.WeakSet[object]" = weakref.WeakSet()


class _OwnCalls:
    """The filter's message matcher: DCP's single-process warning, in a call on one of ours."""

    def match(self, text: str) -> bool:
        if not text.startswith(_PREFIX):
            return False
        frame = sys._getframe(1)  # the frame that called warnings.warn: DCP's save or load
        for _ in range(_FRAMES):
            if frame is None:
                return False
            local = frame.f_locals
            for name in ("storage_writer", "storage_reader"):
                try:
                    if local.get(name) in _OURS:
                        return True
                except TypeError:  # an unhashable storage of someone else's
                    pass
            frame = frame.f_back
        return False


_ENTRY = ("ignore", _OwnCalls(), UserWarning, None, 0)


def ours(storage: object) -> object:
    """Mark ``storage`` (a writer or reader s3dcp hands to DCP for its own call) so that DCP's
    single-process warning is not shown for calls on it; returns it. Puts the filter first in
    ``warnings.filters`` (again, if a ``simplefilter`` went before it since)."""
    _OURS.add(storage)
    filters = warnings.filters
    if not filters or filters[0] is not _ENTRY:
        try:
            filters.remove(_ENTRY)
        except ValueError:
            pass
        filters.insert(0, _ENTRY)
        mutated = getattr(warnings, "_filters_mutated", None)  # warnings' cache of what was shown
        if mutated is not None:
            mutated()
    return storage
