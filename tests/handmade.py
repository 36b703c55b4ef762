"""Checkpoints written by hand: metadata a save would never write (chunks that overlap, a chunk
without a location, another dtype stored), with real objects and real checksums behind it, so only
the check under test stands between it and a load, ``verify`` or an export."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from s3dcp.format import integrity
from s3dcp.format.layout import METADATA_NAME, ItemLocation
from s3dcp.format.metadata import dtype_to_str, encode_metadata
from s3dcp.s3.client import S3Client

__all__ = ["OBJECT", "tensor_meta", "put_checkpoint", "put_metadata"]

OBJECT = "__0_0.0123456789ab.distcp"


def tensor_meta(dtype: torch.dtype, size, boxes) -> TensorStorageMetadata:
    """A tensor of ``size`` whose chunks are ``boxes`` ([(offsets, sizes)])."""
    return TensorStorageMetadata(TensorProperties(dtype), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes])


def put_checkpoint(uri: str, cfg, sdm: dict, items: list, *, storage: bool = True, version: int = 2) -> None:
    """Write ``items`` ([(fqn, offsets, values: a tensor)]) back to back into one data object with
    their CRC64NVME checksums, and the metadata of ``sdm`` locating them (``storage=False``:
    ``storage_data`` null), at ``uri``."""
    client = S3Client(cfg)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    body, locations = bytearray(), {}
    for fqn, offsets, values in items:
        raw = values.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        sums = integrity.compute("crc64nvme", memoryview(raw))
        locations[MetadataIndex(fqn, torch.Size(offsets))] = ItemLocation(
            OBJECT, len(body), len(raw), sums.whole, dtype_to_str(values.dtype), tuple(values.shape))
        body += raw
    client.put(bucket, f"{prefix}/{OBJECT}", bytes(body)).result()
    md = Metadata(sdm, storage_data=locations if storage else None)
    client.put(bucket, f"{prefix}/{METADATA_NAME}", encode_metadata(md, version=version)).result()


def put_metadata(uri: str, cfg, md: Metadata, objects: dict[str, bytes]) -> None:
    """``objects`` (name -> body) and ``md``'s metadata at ``uri``, as they are."""
    client = S3Client(cfg)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    for name, body in objects.items():
        client.put(bucket, f"{prefix}/{name}", body).result()
    client.put(bucket, f"{prefix}/{METADATA_NAME}", encode_metadata(md)).result()
