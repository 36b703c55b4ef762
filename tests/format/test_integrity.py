"""integrity.ItemCheck: the one item verifier the reader and `s3dcp verify` share (pure)."""

import os

import pytest

from s3dcp.format import integrity
from s3dcp.format.layout import ItemLocation


def _location(data: bytes, block: int, algorithm: str = "crc32c") -> ItemLocation:
    sums = integrity.compute(algorithm, memoryview(data), block_size=block)
    return ItemLocation("o", 0, len(data), sums.whole, block_size=block if sums.blocks else 0,
                        block_checksums=sums.blocks)


@pytest.mark.parametrize("algorithm", ["crc32c", "crc64nvme"])
@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 350])
def test_whole_item_passes_and_any_flipped_byte_fails(algorithm, size):
    data = bytearray(os.urandom(size))
    loc = _location(bytes(data), 100, algorithm)
    assert integrity.ItemCheck(loc).feed_all(memoryview(data)).ok
    for i in range(0, size, 37):
        data[i] ^= 0x01
        check = integrity.ItemCheck(loc).feed_all(memoryview(data))
        assert not check.ok
        if loc.block_size:
            assert check.bad_blocks == [i // 100]
        data[i] ^= 0x01


def test_a_partial_read_checks_only_the_blocks_it_fetched():
    data = bytearray(os.urandom(350))
    loc = _location(bytes(data), 100)
    data[10] ^= 0xFF  # in block 0, not fetched below
    fetched = memoryview(data)[100:300]  # blocks 1 and 2
    assert integrity.ItemCheck(loc, 100).feed_all(fetched).ok
    data[250] ^= 0xFF
    check = integrity.ItemCheck(loc, 100).feed_all(memoryview(data)[100:300])
    assert not check.ok and check.bad_blocks == [2] and check.block_got[2] != loc.block_checksums[2]


def test_streaming_pieces_equal_one_pass():
    data = os.urandom(1000)
    loc = _location(data, 128)
    check = integrity.ItemCheck(loc)
    for lo in range(0, 1000, check.piece_bytes):
        check.feed(memoryview(data)[lo:lo + check.piece_bytes])
    assert check.whole and check.ok and check.got == loc.checksum


def test_unknown_algorithm_is_an_error_not_a_skip():
    with pytest.raises(ValueError, match="md5"):
        integrity.ItemCheck(ItemLocation("o", 0, 1, "md5:00"))
