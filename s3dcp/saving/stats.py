"""The figures of a save on one rank (:class:`SaveStats`): what the writer measures and what
``s3dcp.last_save_stats()`` and ``CheckpointManager.last_save_stats`` report."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SaveStats"]


@dataclass(frozen=True)
class SaveStats:
    """Figures of the last save on this rank (for logs and benchmarks)."""

    stage_s: float = 0.0  # time the caller was blocked copying into the staging pool (async_save)
    upload_s: float = 0.0  # write_data: resolve + checksum + upload of this rank's objects
    bytes: int = 0  # bytes this rank uploaded
    objects: int = 0
    inherited_bytes: int = 0  # bytes of unchanged items referenced in the base (incremental saves)
    inherited_items: int = 0

    @property
    def upload_gbps(self) -> float:
        """Upload throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.upload_s / 1e9 if self.upload_s > 0 else 0.0
