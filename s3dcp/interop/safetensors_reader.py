"""S3SafetensorsReader: ``dcp.load`` from Hugging Face safetensors files in S3.

    LIST prefix ─► model.safetensors.index.json (if any; else the *.safetensors files, which must
    be one whole set: every -0000K-of-0000N present) ─► which files hold what
    per file, in parallel: one ranged GET of the first 64 KiB (a second one if the header is longer)
        └─► header ─► Metadata: one TensorStorageMetadata per tensor, one chunk (the whole tensor),
                      stored as an ItemLocation (file, byte range, dtype, shape; no checksum)
    DCP's planner ─► ReadItems for this rank (the part of each tensor its shards cover)
    ReadItems ─► S3StorageReader's read path (reader.py), as for an unverified DCP item:
        ├─ one run of a tensor's bytes (whole, or rows of a Shard(0) load), CPU contiguous
        │  destination of the stored dtype: the bytes land in the tensor
        └─ otherwise (a column block, another dtype, a GPU tensor): only the box's byte ranges
           (layout.box_pieces), through the bounded bounce window (bounce.py), then copy_

Each rank reads only the bytes its shards need (plus the headers): a Shard(0) DTensor over two
ranks reads half of every sharded tensor per rank, a Shard(1) one about half too (holes up to
``coalesce_gap_bytes`` are bridged). safetensors files carry no checksums, so what is verified
is the format (dtype × shape = byte count, ranges inside the file) and that every range
arrives whole.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..config import S3Config
from ..errors import CheckpointNotFoundError, ConfigError, MetadataFormatError
from ..format.layout import ItemLocation
from ..format.metadata import dtype_to_str
from ..format.safetensors import (INDEX_NAME, MAX_INDEX_BYTES, SUFFIX, Header, check_shard_set, header_length,
                                  parse_header, parse_index)
from ..loading.reader import S3StorageReader
from ..memory.pool import HostBufferPool
from ..s3.client import S3Client

__all__ = ["S3SafetensorsReader"]

_FIRST_READ_BYTES = 64 * 1024  # most headers fit; a longer one costs a second GET


class S3SafetensorsReader(S3StorageReader):
    """Reads Hugging Face ``*.safetensors`` files under ``s3://bucket/prefix/`` for ``dcp.load``.

    Call order, as :func:`torch.distributed.checkpoint.load` makes it:

    0. ``reset(checkpoint_id)`` — only when ``checkpoint_id=`` is passed to load
    1. ``read_metadata()`` — lists the prefix, reads the index (``model.safetensors.index.json``,
       else every ``*.safetensors`` file under the prefix, which must be a whole set of
       ``-0000K-of-0000N`` shards or unnumbered files) and each file's header
    2. ``set_up_storage_reader`` / ``prepare_local_plan`` / ``prepare_global_plan`` — no-ops
    3. ``read_data(plan, planner)`` — :class:`S3StorageReader`'s: ranged GETs for exactly the
       bytes this rank's ReadItems cover, straight into the destination tensors where dtype and
       layout allow, else through a bounded bounce window and ``copy_`` (which converts dtype:
       load a bf16 file into fp32 state)

    Resharding is DCP's: the destination state may be plain tensors or DTensors of any
    placement. After ``read_data``, ``last_read_bytes`` is what this rank fetched for tensor
    data and ``last_header_bytes`` what ``read_metadata`` fetched for index and headers.

    Args:
        path: ``s3://bucket/prefix`` of the directory holding the files (trailing ``/`` optional).
        config: :class:`S3Config`; default: resolved from the environment.
        client: an :class:`s3dcp.s3.client.S3Client` to use.
        pool: where the bounce window comes from (see :class:`S3StorageReader`).
    """

    def __init__(self, path: str | None = None, *, config: S3Config | None = None,
                 client: S3Client | None = None, pool: HostBufferPool | None = None) -> None:
        # safetensors files hold no checksums: nothing to verify, and no pickled items to refuse
        super().__init__(path, config=config, client=client, verify=False, pool=pool)
        self.last_header_bytes = 0

    def __repr__(self) -> str:
        return f"S3SafetensorsReader({self.checkpoint_id!r})"

    def fetch_metadata(self) -> Metadata:
        """DCP metadata built from the index and the files' headers, or a typed error
        (:meth:`read_metadata`, inherited, returns the error for DCP to raise on every rank)."""
        headers = self.read_headers()
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, ItemLocation] = {}
        for file, header in headers.items():
            for t in header.tensors:
                zeros = torch.Size([0] * len(t.shape))
                state[t.name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.shape),
                    chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(t.shape))])
                storage[MetadataIndex(t.name, zeros)] = ItemLocation(
                    object_name=file, offset=t.start, length=t.nbytes, checksum=None,
                    dtype=dtype_to_str(t.dtype), shape=tuple(t.shape))
        metadata = Metadata(state_dict_metadata=state, storage_data=storage)
        metadata.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id, load_id=os.urandom(8).hex())
        return metadata

    def _require_uri(self):
        if self._uri is None:
            raise ConfigError("S3SafetensorsReader has no path: pass 's3://bucket/prefix' to it or checkpoint_id= "
                              "to dcp.load")
        return self._uri

    # ------------------------------------------------------------------ headers
    def read_headers(self) -> dict[str, Header]:
        """Every safetensors file under the prefix (or named by the index) and its header."""
        uri = self._require_uri()
        objects, _ = self.client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
        sizes = {o.key[len(uri.dir_prefix):]: o.size for o in objects}
        self.last_header_bytes = 0
        if INDEX_NAME in sizes:
            if sizes[INDEX_NAME] > MAX_INDEX_BYTES:  # before reading it into memory
                raise MetadataFormatError(f"{uri.child(INDEX_NAME)} is {sizes[INDEX_NAME]} bytes, more than a "
                                          f"safetensors index holds ({MAX_INDEX_BYTES})")
            raw = self.client.get(uri.bucket, uri.key(INDEX_NAME)).result()
            self.last_header_bytes += len(raw)
            weight_map = parse_index(raw, source=str(uri.child(INDEX_NAME)))
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if f not in sizes]
            if missing:
                raise MetadataFormatError(f"{uri.child(INDEX_NAME)} names {missing} but no such object is under {uri}")
        else:
            weight_map = None
            files = sorted(name for name in sizes if name.endswith(SUFFIX))
            check_shard_set(files, where=f"{uri}/")
        if not files:
            raise CheckpointNotFoundError(f"no {INDEX_NAME} and no *{SUFFIX} files under {uri}/")

        firsts = {}
        for f in files:
            buf = bytearray(min(sizes[f], _FIRST_READ_BYTES))
            firsts[f] = (buf, self.client.get_range_into(uri.bucket, uri.key(f), 0, buf))
        headers: dict[str, Header] = {}
        for f, (buf, fut) in firsts.items():
            fut.result()
            source = str(uri.child(f))
            need = 8 + header_length(buf, source=source)
            if need > len(buf):
                if need > sizes[f]:
                    raise MetadataFormatError(f"{source}: header of {need} bytes is longer than the file")
                rest = bytearray(need - len(buf))
                self.client.get_range_into(uri.bucket, uri.key(f), len(buf), rest).result()
                buf += rest
            self.last_header_bytes += len(buf)
            headers[f] = parse_header(buf, source=source, file_size=sizes[f])

        seen: dict[str, str] = {}
        for f, header in headers.items():
            for t in header.tensors:
                if t.name in seen:
                    raise MetadataFormatError(f"tensor {t.name!r} is in both {seen[t.name]} and {f} under {uri}")
                seen[t.name] = f
                if weight_map is not None and weight_map.get(t.name, f) != f:
                    raise MetadataFormatError(f"{INDEX_NAME} under {uri} puts {t.name!r} in {weight_map[t.name]}, "
                                              f"but it is in {f}")
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(seen))
            if absent:
                raise MetadataFormatError(f"{INDEX_NAME} under {uri} names {len(absent)} tensor(s) no file holds, "
                                          f"e.g. {absent[:3]}")
        return headers
