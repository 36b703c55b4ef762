"""Staging for async_save (work in progress)."""
from __future__ import annotations


class StagingMixin:
    def _init_staging(self, pool) -> None:
        self._pool = pool

    def _staging_getstate(self) -> dict:
        return {"_pool": None}
