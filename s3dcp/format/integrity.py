"""Item checksums: what the writer records per item and the reader verifies.

A checksum string names its algorithm (``"crc32c:1a2b3c4d"``), so a checkpoint says how to
check itself. Items larger than one block also get a checksum per block, so that a resharded
load that needs only part of an item can verify exactly the blocks it fetched. The whole-item
checksum is combined from the block checksums (CRCs combine without re-reading the data), so
blocks cost no second pass.
"""

from __future__ import annotations

from awscrt import checksums as _crt

from ..config import MiB

__all__ = ["BLOCK_SIZE_BYTES", "ItemChecksums", "ItemCheck", "compute", "checksum", "algorithm_of"]

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


class ItemCheck:
    """Checks bytes of one stored item against its checksums — the one implementation used by
    the reader (after each fetch) and by ``s3dcp verify`` (streaming).

    Feed the bytes in order from ``start`` (0, or a block boundary for a partial read), in
    pieces that end on block boundaries (or at the item's end): each piece that is a whole
    block is checked against that block's checksum, and when the feeding covered the whole item
    the combined CRC is checked against the whole-item checksum. ``location`` is an
    :class:`s3dcp.format.layout.ItemLocation` (anything with ``length``, ``checksum``, ``block_size``
    and ``block_checksums``).
    """

    def __init__(self, location, start: int = 0) -> None:
        self.location = location
        self.algorithm = algorithm_of(location.checksum)  # ValueError for an unknown one
        self._fn, self._combine, self._width = _ALGORITHMS[self.algorithm]
        self._start = self._pos = start
        self._crc: int | None = None
        self.bad_blocks: list[int] = []
        self.block_got: dict[int, str] = {}  # the checksum found for each bad block

    @property
    def piece_bytes(self) -> int:
        """How many bytes to feed at a time so pieces line up with the block checksums."""
        return self.location.block_size or BLOCK_SIZE_BYTES

    def feed(self, view: memoryview) -> None:
        loc = self.location
        crc = self._fn(view)
        if loc.block_size and self._pos % loc.block_size == 0:
            block = self._pos // loc.block_size
            whole_block = view.nbytes == min(loc.block_size, loc.length - self._pos)
            if whole_block and block < len(loc.block_checksums) and loc.block_checksums[block] != self._text(crc):
                self.bad_blocks.append(block)
                self.block_got[block] = self._text(crc)
        if self._start == 0:
            self._crc = crc if self._crc is None else self._combine(self._crc, crc, view.nbytes)
        self._pos += view.nbytes

    def feed_all(self, view: memoryview) -> "ItemCheck":
        """Feed ``view`` (bytes from ``start`` on) in block-aligned pieces."""
        step = self.piece_bytes
        for lo in range(0, view.nbytes, step):
            self.feed(view[lo:lo + step])
        if view.nbytes == 0:
            self.feed(view)
        return self

    @property
    def fed_bytes(self) -> int:
        """How many bytes of the item were fed (from ``start``)."""
        return self._pos - self._start

    @property
    def whole(self) -> bool:
        return self._start == 0 and self._pos == self.location.length

    @property
    def got(self) -> str:
        """The whole-item checksum of what was fed (meaningful when :attr:`whole`)."""
        return self._text(self._crc if self._crc is not None else self._fn(b""))

    @property
    def ok(self) -> bool:
        return not self.bad_blocks and (not self.whole or self.got == self.location.checksum)

    def _text(self, crc: int) -> str:
        return f"{self.algorithm}:{crc:0{self._width}x}"
