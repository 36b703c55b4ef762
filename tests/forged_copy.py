"""A node's copy forged as a local user with s3dcp in hand would make it: another state's bytes in
its objects, its own ``.metadata``'s checksums made to match, so the copy is consistent in itself
(only a check against S3's metadata catches it). Used by tests/lifecycle/test_tier_local.py and
tests/cli/test_local_copies.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from s3dcp.format import integrity
from s3dcp.format.metadata import decode_metadata, encode_metadata


def forge(copy: Path, fqn: str, values: torch.Tensor) -> None:
    """``values`` (the stored item's dtype and size) in place of item ``fqn`` of the copy in
    ``copy`` (a rank directory), and its checksums in the copy's ``.metadata`` to match."""
    path = copy / ".metadata"
    metadata = decode_metadata(path.read_bytes())
    metadata.storage_data = dict(metadata.storage_data.items())
    raw = memoryview(values.numpy().tobytes())
    for index, loc in list(metadata.storage_data.items()):
        if index.fqn == fqn:
            data = bytearray((copy / loc.object_name).read_bytes())
            data[loc.offset:loc.offset + loc.length] = raw
            (copy / loc.object_name).write_bytes(bytes(data))
            sums = integrity.compute(integrity.algorithm_of(loc.checksum), raw)
            metadata.storage_data[index] = dataclasses.replace(loc, checksum=sums.whole,
                                                               block_checksums=tuple(sums.blocks))
    path.write_bytes(encode_metadata(metadata))
