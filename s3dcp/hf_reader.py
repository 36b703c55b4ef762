"""S3SafetensorsReader: ``dcp.load`` from Hugging Face safetensors files in S3.

    LIST prefix ─► model.safetensors.index.json (if any) ─► which *.safetensors files hold what
    per file, in parallel: one ranged GET of the first 64 KiB (a second one if the header is longer)
        └─► header ─► Metadata: one TensorStorageMetadata per tensor, one chunk (the whole tensor)
    DCP's planner ─► ReadItems for this rank (the part of each tensor its shards cover)
    ReadItems ─► the smallest byte range of the file holding each part, neighbours coalesced
        ├─ contiguous part, CPU contiguous destination of the stored dtype: bytes land in the tensor
        └─ otherwise (a column block, another dtype, a GPU tensor): a bounce buffer, then copy_

Each rank reads only the bytes its shards need (plus the headers): a Shard(0) DTensor over two
ranks reads half of every sharded tensor per rank. safetensors files carry no checksums, so
what is verified is the format (dtype × shape = byte count, ranges inside the file) and that
every range arrives whole.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from . import layout
from .client import S3Client
from .config import S3Config
from .errors import CheckpointNotFoundError, ConfigError, MetadataFormatError
from .safetensors_format import INDEX_NAME, SUFFIX, Header, header_length, parse_header, parse_index
from .storage import S3CheckpointPath, UnreadableMetadata
from .tensors import byte_view

__all__ = ["S3SafetensorsReader", "SafetensorsLocation"]

log = logging.getLogger("s3dcp")

_FIRST_READ_BYTES = 64 * 1024  # most headers fit; a longer one costs a second GET
_MAX_RUN_BYTES = 1 << 30


@dataclass(frozen=True)
class SafetensorsLocation:
    """Where one tensor lives: a file (object name under the prefix) and its byte range."""

    file: str
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class S3SafetensorsReader(S3CheckpointPath, StorageReader):
    """Reads Hugging Face ``*.safetensors`` files under ``s3://bucket/prefix/`` for ``dcp.load``.

    Call order, as :func:`torch.distributed.checkpoint.load` makes it:

    0. ``reset(checkpoint_id)`` — only when ``checkpoint_id=`` is passed to load
    1. ``read_metadata()`` — lists the prefix, reads the index (``model.safetensors.index.json``,
       else every ``*.safetensors`` file under the prefix) and each file's header
    2. ``set_up_storage_reader`` / ``prepare_local_plan`` / ``prepare_global_plan`` — no-ops
    3. ``read_data(plan, planner)`` — ranged GETs for exactly the bytes this rank's ReadItems
       cover, straight into the destination tensors where dtype and layout allow, else through
       a bounce buffer and ``copy_`` (which converts dtype: load a bf16 file into fp32 state)

    Resharding is DCP's: the destination state may be plain tensors or DTensors of any
    placement. After ``read_data``, ``last_read_bytes`` is what this rank fetched for tensor
    data and ``last_header_bytes`` what ``read_metadata`` fetched for index and headers.

    Args:
        path: ``s3://bucket/prefix`` of the directory holding the files (trailing ``/`` optional).
        config: :class:`S3Config`; default: resolved from the environment.
        client: an :class:`s3dcp.client.S3Client` to use.
    """

    def __init__(self, path: str | None = None, *, config: S3Config | None = None,
                 client: S3Client | None = None) -> None:
        super().__init__()
        self._init_path(path, config, client)
        self._locations: dict[MetadataIndex, SafetensorsLocation] = {}
        self.last_read_bytes = 0
        self.last_read_s = 0.0
        self.last_header_bytes = 0

    def __repr__(self) -> str:
        return f"S3SafetensorsReader({self.checkpoint_id!r})"

    # ------------------------------------------------------------------ StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._reset_path(checkpoint_id)
        self._locations = {}

    def read_metadata(self) -> Metadata:
        """DCP's hook, on every rank. Never raises: a failure is raised, typed, by
        :meth:`set_up_storage_reader` (see :class:`s3dcp.storage.UnreadableMetadata`).
        :meth:`fetch_metadata` raises at once."""
        try:
            return self.fetch_metadata()
        except Exception as e:  # noqa: BLE001 - raised again in set_up_storage_reader
            return UnreadableMetadata(e)

    def fetch_metadata(self) -> Metadata:
        """DCP metadata built from the index and the files' headers, or a typed error."""
        headers = self.read_headers()
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, SafetensorsLocation] = {}
        for file, header in headers.items():
            for t in header.tensors:
                zeros = torch.Size([0] * len(t.shape))
                state[t.name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.shape),
                    chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(t.shape))])
                storage[MetadataIndex(t.name, zeros)] = SafetensorsLocation(file, t.start, t.end, t.dtype, t.shape)
        metadata = Metadata(state_dict_metadata=state, storage_data=storage)
        metadata.storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id, load_id=os.urandom(8).hex())
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata, UnreadableMetadata):
            raise metadata.error
        self._locations = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        start_s = time.perf_counter()
        uri = self._require_uri()
        by_file: dict[str, list[layout.Segment]] = {}
        reads = []
        for item in plan.items:
            read = self._plan_read(item, planner)
            reads.append(read)
            by_file.setdefault(read.location.file, []).append(layout.Segment(read.start, read.end - read.start, read))
        futures: list[Future] = []
        total = 0
        for file, segments in by_file.items():
            for run in layout.coalesce(segments, self.config.coalesce_gap_bytes, _MAX_RUN_BYTES):
                run_start, run_end = run[0].offset, max(s.end for s in run)
                total += run_end - run_start
                futures.append(self.client.get_scatter(uri.bucket, uri.key(file), run_start, run_end,
                                                       [(s.offset, s.tag.sink) for s in run]))
        wait(futures)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        for read in reads:
            read.finish(planner)
        self.last_read_bytes = total
        self.last_read_s = time.perf_counter() - start_s
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

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

    # ------------------------------------------------------------------ reads
    def _plan_read(self, item: ReadItem, planner: LoadPlanner) -> "_Read":
        if item.type != LoadItemType.TENSOR:
            raise MetadataFormatError(f"{self._uri}: {item.dest_index.fqn!r} is not a tensor; safetensors holds "
                                      "only tensors")
        try:
            loc = self._locations[item.storage_index]
        except KeyError:
            raise MetadataFormatError(f"{self._uri}: no tensor {item.storage_index.fqn!r} in the files") from None
        dest = planner.resolve_tensor(item).detach()
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if tuple(dest.shape) != lengths:
            raise MetadataFormatError(f"{self._uri}: {item.dest_index.fqn!r}: destination shape "
                                      f"{tuple(dest.shape)} does not match the planned {lengths}")
        lo, hi = layout.box_byte_range(loc.shape, loc.dtype.itemsize, offsets, lengths)
        direct = (layout.is_contiguous_box(loc.shape, offsets, lengths) and dest.device.type == "cpu"
                  and dest.is_contiguous() and dest.dtype == loc.dtype)
        if direct:
            return _Read(item, loc, loc.start + lo, loc.start + hi, byte_view(dest), dest, None)
        bounce = torch.empty(hi - lo, dtype=torch.uint8)
        return _Read(item, loc, loc.start + lo, loc.start + hi, byte_view(bounce), dest, bounce)


@dataclass
class _Read:
    """One ReadItem: the file bytes ``[start, end)`` it needs and where they land."""

    item: ReadItem
    location: SafetensorsLocation
    start: int
    end: int
    sink: memoryview
    dest: torch.Tensor
    bounce: torch.Tensor | None

    def finish(self, planner: LoadPlanner) -> None:
        if self.bounce is not None:
            loc = self.location
            strides = [1] * len(loc.shape)
            for i in range(len(loc.shape) - 2, -1, -1):
                strides[i] = strides[i + 1] * loc.shape[i + 1]
            # the bounce buffer starts at the box's first element: walk the box with the file's strides
            flat = self.bounce.view(loc.dtype) if self.bounce.numel() else torch.empty(0, dtype=loc.dtype)
            src = flat.as_strided(tuple(self.item.lengths), strides, 0)
            self.dest.copy_(src)
        planner.commit_tensor(self.item, self.dest)
