"""torch-checkpointing's ``Storage`` on S3, through s3dcp's client: :class:`S3StorageConfig`.

    CheckpointManager(CheckpointManager.Config(storage_config=S3StorageConfig(root="s3://bucket/run")))
      save("step_10", ...) every rank: mkdir(tmp_step_10) ──► a staging marker (the directory stays hidden)
                           get_write_stream ──► torch.save ──► one PUT per file from the staged tensors
                           rank 0, after the barrier: rename(tmp_step_10 → step_10) ──► one create-only
                           PUT of step_10/.s3dcp-commit: committed, no byte copied
      load("step_10")      exists(step_10) (committed?) ──► getsize ──► mmap fill: mmap_fill_workers
                           streams, each readinto() one ranged GET straight into the mapping

Call order, as torch-checkpointing drives it: the config is pickled to the writer's
subprocess, which calls :meth:`S3StorageConfig.create_storage`; every rank ``mkdir``\\ s its
files' directories under ``<parent>/tmp_<name>``, writes them, rank 0 writes ``metadata.pkl``,
all meet at the barrier, and rank 0 renames the staging directory onto ``<parent>/<name>``.
A reader asks ``exists(<parent>/<name>)`` first: an uncommitted (killed, failing, still
running) save does not exist under its name. How names map to keys, the directory states and
the rename table are in :mod:`~s3dcp.interop.torch_checkpointing_paths`,
:mod:`~s3dcp.interop.torch_checkpointing_dirs` and :mod:`~s3dcp.interop.torch_checkpointing_rename`;
docs/trainers.md says what each choice costs.

Owns the config, the ``Storage`` methods, and :func:`keep_last` (retention: torch-checkpointing
keeps every checkpoint it writes). Every error is the contract's: ``FileNotFoundError``,
``FileExistsError`` (an occupied destination), other ``OSError``\\ s carrying s3dcp's message
and error (``__cause__``).
"""

from __future__ import annotations

import errno
import io
import math
import os
from concurrent.futures import Future
from concurrent.futures import wait as settled
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from ..config import MiB, S3Config
from ..errors import ConfigError
from ..s3.client import S3Client
from ..s3.request import abort_and_wait
from ..uri import natural_order
from .torch_checkpointing_dirs import DirectoryNotFoundError, Dirs, State, not_found, wait
from .torch_checkpointing_paths import COMMIT_MARKER, MARKERS, PathMap
from .torch_checkpointing_rename import rename
from .torch_checkpointing_streams import MemoryStream, ReadStream, WriteStream, tensor_owners

__all__ = ["S3StorageConfig", "S3Storage", "keep_last"]


@dataclass
class S3StorageConfig(StorageConfig):
    """Where and how torch-checkpointing's files go in S3. Not frozen (torch-checkpointing's
    ``StorageConfig`` is a plain dataclass, and a frozen one cannot extend it), validated on
    creation; it pickles (credentials included) to the writer's subprocess.

    ``root``: ``s3://bucket/prefix`` under which every path that is not an ``s3://`` URL goes
    (``"step_10"`` and ``"/ckpt/step_10"`` alike), or None for ``s3://`` paths only.
    ``s3``: the client's settings (None: :class:`S3Config` from the environment).
    ``staging_prefix``: the writer's ``CheckpointWriterConfig.temp_dir_prefix``; a directory
    named with it is the staging view of the one without it (the commit copies nothing).
    ``write_memory_bytes``: bytes a write stream copies (those not in the tensors it was handed)
    before it spools them to a file in ``spool_dir`` (None: the temp directory).
    ``read_block_bytes``: reads shorter than this fetch one block of it ahead (torch.load's
    many small reads); longer ones go straight into the caller's buffer."""

    root: str | None = None
    s3: S3Config | None = field(default=None, repr=False)
    staging_prefix: str = "tmp_"
    write_memory_bytes: int = 64 * MiB
    spool_dir: str | None = None
    read_block_bytes: int = 1 * MiB

    def __post_init__(self) -> None:
        PathMap(self.root, self.staging_prefix)  # raises ConfigError naming what is wrong
        for name in ("write_memory_bytes", "read_block_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"S3StorageConfig.{name}={value!r}: give a positive number of bytes")

    def create_storage(self) -> "S3Storage":
        return S3Storage(self)


class S3Storage(Storage):
    """torch-checkpointing's ``Storage`` over an :class:`S3Client` (see the module docstring).
    ``client`` may be handed in (tests, benchmarks); otherwise one is made from ``config.s3``."""

    def __init__(self, config: S3StorageConfig, *, client: S3Client | None = None) -> None:
        self.config = config
        self.client = client or S3Client(config.s3 or S3Config())
        self._paths = PathMap(config.root, config.staging_prefix)
        self._dirs = Dirs(self.client)

    # ------------------------------------------------------------------ read geometry
    @property
    def mmap_fill_chunk_bytes(self) -> int:
        """Each parallel fill worker reads one upload part's worth at a time, itself fetched by
        the CRT in ``download_part_size_bytes`` ranges in parallel."""
        return self.client.config.part_size_bytes

    @property
    def mmap_fill_workers(self) -> int:
        """Enough workers that their ranges together keep ``max_concurrency`` GETs in flight."""
        cfg = self.client.config
        return max(2, math.ceil(cfg.max_concurrency * cfg.download_part_size_bytes / self.mmap_fill_chunk_bytes))

    # ------------------------------------------------------------------ reads
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        args = read_args or ReadArgs()
        where = self._paths.where(path, file=True)
        timeout_s = args.timeout_us / 1e6 if args.timeout_us and args.timeout_us > 0 else None
        if args.known_size_bytes is None:
            size = wait(self._checked_after(where, self.client.head(where.bucket, where.key))).size
        else:
            if args.known_size_bytes < 0:
                raise ValueError(f"ReadArgs.known_size_bytes={args.known_size_bytes} for {where.shown}")
            size = args.known_size_bytes
        if not args.pre_read_full_file:
            # with the size known no request has been answered yet: the stream checks after its first GET
            check = self._dirs.require_visible if args.known_size_bytes is not None else None
            return ReadStream(self.client, where.bucket, where.key, size, timeout_s=timeout_s,
                              block_bytes=self.config.read_block_bytes,
                              check=(lambda: check(where)()) if check is not None else None)
        data = bytearray(size)
        future = self.client.get_range_into(where.bucket, where.key, 0, data, object_size_bytes=size)
        try:
            if settled([future], timeout_s).done:
                self._checked_after(where, future)
            wait(future, 0)  # its error, or the timeout
        except BaseException:
            abort_and_wait([future])
            raise
        return MemoryStream(data)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        """The whole file: its size (a HEAD, unless known), then ranged GETs in parallel into one
        buffer, returned as ``bytes`` (one copy: ``bytes`` cannot be filled in place)."""
        with self.stream_read(path, replace(read_args or ReadArgs(), pre_read_full_file=False)) as stream:
            return stream.readall()

    def getsize(self, path: Path) -> int:
        where = self._paths.where(path, file=True)
        return wait(self._checked_after(where, self.client.head(where.bucket, where.key))).size

    def exists(self, path: Path) -> bool:
        """A file or a directory, as the name given sees it (its data requests asked at once, then
        the marker checks of both at once)."""
        as_file, as_dir = self._paths.where(path, file=True), self._paths.where(path, file=False)
        if not as_dir.key:
            return True  # a bucket's root (a missing bucket fails the first real request)
        under = None if as_dir.is_staging_view else self._dirs.first_objects(as_dir.bucket, as_dir.prefix, 1)
        found = self._dirs.has(as_file.bucket, as_file.key)
        settled([f for f in (under, found) if f is not None])
        dir_visible = self._dirs.require_visible(as_dir)
        file_visible = self._dirs.require_visible(as_file)
        if self._visible(dir_visible) and (under is None or wait(under)[0]):
            return True
        return wait(found) and self._visible(file_visible)

    def isdir(self, path: Path) -> bool:
        where = self._paths.where(path, file=False)
        if not where.key:
            return True  # a bucket's root (a missing bucket fails the first real request)
        if where.is_staging_view:  # there while its directory is staged and uncommitted
            return self._visible(self._dirs.require_visible(where))
        under = self._dirs.first_objects(where.bucket, where.prefix, 1)
        settled([under])
        return self._visible(self._dirs.require_visible(where)) and bool(wait(under)[0])

    def ls(self, path: Path) -> list[str]:
        """The names in a directory; a staged, uncommitted child shows as its staging view
        (``tmp_<name>``), markers never. A child prefix is asked whether it holds anything
        (SeaweedFS lists a directory whose objects were all deleted; S3 does not). Each marker
        check is asked once the listing it judges has been answered."""
        where = self._paths.where(path, file=False)
        listing = self.client.list(where.bucket, where.prefix, delimiter="/")
        settled([listing])
        visible = self._dirs.require_visible(where)
        objects, prefixes = wait(listing) if self._visible(visible) else ([], [])
        names = [o.key[len(where.prefix):] for o in objects]
        children = [p[len(where.prefix):].rstrip("/") for p in prefixes]
        unders = [(c, self._dirs.first_objects(where.bucket, f"{where.prefix}{c}/", 1)) for c in children]
        settled([u for _, u in unders])
        asked = [(c, under, self._dirs.marks(where.bucket, [where.prefix + c]) if where.staged is None else None)
                 for c, under in unders]
        live = [(c, marks() if marks is not None else [None]) for c, under, marks in asked if wait(under)[0]]
        live = [(c, m) for c, [m] in live if m is not State.REMOVING]
        if not names and not live:
            as_file = self._paths.where(path, file=True)
            if as_file.key and self._is_file(as_file):
                raise NotADirectoryError(f"{where.shown} ({as_file.url}) is a file")
            visible()  # why it is not there, where a staging view or an uncommitted save says
            raise not_found(where, "no such directory")
        shown = [n for n in names if n not in MARKERS]
        shown += [self._paths.listed_name(c, staged=m is State.STAGED) for c, m in live]
        return sorted(shown)

    # ------------------------------------------------------------------ writes
    def stream_write(self, path: Path) -> io.IOBase:
        return self.get_write_stream(path, None)

    def get_write_stream(self, path: Path, data: object) -> io.IOBase:
        """A stream whose bytes become the object on ``close()``; bytes that lie in a CPU
        tensor of ``data`` are sent from it (kept, not copied): the caller leaves those
        tensors unchanged until the stream is closed or aborted, as the contract asks. Whether
        the path may be written is asked when the stream opens and again on ``close()``, right
        before the upload: a directory committed (or deleted) in between is not written into."""
        where = self._writable(path)
        cfg = self.config

        def finish(views: list) -> None:
            self._dirs.require_visible(where)()
            wait(self.client.put(where.bucket, where.key, views))

        def finish_file(file: str, nbytes: int, keep: Any) -> None:
            self._dirs.require_visible(where)()
            wait(self.client.put_file(where.bucket, where.key, file, nbytes, keep=keep))

        return WriteStream(tensor_owners(data) if data is not None else [], memory_bytes=cfg.write_memory_bytes,
                           spool_dir=cfg.spool_dir, finish=finish, finish_file=finish_file)

    def write(self, path: Path, data: Any) -> None:
        where = self._writable(path)
        wait(self.client.put(where.bucket, where.key, memoryview(data)))

    def delete(self, path: Path) -> None:
        where = self._paths.where(path, file=True)
        wait(self._checked_after(where, self.client.head(where.bucket, where.key)))  # FileNotFoundError: none
        wait(self.client.delete(where.bucket, [where.key]))

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """A staging directory (``tmp_<name>``, or one inside it) makes ``<name>`` STAGED, or
        refuses a committed or populated ``<name>`` (``FileExistsError``) before anything is
        written; a plain directory gets a marker object, so that an empty one exists."""
        where = self._paths.where(path, file=False)
        if where.staged is not None:
            self._dirs.stage(where)
            if where.is_staging_view:
                return
        self._dirs.require_visible(where.parents())()
        if not recursive:
            parent = os.path.dirname(os.fspath(path).rstrip("/"))
            if parent and not self.isdir(Path(parent)):
                raise not_found(where, "its parent directory does not exist (mkdir with recursive=False)")
            if self.exists(path):
                raise FileExistsError(f"{where.shown} ({where.url}) exists")
        self._dirs.make(where)

    def rmdir(self, path: Path) -> None:
        """Delete a directory and everything in it (a committed checkpoint is hidden first)."""
        where = self._paths.where(path, file=False)
        if not where.key:
            raise OSError(errno.EPERM, f"{where.shown}: refusing to delete everything in bucket {where.bucket}")
        self._dirs.require_visible(where.parents())()
        if where.is_staging_view:
            state = State.STAGED  # require_visible found it staged and uncommitted
        else:
            state = self._dirs.state(where.bucket, where.key)
            if state is State.STAGED:  # hidden under this name: its staging view's to remove (a REMOVING
                # one is removed again: an interrupted removal ends so)
                state = State.ABSENT
        if state is State.ABSENT:
            as_file = self._paths.where(path, file=True)
            if as_file.key and self._is_file(as_file):
                raise NotADirectoryError(f"{where.shown} ({as_file.url}) is a file")
            raise not_found(where, "no such directory")
        wait(self._dirs.remove(where, state))

    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False,
               background_cleanup: bool = False) -> None:
        """See :mod:`~s3dcp.interop.torch_checkpointing_rename` for the table (``is_directory``
        is not needed: what ``src_path`` is, is read from S3)."""
        rename(self._paths, self._dirs, src_path, dst_path, background_cleanup=background_cleanup)

    def remap_path(self, path: Path) -> str:
        """The ``s3://`` URL of the objects under ``path`` (a staging view's: its directory's)."""
        return self._paths.where(path, file=False).url

    # ------------------------------------------------------------------ retention
    def committed(self, path: Path) -> list[str]:
        """The names of the committed checkpoints directly under directory ``path`` (written
        through a staging view and committed), in natural order (``step_9`` before ``step_10``)."""
        where = self._paths.where(path, file=False)
        _, prefixes = wait(self.client.list(where.bucket, where.prefix, delimiter="/"))
        children = [p[len(where.prefix):].rstrip("/") for p in prefixes]
        found = [self._dirs.has(where.bucket, f"{where.prefix}{c}/{COMMIT_MARKER}") for c in children]
        return sorted((c for c, f in zip(children, found) if wait(f)), key=natural_order)

    # ------------------------------------------------------------------ internals
    def _writable(self, path: Path):
        """Where a file may be written: in a directory that exists (made by mkdir, or holding
        files; the root always does), not under an uncommitted checkpoint's final name, and
        through a staging view only while its save is in progress (a directory committed
        meanwhile, by another save of the same name, is not written into)."""
        where = self._paths.where(path, file=True)
        parent = where.key.rpartition("/")[0]
        under = self._dirs.first_objects(where.bucket, f"{parent}/", 1) if parent in where.guards else None
        self._dirs.require_visible(where)()
        if under is not None and not wait(under)[0]:
            raise DirectoryNotFoundError(errno.ENOENT, f"{where.shown} ({where.url}): its directory "
                                         f"s3://{where.bucket}/{parent} does not exist (mkdir it first, as "
                                         "torch-checkpointing's writer does)")
        return where

    def _is_file(self, where) -> bool:
        found = self._dirs.has(where.bucket, where.key)
        settled([found])
        return self._visible(self._dirs.require_visible(where)) and wait(found)

    def _checked_after(self, where, data: Future) -> Future:
        """``data`` (a request for what is at ``where``), once it has been answered and ``where``
        found visible. The marker checks are asked only then: a save writes its staging marker
        before its first object, so an object the answer saw was staged by then, and a check
        asked after it cannot miss the marker (one asked at the same time could be answered
        first, before the save began, and pass a file of an uncommitted save)."""
        settled([data])
        self._dirs.require_visible(where)()
        return data

    @staticmethod
    def _visible(check) -> bool:
        try:
            check()
            return True
        except FileNotFoundError:
            return False


def keep_last(storage: S3Storage, path: str | os.PathLike, keep: int) -> list[str]:
    """Retention for torch-checkpointing, which keeps every checkpoint it writes: delete all but
    the ``keep`` last committed checkpoints under ``path`` (natural name order, see
    :meth:`S3Storage.committed`); returns the names deleted. A save in progress is not committed
    and is neither counted nor touched. Call it from one rank, after a save has committed."""
    if keep < 1:
        raise ConfigError(f"keep_last(keep={keep}): keep at least one checkpoint")
    names = storage.committed(Path(path))
    doomed = names[:-keep]
    for name in doomed:
        storage.rmdir(Path(os.path.join(os.fspath(path), name)))
    return doomed

