"""A FIFO ring buffer of host memory: spans allocated in order and freed in the same order.

Used by :mod:`s3dcp.interop.export` to download tensors a few ahead of the writer in memory it owns,
so the memory bound does not depend on when the client lets go of a finished request's views.
"""

from __future__ import annotations

from collections import deque

import torch

__all__ = ["RingArena", "align"]


def align(n: int, to: int = 64) -> int:
    """``n`` rounded up to a multiple of ``to`` (64: every dtype's alignment)."""
    return -(-n // to) * to


class RingArena:
    """One host buffer the export owns, handed out first in, first out: tensors are allocated
    in file order and freed in the same order after they are written, so the live spans are
    one circular run. Owning the memory (rather than a tensor per download) makes the bound
    exact: however long a finished request keeps its views, no new memory is touched."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = align(max(capacity_bytes, 1))
        self._memory = torch.empty(self.capacity, dtype=torch.uint8)
        self._spans: deque = deque()  # (start, end) live, oldest first
        self.used_bytes = 0

    def allocate(self, n: int) -> tuple[int, int] | None:
        """A span of ``n`` bytes, or None until the oldest span is freed."""
        n = align(max(n, 1))
        if n > self.capacity:
            raise ValueError(f"{n} bytes do not fit a {self.capacity}-byte arena")
        if not self._spans:
            start = 0
        else:
            tail, head = self._spans[0][0], self._spans[-1][1]
            if head > tail:  # not wrapped: free space is [head, capacity) and [0, tail)
                start = head if head + n <= self.capacity else (0 if n <= tail else None)
            else:  # wrapped: the free space is [head, tail)
                start = head if head + n <= tail else None
            if start is None:
                return None
        span = (start, start + n)
        self._spans.append(span)
        self.used_bytes += n
        return span

    def view(self, span: tuple[int, int]) -> torch.Tensor:
        return self._memory[span[0]:span[1]]

    def free(self, span: tuple[int, int]) -> None:
        oldest = self._spans.popleft()
        assert oldest == span, "arena spans are freed in allocation order"
        self.used_bytes -= span[1] - span[0]
