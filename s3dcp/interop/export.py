"""Export an s3dcp checkpoint as Hugging Face–style sharded safetensors (``s3dcp export``).

    .metadata ──► tensors picked (--only / --strip-prefix), grouped into shard files of ≤ shard_size
    per shard file:
      safetensors.torch.save_file over zero-page placeholders ──► the file: the library's header,
                                                                   zeros where the data goes
      per tensor, a few in flight (window): ranged GETs of its chunks ──► its span of the ring
          buffer (the chunks of a resharded save are put together) ──► checksum of every chunk
          verified ──► os.pwrite at the tensor's offset in the file ──► span freed
      s3:// destination: the finished file is uploaded (multipart, from a read-only mmap) and deleted
    model.safetensors.index.json written last
    any failure: the shard files already written are removed (local and s3://), so what is left
    never looks like a model; if they cannot be, the error names them

Memory: the placeholders are one private anonymous mapping that is only ever read, so its
pages are the kernel's shared zero page and cost no RAM. Tensors download into one ring buffer
the export owns, of ``max(window_bytes, largest tensor)`` bytes (a tensor saved column-sharded
also needs room for its chunks: twice its size), so the export holds at most that much tensor
data, whatever the model's size; the CRT adds its part buffers for the GETs in flight (up to
about as much again: a 768 MiB model exported with a 64 MiB window grew the process by 131 MiB).
For an ``s3://`` destination each shard file is spooled to a local temporary file and uploaded
from a read-only memory map of it (page cache, reclaimable). The header comes from the ``safetensors`` package
(no hand-written format), at the cost of writing each shard file's bytes twice into the page
cache (zeros, then data).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from .._partial_file import PartialFile
from ..config import S3Config
from ..errors import CheckpointExistsError, ConfigError, IncompleteCheckpointError, IntegrityError, MetadataFormatError
from ..format import integrity, layout
from ..format.context import At, quoted
from ..format.safetensors import INDEX_NAME, RESERVED_NAME, SUFFIX, index_document, parse_header, safetensors_dtype, shard_file_name
from ..format.tensors import byte_view
from ..loading.sizes import check_declared_sizes
from ..memory.ring_buffer import RingArena
from ..memory.ring_buffer import align as _align
from ..s3.client import S3Client
from ..uri import S3Uri, is_s3_uri, object_key, parse_s3_uri
from .export_defaults import DEFAULT_SHARD_SIZE_BYTES, DEFAULT_WINDOW_BYTES

__all__ = ["export_safetensors", "ExportReport", "DEFAULT_SHARD_SIZE_BYTES", "DEFAULT_WINDOW_BYTES"]

log = logging.getLogger("s3dcp")


@dataclass
class ExportReport:
    """What an export wrote. ``peak_buffered_bytes`` is the most tensor bytes held at once."""

    source: str
    dest: str
    files: list[dict[str, Any]] = field(default_factory=list)  # {"name", "bytes", "tensors"}
    tensors: int = 0
    tensor_bytes: int = 0
    verified_chunks: int = 0
    unverified_chunks: int = 0  # chunks saved without a checksum (checksum=None)
    skipped: list[str] = field(default_factory=list)  # checkpoint items left out (filters, non-tensors)
    peak_buffered_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Tensor:
    fqn: str  # in the checkpoint
    name: str  # in the safetensors files
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], layout.ItemLocation], ...]  # (offsets, sizes, where)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def export_safetensors(
    source: str,
    dest: str,
    *,
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
    only: Sequence[str] = (),
    strip_prefix: str | None = None,
    config: S3Config | None = None,
    client: S3Client | None = None,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    overwrite: bool = False,
    temp_dir: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ExportReport:
    """Write the tensors of checkpoint ``source`` (``s3://…``) as sharded safetensors in ``dest``
    (a local directory, created if needed, or an ``s3://bucket/prefix``).

    ``only``: keep tensors whose checkpoint name starts with one of these prefixes (default: all).
    ``strip_prefix``: remove it from the names written (``model.`` → Hugging Face names).
    Non-tensor items are left out (listed in ``ExportReport.skipped``). Every chunk's checksum
    is verified; a mismatch raises :class:`IntegrityError`. A failed export removes the shard
    files it wrote (the index is written last, so none was); when that fails too it raises
    :class:`IncompleteCheckpointError` naming what is left. ``overwrite``: replace an earlier
    export at ``dest`` (its index and safetensors files are deleted first, the index first);
    without it an earlier export is refused (:class:`CheckpointExistsError`).
    ``window_bytes``: tensor bytes downloading ahead of the writer (the ring buffer's size; a
    larger tensor gets a buffer of its own size). ``on_progress(done_bytes, total_bytes)`` is
    called after each tensor is written.
    """
    _require_safetensors()  # before anything is created at dest
    from ..loading.reader import S3StorageReader

    if shard_size_bytes <= 0 or window_bytes <= 0:
        raise ConfigError(f"shard_size_bytes={shard_size_bytes} and window_bytes={window_bytes} must be positive")
    start_s = time.perf_counter()
    src = parse_s3_uri(source)
    client = client or S3Client(config)
    reader = S3StorageReader(str(src), client=client)
    md = reader.fetch_metadata()
    report = ExportReport(source=str(src), dest=dest)
    tensors = _select(md, src, only, strip_prefix, report)
    if not tensors:
        raise ConfigError(f"nothing to export from {src}: no tensor matches --only {list(only)}"
                          if only else f"nothing to export: {src} holds no tensors")
    # chunks tile each tensor, lie in their objects: before a buffer or file is made at the declared sizes
    check_declared_sizes(client, src, md, [t.fqn for t in tensors])

    groups = layout.pack([t.nbytes for t in tensors], shard_size_bytes)
    names = [shard_file_name(i + 1, len(groups)) for i in range(len(groups))]
    target = _Destination(dest, client, overwrite, temp_dir)
    weight_map: dict[str, str] = {}
    total = sum(t.nbytes for t in tensors)
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        if on_progress is not None:
            on_progress(done[0], total)

    # Tensors download into one ring buffer: at most max(window, the largest tensor) bytes.
    arena = RingArena(max(window_bytes, max(_footprint(t) for t in tensors)))
    try:
        target.clear_previous()
        for name, group in zip(names, groups):
            shard = [tensors[i] for i in group]
            partial = target.begin_file(name)
            _write_shard(partial, shard, src, client, arena, report, progress)
            size = os.fstat(partial.fd).st_size
            target.finish_file(name, partial)
            report.files.append({"name": name, "bytes": size, "tensors": len(shard)})
            weight_map.update({t.name: name for t in shard})
        report.tensors = len(tensors)
        report.tensor_bytes = total
        doc = json.dumps(index_document(weight_map, report.tensor_bytes), indent=2).encode() + b"\n"
        target.write_small(INDEX_NAME, doc)  # last: an export without its index is incomplete
    except BaseException as e:
        target.discard(e)  # the shard files written so far: a failed export leaves none
        raise
    finally:
        target.close()
    report.seconds = time.perf_counter() - start_s
    return report


def _require_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401 - the export writes its headers with it
    except ImportError as e:
        raise ConfigError("exporting to safetensors needs the safetensors package: "
                          "pip install 's3dcp[safetensors]'") from e


# ---------------------------------------------------------------------- selection
def _select(md, src: S3Uri, only: Sequence[str], strip_prefix: str | None, report: ExportReport) -> list[_Tensor]:
    out: list[_Tensor] = []
    names: dict[str, str] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if only and not any(fqn.startswith(p) for p in only):
            report.skipped.append(fqn)
            continue
        if not isinstance(meta, TensorStorageMetadata):
            report.skipped.append(fqn)
            continue
        name = fqn[len(strip_prefix):] if strip_prefix and fqn.startswith(strip_prefix) else fqn
        if not name:
            raise ConfigError(f"--strip-prefix {strip_prefix!r} leaves tensor {fqn!r} without a name")
        if name in names:
            raise ConfigError(f"tensors {names[name]!r} and {fqn!r} would both be named {name!r} in the export")
        if name == RESERVED_NAME:  # the safetensors header's own metadata: no tensor can have the name
            raise ConfigError(f"{src}: tensor {fqn!r} would be named {name!r} in the export, the key safetensors "
                              "reserves for the header's metadata; leave it out (--only) or rename it (--strip-prefix)")
        names[name] = fqn
        safetensors_dtype(meta.properties.dtype, what=f"{src}: tensor {fqn!r}")
        chunks = []
        for chunk in meta.chunks:
            index = MetadataIndex(fqn, chunk.offsets)
            loc = md.storage_data.get(index)
            if loc is None:
                raise MetadataFormatError(f"{src}: the metadata has no stored location for {fqn!r} "
                                          f"chunk at {tuple(chunk.offsets)}")
            layout.check_location(loc, meta.properties.dtype.itemsize,
                                  At(src, ": item ", quoted(fqn), " (chunk at ", tuple(chunk.offsets), ")"))
            chunks.append((tuple(chunk.offsets), tuple(chunk.sizes), loc))
        out.append(_Tensor(fqn, name, meta.properties.dtype, tuple(meta.size), tuple(chunks)))
    return out


# ---------------------------------------------------------------------- one shard file
def _write_shard(partial: PartialFile, shard: list[_Tensor], src: S3Uri, client: S3Client, arena: "RingArena",
                 report: ExportReport, on_progress) -> None:
    from safetensors.torch import save_file

    total = sum(_align(t.nbytes) for t in shard)
    # Placeholders: slices of one private anonymous mapping that nobody writes, so every page
    # read is the zero page. save_file writes the header it makes and zeros for the data.
    zeros = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        base = torch.frombuffer(zeros, dtype=torch.uint8)
        placeholders, at = {}, 0
        for t in shard:
            if t.nbytes == 0:
                placeholders[t.name] = torch.empty(t.shape, dtype=t.dtype)
                continue
            placeholders[t.name] = base[at:at + t.nbytes].view(t.dtype).view(t.shape)
            at += _align(t.nbytes)  # every placeholder starts aligned for its dtype
        save_file(placeholders, partial.path, metadata={"format": "pt"})
        del placeholders, base
    finally:
        zeros.close()
    partial.reopen()  # save_file renames a file of its own onto the path: the data goes into that one

    with open(partial.fd, "r+b", closefd=False) as f:
        first = f.read(8)
        header_len = int.from_bytes(first, "little")
        header = parse_header(first + f.read(header_len), source=partial.path, file_size=os.fstat(f.fileno()).st_size)
        where = {e.name: e for e in header.tensors}
        ordered = sorted(shard, key=lambda t: where[t.name].start)  # file order: sequential writes
        pending: deque = deque()  # (tensor, its arena span, its GETs) in file order

        def drain_one() -> None:
            t, span, jobs = pending.popleft()
            buf = arena.view(span)[:t.nbytes]
            _finish_tensor(t, buf, jobs, src, report)
            view = byte_view(buf)
            entry = where[t.name]
            written = 0
            while written < view.nbytes:
                written += os.pwrite(f.fileno(), view[written:], entry.start + written)
            arena.free(span)
            on_progress(t.nbytes)

        for t in ordered:
            while (span := arena.allocate(_footprint(t))) is None:
                drain_one()
            pending.append((t, span, _start_tensor(t, arena.view(span), src, client)))
            report.peak_buffered_bytes = max(report.peak_buffered_bytes, arena.used_bytes)
        while pending:
            drain_one()
        f.flush()
        os.fsync(f.fileno())


def _footprint(t: "_Tensor") -> int:
    """Arena bytes a tensor needs: itself, plus a bounce buffer per chunk that is not one run of
    its bytes (a column-sharded save)."""
    bounce = sum(loc.length for offsets, sizes, loc in t.chunks if not layout.is_contiguous_box(t.shape, offsets, sizes))
    return _align(t.nbytes) + _align(bounce)


def _start_tensor(t: _Tensor, span: torch.Tensor, src: S3Uri, client: S3Client) -> list:
    """Start the GETs of every chunk of ``t`` into its arena ``span``: straight to the chunk's
    place in the tensor's bytes where the chunk is one run of them (a whole tensor, rows of a
    Shard(0) save), else into a bounce area after the tensor (copied into place when done)."""
    jobs = []
    itemsize = t.dtype.itemsize
    bounce_at = _align(t.nbytes)
    for offsets, sizes, loc in t.chunks:
        if layout.is_contiguous_box(t.shape, offsets, sizes):
            lo, hi = layout.box_byte_range(t.shape, itemsize, offsets, sizes)
            bounce = None
            sink = byte_view(span)[lo:hi] if hi > lo else memoryview(bytearray(0))
        else:
            bounce = span[bounce_at:bounce_at + loc.length]
            bounce_at += loc.length
            sink = byte_view(bounce)
        fut: Future = client.get_range_into(src.bucket, object_key(src, loc.object_name), loc.offset, sink)
        jobs.append((offsets, sizes, loc, sink, bounce, fut))
    return jobs


def _finish_tensor(t: _Tensor, buf: torch.Tensor, jobs: list, src: S3Uri, report: ExportReport) -> None:
    for offsets, sizes, loc, sink, bounce, fut in jobs:
        fut.result()
        if loc.checksum is None:
            report.unverified_chunks += 1
        else:
            got = integrity.checksum(integrity.algorithm_of(loc.checksum), sink)
            if got != loc.checksum:
                raise IntegrityError(
                    f"checksum mismatch in s3://{src.bucket}/{object_key(src, loc.object_name)} "
                    f"for item {t.fqn!r} (chunk at {offsets}, "
                    f"object bytes {loc.offset}-{loc.offset + loc.length}): expected {loc.checksum}, got {got}. "
                    "The object was corrupted or overwritten; export another checkpoint")
            report.verified_chunks += 1
        if bounce is not None:  # a chunk that is not one run of the tensor: copy it into place
            full = buf.view(t.dtype).view(t.shape)
            box = full
            for dim, (o, n) in enumerate(zip(offsets, sizes)):
                box = box.narrow(dim, o, n)
            box.copy_(bounce.view(t.dtype).view(sizes))


# ---------------------------------------------------------------------- destinations
class _Destination:
    """A local directory, or an S3 prefix with a local spool directory for the shard files.

    Call order: ``clear_previous()`` (refuses, or with ``overwrite`` removes, an earlier
    export: its index first), then per file ``begin_file`` → ``finish_file``, then
    ``write_small(INDEX_NAME, ...)``; on any failure ``discard(error)``; always ``close()``.
    Every finished file is recorded, so a failed export removes what it wrote and nothing
    partial that a reader could mistake for a model stays behind."""

    def __init__(self, dest: str, client: S3Client, overwrite: bool, temp_dir: str | None) -> None:
        self.client, self.overwrite = client, overwrite
        self._partials: dict[str, PartialFile] = {}  # by path: files begun, not finished
        self._written: list[str] = []  # names finished (or, for the index on S3, attempted) at dest
        if is_s3_uri(dest):
            self.uri: S3Uri | None = parse_s3_uri(dest)
            self.where = str(self.uri)
            self.dir = tempfile.mkdtemp(prefix="s3dcp-export-", dir=temp_dir)
        else:
            self.uri = None
            self.dir = os.path.abspath(dest)
            self.where = self.dir
            if os.path.exists(self.dir) and not os.path.isdir(self.dir):
                raise ConfigError(f"export destination {dest} exists and is not a directory")
            os.makedirs(self.dir, exist_ok=True)

    def clear_previous(self) -> None:
        """Refuse to replace an earlier export unless ``overwrite``; with it, delete the earlier
        export's index, then its safetensors files, before anything is written, so an export
        that fails midway never sits next to an index that makes it look complete."""
        if self.uri is not None:
            objects, _ = self.client.list(self.uri.bucket, self.uri.dir_prefix, delimiter="/").result()
            present = {o.key[len(self.uri.dir_prefix):] for o in objects}
        else:
            present = set(os.listdir(self.dir))
        clash = sorted((n for n in present if n == INDEX_NAME or n.endswith(SUFFIX)),
                       key=lambda n: (n != INDEX_NAME, n))  # the index first
        if not clash:
            return
        if not self.overwrite:
            raise CheckpointExistsError(f"{self.where} already holds safetensors files ({', '.join(clash[:3])}"
                                        f"{', ...' if len(clash) > 3 else ''}); pass overwrite=True to replace them")
        log.info("export: removing the earlier export at %s (%d file(s))", self.where, len(clash))
        if self.uri is not None:
            if INDEX_NAME in clash:
                self.client.delete(self.uri.bucket, [self.uri.key(INDEX_NAME)]).result()
            self.client.delete(self.uri.bucket, [self.uri.key(n) for n in clash if n != INDEX_NAME]).result()
        else:
            for name in clash:
                os.unlink(os.path.join(self.dir, name))

    def begin_file(self, name: str) -> PartialFile:
        """File ``name``, begun: made exclusively under a fresh name (never a fixed one that
        someone who may write the directory could have prepared)."""
        partial = PartialFile(os.path.join(self.dir, name))
        self._partials[partial.path] = partial
        return partial

    def finish_file(self, name: str, partial: PartialFile) -> None:
        if self.uri is None:
            # the file gets the mode of any file the user creates (0644 under umask 022)
            partial.finish()
            self._written.append(name)
        else:
            data = mmap.mmap(partial.fd, 0, access=mmap.ACCESS_READ)  # page cache, not process memory
            self._written.append(name)  # a PUT that failed may still have landed: removed on failure too
            self.client.put(self.uri.bucket, self.uri.key(name), memoryview(data)).result()
            # The mapping is unmapped when the last view of it (the request's stream may keep one) is gone.
            del data
            partial.discard()
        del self._partials[partial.path]  # on failure, close() discards it

    def write_small(self, name: str, data: bytes) -> None:
        if self.uri is None:
            partial = self.begin_file(name)
            with open(partial.fd, "wb", closefd=False) as f:
                f.write(data)
            self.finish_file(name, partial)
        else:
            self._written.append(name)
            self.client.put(self.uri.bucket, self.uri.key(name), data, single_request=True,
                            content_type="application/json").result()

    def discard(self, error: BaseException) -> None:
        """The export failed with ``error``: remove the files it wrote to the destination. When
        that fails too, raise :class:`IncompleteCheckpointError` (caused by ``error``) naming
        what is left, so nobody loads it as a model."""
        if not self._written:
            return
        left: list[str] = []
        why = ""
        if self.uri is not None:
            keys = [self.uri.key(n) for n in self._written]
            try:
                self.client.delete(self.uri.bucket, keys).result()
            except Exception as e:  # noqa: BLE001 - reported below, with the export's own error
                left, why = [f"s3://{self.uri.bucket}/{k}" for k in keys], f"{type(e).__name__}: {e}"
        else:
            for name in self._written:
                try:
                    os.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    left.append(os.path.join(self.dir, name))
                    why = f"{type(e).__name__}: {e}"
        self._written = []
        if left:
            raise IncompleteCheckpointError(
                f"export to {self.where} failed ({type(error).__name__}: {error}) and the {len(left)} file(s) it "
                f"had written could not be removed ({why}): {', '.join(left)}. They are an incomplete model "
                "(no index); delete them, or export again replacing them (overwrite=True; s3dcp export --force)") from error

    def close(self) -> None:
        for partial in self._partials.values():  # only what this export started and did not finish
            partial.discard()
        self._partials = {}
        if self.uri is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
