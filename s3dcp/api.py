"""One call to save, save asynchronously or load a checkpoint in S3, with errors you can catch.

    s3dcp.save(state_dict, "s3://bucket/run/step-1000")            # -> DCP Metadata, once committed
    future = s3dcp.async_save(state_dict, "s3://bucket/run/step-2000")
    ...                                                             # the loop goes on once staged
    future.result()                                                 # committed, or raises
    s3dcp.load(state_dict, "s3://bucket/run/step-1000")             # in place, like dcp.load

Why these exist next to ``dcp.save(..., storage_writer=S3StorageWriter(...))``:

- DCP picks a storage class from a bare ``checkpoint_id`` only among its own (file system,
  fsspec); a plugin cannot register. These calls pick :class:`S3StorageWriter` /
  :class:`S3StorageReader` for an ``s3://`` path.
- DCP reports every failure as a ``CheckpointException``, a ``BaseException`` (so
  ``except Exception`` misses it) whose text is a traceback per rank. These calls raise the
  error that caused it instead (:func:`~s3dcp.errors.unwrap_error`) — an
  :class:`~s3dcp.errors.S3DCPError` subclass such as
  :class:`~s3dcp.errors.CheckpointNotFoundError` or :class:`~s3dcp.errors.AccessDeniedError`
  when s3dcp raised it, else the original exception (a planner's ``ValueError``, say) — with
  ``failed_ranks`` (the ranks that failed, ascending), ``rank_errors`` ({rank: exception}) and
  ``checkpoint_exception`` (DCP's) attached; its traceback is printed once, not again inside
  DCP's. An :class:`~s3dcp.errors.S3ConnectionError` also says when the endpoint speaks the
  other protocol (``https://`` at a plain-HTTP server: :func:`s3dcp.s3.probe.diagnose`).
- Without torch.distributed DCP warns on every call that it assumes a single process; for
  these calls that is what the caller asked for, so they hide that warning (and only for
  their own calls: :mod:`s3dcp._dcp_warning`).
- Any other keyword (``incremental_from=``, ``item_checksum=``, ``pool=``) goes to
  :class:`S3StorageWriter`; the figures of the save (:class:`~s3dcp.saving.writer.SaveStats`: bytes,
  stage and upload seconds, GB/s, bytes inherited) are ``future.stats`` of an async save and
  :func:`last_save_stats` for both.

They run on every rank, like DCP's calls, with the process group when torch.distributed is
initialized and without one otherwise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
from typing import TYPE_CHECKING, Any

from ._dcp_warning import ours
from .config import S3Config
from .errors import ConfigError, S3ConnectionError, unwrap_error
from .loading.reader import S3StorageReader
from .s3.client import S3Client
from .s3.probe import diagnose
from .saving.stats import last_committed, record_committed

if TYPE_CHECKING:
    from .loading.exchange import LoadStats
    from .saving.writer import S3StorageWriter, SaveStats

__all__ = ["save", "async_save", "load", "unwrap_error", "last_save_stats", "last_load_stats", "SaveFuture"]

_last_load: list[Any] = [None]  # the LoadStats of the load that ended last in this process
_last_load_lock = threading.Lock()


def last_load_stats() -> "LoadStats | None":
    """The :class:`~s3dcp.loading.exchange.LoadStats` of the :func:`load` that ended last in this
    process (unique source bytes, bytes from S3 and from peers, the slowest rank's seconds), or
    None before the first one."""
    with _last_load_lock:
        return _last_load[0]


def last_save_stats() -> "SaveStats | None":
    """The :class:`~s3dcp.saving.writer.SaveStats` of the save that committed last in this process
    (this rank's figures) — by :func:`save`, :func:`async_save` or a
    :class:`~s3dcp.CheckpointManager` — or None before the first one.

    With DCP's process executor the upload runs in another process, whose figures this
    process does not see: ``stage_s`` only.
    """
    return last_committed()


def _record(writer: "S3StorageWriter") -> None:
    record_committed(writer.last_stats)


class SaveFuture(concurrent.futures.Future):
    """What :func:`async_save` returns: resolves to DCP's ``Metadata`` once the checkpoint is
    committed, or raises the unwrapped error. ``writer`` is the :class:`S3StorageWriter` it
    used; ``stats`` its :class:`~s3dcp.saving.writer.SaveStats`, complete once the future is done.

    Ctrl-C while :meth:`result` waits stops the upload, as it stops a :func:`save`: the writer's
    requests are aborted, what it wrote is deleted, nothing is committed (unless the commit was
    already sent: then the checkpoint is whole), and ``KeyboardInterrupt`` is raised once that is
    done — after a line on stderr if it takes longer than a second; a second Ctrl-C stops the
    waiting (``s3dcp gc`` removes what is left). With DCP's process executor the upload runs in
    another process, which Ctrl-C here does not stop: stderr says so."""

    _QUIET_S = 1.0  # how long the stop may take before stderr says what is going on

    def __init__(self, writer: "S3StorageWriter", *, stoppable: bool = True) -> None:
        super().__init__()
        self.writer = writer
        self._stoppable = stoppable

    @property
    def stats(self) -> "SaveStats":
        return self.writer.last_stats

    def result(self, timeout: float | None = None):
        try:
            return super().result(timeout)
        except KeyboardInterrupt:
            self._stop()
            raise

    def _stop(self) -> None:
        where = self.writer.checkpoint_id
        if not self._stoppable:
            print(f"s3dcp: the upload of {where} goes on in DCP's process executor and commits when done "
                  f"(Ctrl-C does not stop it there; if it is stopped, `s3dcp gc` removes what it leaves)",
                  file=sys.stderr, flush=True)
            return
        self.writer.abandon()
        if concurrent.futures.wait([self], timeout=self._QUIET_S).not_done:
            print(f"s3dcp: Ctrl-C: stopping the upload of {where} and deleting what it wrote; Ctrl-C again to "
                  f"stop waiting (then `s3dcp gc` removes what is left)", file=sys.stderr, flush=True)
            concurrent.futures.wait([self])


def save(
    state_dict: dict[str, Any],
    path: str,
    *,
    config: S3Config | None = None,
    client: S3Client | None = None,
    overwrite: bool = False,
    planner: Any = None,
    process_group: Any = None,
    **writer_options: Any,
):
    """``dcp.save`` to ``path`` (``s3://bucket/prefix``) through :class:`S3StorageWriter`.

    Returns DCP's ``Metadata`` once the checkpoint is committed (its figures:
    :func:`last_save_stats`). Raises the underlying error (see the module docstring); a
    committed checkpoint at ``path`` raises :class:`~s3dcp.errors.CheckpointExistsError`
    unless ``overwrite=True``. ``writer_options`` (``incremental_from=``, ``item_checksum=``,
    ``pool=``) go to :class:`S3StorageWriter`.
    """
    import torch.distributed.checkpoint as dcp

    from .saving.writer import S3StorageWriter

    writer = ours(S3StorageWriter(path, config=config, client=client, overwrite=overwrite, **writer_options))
    try:
        metadata = dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group,
                            no_dist=not _dist_on())
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise _unwrapped(e, writer)
    _record(writer)
    return metadata


def async_save(
    state_dict: dict[str, Any],
    path: str,
    *,
    config: S3Config | None = None,
    client: S3Client | None = None,
    overwrite: bool = False,
    planner: Any = None,
    process_group: Any = None,
    async_checkpointer_type: Any = None,
    **writer_options: Any,
) -> SaveFuture:
    """``dcp.async_save`` to ``path`` through :class:`S3StorageWriter`.

    Returns once the state is staged (copied to host memory), so the caller may change its
    tensors; the returned :class:`SaveFuture` resolves to DCP's ``Metadata`` when the
    checkpoint is committed, or raises the underlying error (see the module docstring), never
    a ``CheckpointException``; ``future.stats`` has the save's figures once it is done.
    ``writer_options`` go to :class:`S3StorageWriter`, as for :func:`save`.

    ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` uploads from a separate process;
    DCP needs torch.distributed initialized for it (one rank is enough: see
    ``examples/process_executor.py``), so without it this raises :class:`ConfigError`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from .saving.writer import S3StorageWriter

    executor = async_checkpointer_type or AsyncCheckpointerType.THREAD
    if executor == AsyncCheckpointerType.PROCESS and not _dist_on():
        raise ConfigError(
            "async_save with AsyncCheckpointerType.PROCESS needs torch.distributed initialized (DCP's "
            "process executor talks to its worker through the default process group), even for one "
            "process: call torch.distributed.init_process_group('gloo', ...) first (see "
            "examples/process_executor.py), or use the default thread executor")
    writer = ours(S3StorageWriter(path, config=config, client=client, overwrite=overwrite, **writer_options))
    try:
        response = dcp.async_save(state_dict, storage_writer=writer, planner=planner,
                                  process_group=process_group, async_checkpointer_type=executor,
                                  no_dist=not _dist_on())
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # an AsyncSaveResponse: keep "returns once staged"
            staged.result()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        writer.abandon()  # Ctrl-C while staging: the upload thread must not go on to upload and commit
        raise _unwrapped(e, writer)
    upload = getattr(response, "upload_completion", response)
    outer = SaveFuture(writer, stoppable=executor != AsyncCheckpointerType.PROCESS)
    outer.set_running_or_notify_cancel()

    def done(inner: concurrent.futures.Future) -> None:
        try:
            result = inner.result()
        except BaseException as e:  # noqa: BLE001 - delivered, unwrapped, on the future
            outer.set_exception(_unwrapped(e, writer))
            return
        _record(writer)
        outer.set_result(result)

    upload.add_done_callback(done)
    return outer


def load(
    state_dict: dict[str, Any],
    path: str,
    *,
    config: S3Config | None = None,
    client: S3Client | None = None,
    verify: bool = True,
    allow_pickle: bool = False,
    planner: Any = None,
    process_group: Any = None,
    cooperative: bool = False,
    **reader_kwargs: Any,
) -> None:
    """``dcp.load`` from ``path`` into ``state_dict`` (in place) through :class:`S3StorageReader`.

    ``cooperative=True``: each stored byte is read from S3 by one rank and sent over
    ``process_group`` to the others that need it (see docs/restore.md); other keywords
    (``exchange_window_bytes=``, ``pool=``) go to the reader. The figures are
    :func:`last_load_stats`.

    A missing checkpoint raises :class:`~s3dcp.errors.CheckpointNotFoundError`, one without
    its metadata object :class:`~s3dcp.errors.IncompleteCheckpointError` — and DCP prints no
    "Global metadata is not found" tracebacks for them.
    """
    import torch.distributed.checkpoint as dcp

    reader = ours(S3StorageReader(path, config=config, client=client, verify=verify, allow_pickle=allow_pickle,
                                  cooperative=cooperative, process_group=process_group, **reader_kwargs))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group,
                 no_dist=not _dist_on())
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise _unwrapped(e, reader)
    with _last_load_lock:
        _last_load[0] = reader.last_stats


def _unwrapped(error: BaseException, storage: Any) -> BaseException:
    """The error to raise for DCP's ``error``: :func:`unwrap_error`'s, with the TLS/plain-HTTP
    diagnosis of the endpoint when no HTTP answer came."""
    error = unwrap_error(error)
    if isinstance(error, S3ConnectionError):
        with contextlib.suppress(ConfigError):
            error = diagnose(error, storage.config.resolved().endpoint_url)
    return error


def _dist_on() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
