"""Item checksums: what the writer records per item and the reader verifies.

A checksum string names its algorithm (``"crc32c:1a2b3c4d"``), so a checkpoint says how to
check itself. Items larger than one block also get a checksum per block, so that a resharded
load that needs only part of an item can verify exactly the blocks it fetched. The whole-item
checksum is combined from the block checksums (CRCs combine without re-reading the data), so
blocks cost no second pass.
"""

from __future__ import annotations

from awscrt import checksums as _crt

from .config import MiB

__all__ = ["BLOCK_SIZE_BYTES", "ItemChecksums", "compute", "checksum", "algorithm_of"]

BLOCK_SIZE_BYTES = 16 * MiB

_ALGORITHMS = {
    "crc32c": (_crt.crc32c, _crt.combine_crc32c, 8),
    "crc64nvme": (_crt.crc64nvme, _crt.combine_crc64nvme, 16),
}


class ItemChecksums(tuple):
    """(whole-item checksum, per-block checksums) — a plain tuple with names."""

    __slots__ = ()

    def __new__(cls, whole: str | None, blocks: tuple[str, ...]):
        return super().__new__(cls, (whole, blocks))

    @property
    def whole(self) -> str | None:
        return self[0]

    @property
    def blocks(self) -> tuple[str, ...]:
        return self[1]


def compute(algorithm: str | None, view: memoryview, block_size: int = BLOCK_SIZE_BYTES) -> ItemChecksums:
    """Checksums of ``view``: the whole item, and one per block when it spans several."""
    if algorithm is None:
        return ItemChecksums(None, ())
    fn, combine, width = _ALGORITHMS[algorithm]
    n = view.nbytes
    if n <= block_size:
        return ItemChecksums(f"{algorithm}:{fn(view):0{width}x}", ())
    whole = None
    blocks = []
    for start in range(0, n, block_size):
        block = view[start:start + block_size]
        crc = fn(block)
        blocks.append(f"{algorithm}:{crc:0{width}x}")
        whole = crc if whole is None else combine(whole, crc, block.nbytes)
    return ItemChecksums(f"{algorithm}:{whole:0{width}x}", tuple(blocks))


def checksum(algorithm: str, view: memoryview) -> str:
    """One checksum of ``view`` in the ``"algorithm:hex"`` form."""
    fn, _, width = _ALGORITHMS[algorithm]
    return f"{algorithm}:{fn(view):0{width}x}"


def algorithm_of(value: str) -> str:
    """The algorithm named by a stored checksum; an unknown one is an error, not a skip."""
    name = value.split(":", 1)[0]
    if name not in _ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {name!r} in {value!r}")
    return name
