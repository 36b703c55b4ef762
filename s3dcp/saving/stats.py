"""The figures of a save on one rank (:class:`SaveStats`): what the writer measures, and the
figures of the save that committed last in this process (:func:`record_committed`,
:func:`last_committed`), which ``s3dcp.last_save_stats()`` reports for the one-call saves and
:class:`~s3dcp.CheckpointManager` saves alike."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["SaveStats", "record_committed", "last_committed"]

_last: list["SaveStats | None"] = [None]
_last_lock = threading.Lock()


@dataclass(frozen=True)
class SaveStats:
    """Figures of the last save on this rank (for logs and benchmarks)."""

    stage_s: float = 0.0  # time the caller was blocked copying into the staging pool (async_save)
    upload_s: float = 0.0  # write_data: resolve + checksum + upload of this rank's objects
    bytes: int = 0  # bytes this rank uploaded
    objects: int = 0
    inherited_bytes: int = 0  # bytes of unchanged items referenced in the base (incremental saves)
    inherited_items: int = 0
    copied_bytes: int = 0  # bytes write_data copied into shared memory to upload them (see saving/uploads.py)
    # where the checkpoint is held (a CheckpointManager with local_dir): ("s3",), ("s3", "local") or
    # ("local",); local_error: why the node copies failed (on which rank); the same on every rank
    stored_in: tuple = ("s3",)
    local_error: str | None = None
    s3_error: str | None = None  # why a step meant for S3 is kept on the nodes only (an S3 outage)

    @property
    def upload_gbps(self) -> float:
        """Upload throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.upload_s / 1e9 if self.upload_s > 0 else 0.0


def record_committed(stats: SaveStats) -> None:
    """``stats`` are the figures of the save that committed last in this process (this rank's)."""
    with _last_lock:
        _last[0] = stats


def last_committed() -> SaveStats | None:
    """The figures :func:`record_committed` got last, or None before the first commit."""
    with _last_lock:
        return _last[0]
