"""Lightning: checkpoints saved to, resumed from and deleted in S3 through s3dcp.

    Trainer(plugins=[S3CheckpointIO()], default_root_dir="s3://bucket/run", logger=False,
            callbacks=[S3ModelCheckpoint(save_top_k=2, save_last=True, every_n_train_steps=100)])

    save_checkpoint(dict, "s3://…/epoch=0-step=100.ckpt")          global rank 0, as Lightning calls it
        dict ──split──► tensors (raw bytes, one DCP item each) + the rest (torch.save'd, as a uint8 tensor)
             ──► S3StorageWriter: staged into s3dcp's host pool (async_save=True) or not, uploaded by
                 the CRT, committed by .metadata written last
    load_checkpoint(path)        .metadata ──► every item read (checksums verified) ──► the dict again
                                 (the rest unpickled with torch.load(weights_only=...) as Lightning asks);
                                 one INFO line and last_load_stats: the tier, bytes and seconds
    local_dir, s3_every          every checkpoint also kept on the node, every s3_every-th checkpoint
                                 step sent to S3 too, a load read from the node's copy when it is the
                                 save S3 would give (lightning_local.py)
    remove_checkpoint(path)      after the saves in flight have committed (kept if one failed):
                                 .metadata first, then the objects no other checkpoint references

:class:`S3ModelCheckpoint` is Lightning's ``ModelCheckpoint`` (top-k, ``save_last``,
``every_n_train_steps``, ...) whose questions about the checkpoint directory (does this file
exist, which ``last*.ckpt`` are there) see the committed checkpoints in S3
(:mod:`s3dcp.interop.lightning_fs`), and whose ``last`` candidates reach the Trainer as
``s3dcp://`` URLs, so that ``trainer.fit(ckpt_path="last")`` resumes from the newest *committed*
one. Lightning's own ``ModelCheckpoint`` asks fsspec's ``s3`` file system (s3fs), which sees a
checkpoint prefix as a directory and knows nothing of commits.

Lightning calls the CheckpointIO only on global rank 0 for saves and deletions (DDP), on every
rank for loads; every call here runs without collectives. FSDP's and ModelParallel's sharded
saves do not go through a CheckpointIO at all (see ``docs/trainers.md``).
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import re
import threading
import time
from typing import Any

import torch

from ..config import S3Config
from ..errors import ConfigError, IntegrityError, MetadataFormatError, unwrap_error
from ..lifecycle.inflight import InFlight
from ..lifecycle.manager import delete_checkpoint
from ..loading.reader import S3StorageReader
from ..s3.client import S3Client
from ..saving.writer import S3StorageWriter, SaveStats
from ..uri import is_s3_uri, parse_s3_uri
from . import lightning_fs
from .lightning_dict import REST, destinations, join, pickled, split
from .lightning_local import NodeCopy, NodeTier

try:
    import torch.distributed.checkpoint as dcp
    from lightning_fabric.plugins import CheckpointIO
    from pytorch_lightning.callbacks import ModelCheckpoint
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("s3dcp.interop.lightning needs pytorch-lightning: pip install 's3dcp[lightning]'") from e

__all__ = ["S3CheckpointIO", "S3ModelCheckpoint"]

log = logging.getLogger("s3dcp")


class S3CheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over s3dcp (see the module docstring).

    Args:
        config: :class:`S3Config`; default: resolved from the environment (``AWS_ENDPOINT_URL_S3``...).
            It is also what ``s3dcp://`` URLs use in this process (``ckpt_path="last"``).
        async_save: return from ``save_checkpoint`` once the tensors are copied into s3dcp's host
            pool; the upload runs behind training. With ``config=S3Config(staging="background")``
            (opt-in: the loop then must not change a tensor until the copy is complete, the
            contract of docs/memory.md) it returns once the copy is planned, and the copy overlaps
            the next step's forward and backward: the optimizer step waits for it after its
            closure has run, and :class:`S3ModelCheckpoint` waits for it before the step. A save
            while the previous one still uploads waits for it. ``teardown`` (the end of ``fit``)
            waits for the last one and raises its error; an earlier failure is raised by the next
            save.
        incremental: a tensor unchanged since the newest checkpoint this plugin committed in the
            same directory is stored as a reference to it, not uploaded again (``last.ckpt`` saved
            right after ``epoch=…-step=….ckpt`` uploads nothing but the rest). Deletion keeps what
            a remaining checkpoint references.
        local_dir: every checkpoint also kept in this directory of the node, and loaded from
            there while it is complete, intact and the save S3 would give (docs/trainers.md).
        s3_every: with ``local_dir``, every K-th checkpoint step this plugin saves (Lightning's
            ``global_step``; the first included, and every file saved at that step) goes to S3;
            the others are kept on the node only: a job on this node resumes from them, a job
            elsewhere from the newest in S3. The count starts again with each plugin (each run).

    :attr:`last_load_stats`: the figures of the last load on this rank (``path``, ``step``,
    ``tier`` — ``"local"`` or ``"s3"``, ``local_bytes``, ``peer_bytes``, ``s3_bytes``,
    ``seconds``), as :attr:`s3dcp.CheckpointManager.last_load_stats`.
    """

    def __init__(self, *, config: S3Config | None = None, async_save: bool = False, incremental: bool = False,
                 local_dir: str | os.PathLike | None = None, s3_every: int = 1) -> None:
        if local_dir is not None and incremental:
            raise ConfigError("S3CheckpointIO: local_dir= and incremental=True cannot go together: a checkpoint "
                              "kept on the node only would reference objects in S3")
        if local_dir is None and s3_every != 1:
            raise ConfigError(f"S3CheckpointIO: s3_every={s3_every!r} keeps the other checkpoints on the node only: "
                              "it needs local_dir= (a directory of the node, e.g. /dev/shm/<run>)")
        self.config = config or S3Config()
        self.async_save = async_save
        self.incremental = incremental
        self.local_dir = local_dir  # every checkpoint also kept here, loaded from here when intact
        self._tier = None if local_dir is None else NodeTier(local_dir, s3_every)
        self.s3_every = s3_every
        self.last_load_stats: dict | None = None
        self._client: S3Client | None = None
        self._lock = threading.Lock()  # _committed
        self._saves = InFlight()
        self._committed: dict[str, str] = {}  # parent prefix -> newest checkpoint committed there (incremental)
        self._deletions = InFlight()  # removals waiting for a save to commit (they never fail)
        self.last_writer: S3StorageWriter | None = None
        lightning_fs.register(self.config)

    @property
    def last_stats(self) -> SaveStats | None:
        """The figures of the last save (bytes uploaded, inherited, stage and upload seconds);
        complete once it has committed."""
        return None if self.last_writer is None else self.last_writer.last_stats

    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = S3Client(self.config)
        return self._client

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        uri = _s3_path(path)
        self._saves.raise_finished()
        step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        tensors, rest = split(checkpoint)
        tensors[REST] = pickled(rest)
        base = self._base_for(uri) if self.incremental else None
        to_s3 = self._tier is None or self._tier.goes_to_s3(step)
        copy = None if self._tier is None else self._tier.copy_for(uri, in_s3=to_s3)
        writer = S3StorageWriter(uri, config=self.config,  # staging="background" only where the config asks
                                 client=self.client, overwrite=True,
                                 incremental_from=base, item_checksum="crc64nvme" if self.incremental else None,
                                 local_copy=copy, upload=to_s3)
        self.last_writer = writer

        def commit(metadata: Any) -> None:
            if copy is not None:
                self._tier.committed(copy, metadata, in_s3=to_s3, step=step)
            if to_s3:
                self._committed_at(uri)

        try:
            if not self.async_save:
                commit(dcp.save(tensors, storage_writer=writer, **_this_rank_alone()))
                return
            response = dcp.async_save(tensors, storage_writer=writer, **_this_rank_alone())
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if copy is not None:  # a partial local copy of a failed save: never left behind
                copy.discard()
            raise unwrap_error(e)  # chained from DCP's exception
        upload = getattr(response, "upload_completion", response)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_running_or_notify_cancel()

        def committed(f: concurrent.futures.Future) -> None:
            try:
                commit(f.result())
            except BaseException as e:  # noqa: BLE001 - raised by the next save or teardown
                error = unwrap_error(e)
                log.error("checkpoint %s failed: %s: %s", uri, type(error).__name__, error)
                if copy is not None:
                    copy.discard()
                done.set_exception(error)
                return
            done.set_result(None)

        self._saves.add(done, getattr(response, "staging_completion", None))
        upload.add_done_callback(committed)

    def _base_for(self, uri: str) -> str | None:
        parent = uri.rpartition("/")[0]
        self.wait()  # the base must be committed: the save in flight first
        with self._lock:
            base = self._committed.get(parent)
        return None if base == uri else base

    def _committed_at(self, uri: str) -> None:
        with self._lock:
            self._committed[uri.rpartition("/")[0]] = uri

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path`` (``s3://`` or ``s3dcp://``), as it was saved: from this
        node's copy when there is one S3 agrees with (``local_dir``), else from S3; a missing or
        uncommitted one raises :class:`~s3dcp.errors.CheckpointNotFoundError` (a
        ``FileNotFoundError``) or :class:`~s3dcp.errors.IncompleteCheckpointError`. Sets
        :attr:`last_load_stats` and logs one INFO line (tier, bytes, seconds)."""
        uri = _s3_path(path)
        began = time.perf_counter()
        bytes_from = {"local": 0, "s3": 0}
        try:
            node = self._tier.reader_for(uri, self.client) if self._tier is not None else None
            state = self._load_node_copy(node, uri, bytes_from) if node is not None else None
            tier = "local" if state is not None and not bytes_from["s3"] else "s3"
            if state is None:
                reader = S3StorageReader(uri, config=self.config, client=self.client)
                state = self._load_with(reader, uri)
                bytes_from["s3"] += reader.last_read_bytes
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise unwrap_error(e)
        # bytes from storage: plain data only, unless the caller asked for more in so many words
        rest = torch.load(io.BytesIO(state.pop(REST).numpy().tobytes()),
                          weights_only=True if weights_only is None else weights_only)
        if isinstance(map_location, (str, torch.device)):
            state = {k: v.to(map_location) for k, v in state.items()}
        step = rest.get("global_step") if isinstance(rest, dict) else None
        seconds = time.perf_counter() - began
        self.last_load_stats = {"path": uri, "step": step, "tier": tier, "local_bytes": bytes_from["local"],
                                "peer_bytes": 0, "s3_bytes": bytes_from["s3"], "seconds": seconds}
        log.info("restored %s (step %s) from %s: %d bytes from the node's copy, %d from S3, in %.2f s", uri, step,
                 "S3" if tier == "s3" else f"the node's copy ({node.dir})", bytes_from["local"], bytes_from["s3"],
                 seconds)
        return join(rest, state)

    def _load_node_copy(self, node: NodeCopy, uri: str, bytes_from: dict) -> dict[str, Any] | None:
        """The state read from this node's copy of ``uri``; None when the copy is corrupt and S3
        holds the checkpoint (then S3's is loaded). A corrupt copy kept on the node only is
        another save than S3's (or the only one): S3's earlier save is loaded with a warning
        that says so, and with none in S3 the corruption is raised."""
        try:
            return self._load_with(node.reader, uri)
        except (IntegrityError, MetadataFormatError) as e:
            if node.in_s3:
                log.warning("the local copy of %s (%s) is corrupt (%s); loading it from S3", uri, node.dir, e)
                return None
            if node.s3_holds is None:
                raise IntegrityError(f"the local copy of {uri} ({node.dir}) is corrupt ({e}); it was kept on the node "
                                     f"only (s3_every={self.s3_every}) and S3 holds no checkpoint {uri}: nothing "
                                     "intact is left to load. Resume from another checkpoint") from e
            log.warning("the local copy of %s (%s) is corrupt (%s); it was kept on the node only (s3_every=%d): "
                        "loading S3's earlier save of that name instead", uri, node.dir, e, self.s3_every)
            return None
        finally:
            node.client.close()  # its local-read threads
            bytes_from["local"] += node.client.bytes["local"]
            bytes_from["s3"] += node.client.bytes["s3"]

    def _load_with(self, reader: S3StorageReader, uri: str) -> dict[str, Any]:
        try:
            state = destinations(reader.read_metadata(), uri)
            if REST not in state:
                raise ConfigError(f"{uri} is not a Lightning checkpoint saved by S3CheckpointIO (no {REST} item)")
            dcp.load(state, storage_reader=reader, **_this_rank_alone())
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise unwrap_error(e)
        return state

    # ------------------------------------------------------------------ delete
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` once the saves in flight have committed; if one of
        them failed, ``path`` is kept (it may be the newest good checkpoint left)."""
        uri = _s3_path(path)
        gate = self._saves.newest()
        if gate is None:
            self._delete(uri)
            return
        deleted: concurrent.futures.Future = concurrent.futures.Future()
        deleted.set_running_or_notify_cancel()

        def after(f: concurrent.futures.Future) -> None:
            try:
                if f.exception() is not None:
                    log.warning("kept %s: the newer checkpoint saved before its removal failed", uri)
                else:
                    self._delete(uri)
            except Exception:  # noqa: BLE001 - a leftover for `s3dcp gc`, never a failed training step
                log.warning("could not delete %s", uri, exc_info=True)
            finally:
                deleted.set_result(None)

        self._deletions.add(deleted)
        gate.add_done_callback(after)

    def _delete(self, uri: str) -> None:
        with self._lock:
            self._committed = {p: u for p, u in self._committed.items() if u != uri}
        if self._tier is not None:
            self._tier.removed(uri)
        result = delete_checkpoint(self.client, parse_s3_uri(uri))
        log.info("deleted checkpoint %s (%d bytes)%s", uri, result.deleted_bytes,
                 f"; kept {len(result.kept)} object(s) that other checkpoints reference" if result.kept else "")

    # ------------------------------------------------------------------ lifecycle
    def wait_staged(self) -> None:
        """Wait until the state of the last async save is copied (background staging), after
        which the optimizer may change it; S3ModelCheckpoint calls it before each optimizer step."""
        self._saves.wait_staged()

    def wait(self) -> None:
        """Wait for the saves in flight and the removals behind them; raise the first error
        among the saves (once)."""
        self._saves.drain()
        self._deletions.wait()
        self._saves.wait()

    def teardown(self) -> None:
        """The end of ``fit``: :meth:`wait`, then close the plugin's S3Client (a later save or
        load takes a native client again)."""
        try:
            self.wait()
        finally:
            if self._client is not None:
                self._client.close()


class S3ModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` for an ``s3://`` directory (its ``dirpath``, or
    ``default_root_dir/checkpoints`` when the Trainer has no logger): the same arguments and
    behaviour, with existence checks and ``last`` lookups that see committed s3dcp checkpoints.
    Any other directory behaves exactly as ``ModelCheckpoint``. Its view of the bucket (and that
    view's S3Client) is closed at ``teardown``."""

    def __init__(self, dirpath: Any = None, *args: Any, config: S3Config | None = None, **kwargs: Any) -> None:
        s3 = dirpath is not None and is_s3_uri(str(dirpath))
        super().__init__(None if s3 else dirpath, *args, **kwargs)  # its own look-up would ask fsspec's s3
        self._s3_config = config
        if s3:
            self.dirpath = str(dirpath).rstrip("/")
            self._fs = self._s3_fs()

    def _s3_fs(self) -> lightning_fs.CheckpointFileSystem:
        """The callback's one view of the bucket (and its S3Client), made on first use."""
        lightning_fs.register()
        if not isinstance(getattr(self, "_fs", None), lightning_fs.CheckpointFileSystem):
            self._fs = lightning_fs.CheckpointFileSystem(self._s3_config)
        return self._fs

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if isinstance(getattr(self, "_fs", None), lightning_fs.CheckpointFileSystem):
            self._fs.close()  # a later fit or test uses it again: its client takes a native client again

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is not None:  # the optimizer may change the state only once it is staged
            plugin.wait_staged()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        plugin = _plugin(trainer)
        if plugin is not None and plugin.s3_every > 1 and trainer.num_nodes > 1:
            # global rank 0 saves alone: its node-only checkpoints are not on the other nodes,
            # whose ranks would resume from S3's older one (the ranks would disagree)
            raise ConfigError(f"S3CheckpointIO(s3_every={plugin.s3_every}) keeps checkpoints on global rank 0's node "
                              f"only, and this job runs on {trainer.num_nodes} nodes: the other nodes could not "
                              "resume from them. Use s3_every=1 (local_dir still serves rank 0's node)")
        dirpath = self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        if not is_s3_uri(str(dirpath)):
            return super().setup(trainer, pl_module, stage)
        self.dirpath = trainer.strategy.broadcast(str(dirpath).rstrip("/"))
        self._fs = self._s3_fs()
        if self.save_last == "link":
            raise ValueError(f"`ModelCheckpoint(save_last='link')` is only supported for local file paths, "
                             f"got `dirpath={self.dirpath}`.")
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0 and self._fs.exists(self.dirpath):
            if self._fs.ls(self.dirpath, detail=False):
                log.warning("checkpoint directory %s exists and is not empty", self.dirpath)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        dirpath = self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        if not is_s3_uri(str(dirpath)):
            return super()._find_last_checkpoints(trainer)
        fs = self._s3_fs()
        if not fs.exists(str(dirpath)):
            return set()
        last = self.CHECKPOINT_NAME_LAST
        names = [e["name"] for e in fs.ls(str(dirpath)) if e["type"] == "file"]
        # s3dcp:// so that the Trainer's fsspec look-up of each candidate reaches the view of commits
        return {f"{lightning_fs.PROTOCOL}://{n}" for n in names
                if n.endswith(self.FILE_EXTENSION) and _is_last(os.path.basename(n), last, self.FILE_EXTENSION)}


def _plugin(trainer: Any) -> S3CheckpointIO | None:
    """The trainer's S3CheckpointIO (also inside Lightning's AsyncCheckpointIO), or None."""
    io_ = getattr(trainer.strategy, "checkpoint_io", None)
    while io_ is not None and not isinstance(io_, S3CheckpointIO):
        io_ = getattr(io_, "checkpoint_io", None)
    return io_


# ---------------------------------------------------------------------- DCP on one rank
_alone_lock = threading.Lock()
_alone: list = [None, None]  # (the default group it was made under, the group of this rank alone)


def _this_rank_alone() -> dict[str, Any]:
    """DCP's arguments for a checkpoint that this rank reads or writes by itself (under DDP,
    rank 0 saves and every rank loads). Under torch.distributed: a gloo group of this rank only
    (made once, without the other ranks: ``use_local_synchronization``; gloo, which async saves
    need, whatever the job's backend), so DCP neither waits for ranks that do not call it nor
    warns, from the thread of an async save, that distributed is off. Without it: ``no_dist``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"no_dist": True}
    with _alone_lock:
        if _alone[0] is not dist.group.WORLD:  # first use, or a new default group since
            _alone[1] = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
            _alone[0] = dist.group.WORLD
        return {"process_group": _alone[1], "no_dist": False}


def _s3_path(path: Any) -> str:
    path = str(path).rstrip("/")
    if path.startswith(f"{lightning_fs.PROTOCOL}://"):
        path = "s3://" + path[len(lightning_fs.PROTOCOL) + 3:]
    if not is_s3_uri(path):
        raise ConfigError(f"S3CheckpointIO saves to s3:// paths, not {path!r}: give the Trainer "
                          "default_root_dir='s3://bucket/run' (or S3ModelCheckpoint(dirpath='s3://...'))")
    parse_s3_uri(path)
    return path


def _is_last(name: str, last: str, extension: str) -> bool:
    return bool(re.match(rf"^{re.escape(last)}(-(\d+))?{re.escape(extension)}$", name))

