"""torchtitan: its DCP checkpoint manager with ``s3://`` folders saved, kept and resumed through s3dcp.

    S3CheckpointManager.Config(folder="s3://bucket/run", ...)      torchtitan's own settings, plus
        │                                                         incremental (s3dcp's)
    torchtitan _save(step) ─► dcp_save(state, "s3://bucket/run/step-N", async_mode)
        │   (overridden)    ─► s3dcp CheckpointManager.save(N): S3StorageWriter, staged into
        │                       s3dcp's host pool when async (pinned when CUDA), uploaded by the
        │                       CRT, committed by .metadata written last
        │                   ─► once committed: retention (keep_latest_k, reference-aware), then one
        │                       line in torchtitan's log: where the step went ("committed to
        │                       s3://…", or "kept on the node … not in S3" with local_dir) and figures
    torchtitan _load(step) ─► newest *committed* step (collective) or initial_load_path
        │                  ─► dcp_load: S3StorageReader (DCP checkpoints), S3SafetensorsReader
        │                       (initial_load_in_hf from s3://)
    last step, last_save_in_hf ─► the model in HF names as a DCP checkpoint in step-N/sharded,
                                   then exported (``s3dcp export``) to safetensors in step-N

Only the hook points torchtitan's ``CheckpointManager`` calls with a path are overridden
(``dcp_save``, ``dcp_load``, ``_load``, ``_find_load_step``, ``_purge_stale_checkpoints``);
interval, ``enable_first_step_checkpoint``, ``last_save_model_only``, ``export_dtype``,
``exclude_from_loading``, ``load_step``, ``load_only`` and seed checkpoints run torchtitan's
own code. A local ``folder`` (and a local ``initial_load_path``) goes to torchtitan unchanged.

What changes with an ``s3://`` folder:

- ``async_mode``: ``"async"`` and ``"async_with_pinned_mem"`` both stage into s3dcp's host pool
  (pinned memory and a side stream when CUDA) and upload from DCP's background thread; the
  CRT's own threads do the network work, so torchtitan's process executor (and its
  ``DefaultStager``, whose non-blocking copies need an accelerator) is not used.
  ``"async"`` copies the state before ``save`` returns; ``"async_with_pinned_mem"`` stages in
  the background (``S3Config(staging="background")``): ``save`` returns once the copy is
  planned, and torchtitan waits for its ``staging_completion`` before the next optimizer step.
  A save while the previous one still uploads waits for it (one checkpoint in flight).
- ``keep_latest_k`` counts *committed* checkpoints, and deletes only after a newer save
  committed (torchtitan's own purge counts the one still uploading); with ``incremental``
  an object a kept checkpoint references stays until no kept checkpoint references it.
- Resume picks the newest step whose ``.metadata`` exists: a save killed mid-upload is skipped
  (``s3dcp gc`` removes it later).
- S3 settings (endpoint, region, credentials) come from the environment as for any AWS SDK
  (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, ...), or from ``s3_config=`` given to the manager.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import S3Config
from ..errors import CheckpointNotFoundError, ConfigError, unwrap_error
from ..lifecycle.manager import CheckpointManager as _S3Manager
from ..loading.reader import S3StorageReader
from ..saving.staging import release_staging_memory
from ..uri import is_s3_uri, parse_s3_uri

try:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
    from torchtitan.tools.logging import logger as titan_log
    from torchtitan.tools.utils import GarbageCollection
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("s3dcp.interop.torchtitan needs torchtitan (0.3): pip install 's3dcp[torchtitan]'") from e

if TYPE_CHECKING:
    from ..saving.writer import S3StorageWriter

__all__ = ["S3CheckpointManager"]

_STEP_NAME = "step-{step}"  # torchtitan's _create_checkpoint_id


class _PoolStaging:
    """Stands where torchtitan keeps the ``DefaultStager`` of ``async_with_pinned_mem``, so that
    torchtitan's ``_save`` does not build one: with an ``s3://`` folder the writers stage into
    s3dcp's host pool. ``close()`` (torchtitan calls it from ``close``) gives the pool's idle
    staging memory back."""

    def close(self) -> None:
        release_staging_memory()


class S3CheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with ``s3://`` folders through s3dcp.

    In a torchtitan config::

        checkpoint=S3CheckpointManager.Config(enable=True, folder="s3://bucket/run",
                                              interval=500, async_mode="async", keep_latest_k=3,
                                              incremental=True)

    Built by torchtitan's trainer (``config.checkpoint.build(...)``) with the same arguments as
    torchtitan's manager; ``s3_config`` (optional) gives the S3 settings in code instead of the
    environment. Every rank builds it; ``save``/``load`` are collective, as in torchtitan.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        incremental: bool = False
        """s3dcp: save each checkpoint as references to the newest committed one for the items
        that did not change (needs an ``s3://`` folder)."""
        local_dir: str = ""
        """s3dcp: keep every checkpoint on the node too, in this directory (a tmpfs such as
        ``/dev/shm/<run>``), and resume from the nearest copy (docs/restart.md)."""
        s3_every: int = 1
        """s3dcp, with ``local_dir``: every K-th checkpoint (the first included) also goes to S3."""
        local_keep_last: int = 2
        """s3dcp, with ``local_dir``: checkpoints kept on the node."""
        local_replicas: int = 0
        """s3dcp, with ``local_dir``: 1 also keeps each rank's copy on a rank of another node."""

        def __post_init__(self) -> None:
            # torchtitan refuses Hugging Face files at any remote path because its fsspec route
            # has no HF reader or writer; for s3:// this manager has both (export, safetensors
            # reader). Its other checks run unchanged.
            s3_folder = is_s3_uri(self.folder.strip())
            initial = (self.initial_load_path or "").strip()
            hf_out = self.last_save_in_hf and s3_folder
            hf_in = self.initial_load_in_hf and is_s3_uri(initial)
            if hf_out and not self.last_save_model_only:
                raise ValueError("last_save_in_hf requires last_save_model_only=True.")
            if hf_in and self.initial_load_in_hf_quantized:
                raise ValueError("initial_load_in_hf_quantized is not supported from an s3:// initial_load_path")
            if self.incremental and not s3_folder:
                raise ValueError(f"incremental=True needs an s3:// checkpoint.folder, not {self.folder!r}")
            if self.local_dir and not s3_folder:
                raise ValueError(f"local_dir needs an s3:// checkpoint.folder, not {self.folder!r}")
            if self.local_dir and self.incremental:
                raise ValueError("checkpoint.incremental=True and checkpoint.local_dir cannot go together: a step "
                                 "kept on the node only would reference objects in S3. Drop incremental to keep "
                                 "the local tier (or local_dir to save incrementally)")
            tier = {"s3_every": (self.s3_every, 1), "local_keep_last": (self.local_keep_last, 2),
                    "local_replicas": (self.local_replicas, 0)}
            if not self.local_dir and any(value != default for value, default in tier.values()):
                given = ", ".join(f"{k}={v}" for k, (v, default) in tier.items() if v != default)
                raise ValueError(f"checkpoint.{given} is a setting of the local tier: it needs checkpoint.local_dir "
                                 "(a directory of the node, e.g. /dev/shm/<run>)")
            self.last_save_in_hf = self.last_save_in_hf and not hf_out
            self.initial_load_in_hf = self.initial_load_in_hf and not hf_in
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf = self.last_save_in_hf or hf_out
                self.initial_load_in_hf = self.initial_load_in_hf or hf_in

    def __init__(self, config: Config, *, s3_config: S3Config | None = None, **components: Any) -> None:
        self._s3: _S3Manager | None = None
        self._s3_config = s3_config
        super().__init__(config, **components)
        if not self.enable:
            return
        if is_s3_uri(self.folder):
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:  # torchtitan waits for staging_completion
                s3_config = (s3_config or S3Config()).replace(staging="background")
            self._s3 = _S3Manager(
                self.folder, config=s3_config, keep_last=self.keep_latest_k or None,
                async_mode=self.async_mode != AsyncMode.DISABLED, process_group=self.pg,
                name_format=_STEP_NAME, incremental=config.incremental,
                **(dict(local_dir=config.local_dir, s3_every=config.s3_every, local_keep_last=config.local_keep_last,
                        local_replicas=config.local_replicas) if config.local_dir else {}))
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                self.stager = _PoolStaging()
            titan_log.info("s3dcp: checkpoints of %s are saved, kept (keep_latest_k=%d, counting committed ones) "
                           "and resumed through s3dcp%s", self.folder, self.keep_latest_k,
                           ", incrementally" if config.incremental else "")

    def _close(self) -> None:
        try:
            if self._s3 is not None:
                self._s3.close()  # the uploads in flight end (their error, if any, is raised)
        finally:
            super()._close()

    # ------------------------------------------------------------------ save
    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """torchtitan's save of one checkpoint: an ``s3://`` one goes through s3dcp (see the
        module docstring); returns what torchtitan expects for ``async_mode``."""
        if not is_s3_uri(checkpoint_id):
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if self._s3 is None or (step := self._step_of(checkpoint_id)) is None:
            raise ConfigError(f"{checkpoint_id} is not a step directory of checkpoint.folder {self.folder}")
        if to_hf:
            result = self._save_hf(state_dict, checkpoint_id)
        else:
            result = self._save_step(step, state_dict, async_mode)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _save_step(self, step: int, state_dict: dict[str, Any], async_mode: AsyncMode) -> Any:
        assert self._s3 is not None
        started = time.perf_counter()
        future = self._s3.save(step, state_dict)  # returns once staged (async) or committed (sync)
        returned = time.perf_counter()
        writer = self._s3.last_writer
        assert writer is not None
        if future is None:  # a synchronous manager: committed, retention done
            self._log_committed(step, writer, stall_s=returned - started)
            return None
        future.add_done_callback(lambda f: self._log_committed(step, writer, stall_s=returned - started, future=f))
        if async_mode == AsyncMode.DISABLED:  # torchtitan's last step is synchronous even in async mode
            future.result()
            return None
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:  # torchtitan waits for it before optimizers.step()
            return AsyncSaveResponse(staging_completion=future.staging_completion, upload_completion=future)
        return future

    def _log_committed(self, step: int, writer: S3StorageWriter, *, stall_s: float,
                       future: Future | None = None) -> None:
        if future is not None and future.exception() is not None:
            where = writer.checkpoint_id if writer.upload else f"the node ({writer.local_copy.root})"
            titan_log.error("s3dcp: checkpoint step %d to %s failed: %s", step, where, future.exception())
            return
        s = writer.last_stats
        stall = s.stage_s if self._s3 is not None and self._s3.async_mode else stall_s
        if not writer.upload:  # the local tier's step between two that go to S3: never read it as durable
            titan_log.info("s3dcp: checkpoint step %d kept on the node (%s), not in S3: this rank wrote "
                           "%.1f MB in %d object(s); training stalled %.3f s, write %.2f s", step,
                           writer.local_copy.root, s.bytes / 1e6, s.objects, stall, s.upload_s)
            return
        inherited = f", {s.inherited_bytes / 1e6:.1f} MB unchanged (referenced)" if s.inherited_items else ""
        kept = f" (and kept on the node, {writer.local_copy.root})" if writer.local_copy is not None else ""
        titan_log.info("s3dcp: checkpoint step %d committed to %s%s: this rank uploaded %.1f MB in %d object(s)%s; "
                       "training stalled %.3f s, upload %.2f s (%.2f GB/s)", step, writer.checkpoint_id, kept,
                       s.bytes / 1e6, s.objects, inherited, stall, s.upload_s, s.upload_gbps)

    def _save_hf(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """Last step with ``last_save_in_hf``: the model in the adapter's Hugging Face names as a
        DCP checkpoint in ``step-N/sharded``, then (rank 0) exported to safetensors files and
        ``model.safetensors.index.json`` in ``step-N``, as torchtitan lays out its own."""
        from ..saving.writer import S3StorageWriter
        from .export import export_safetensors

        assert self.sd_adapter is not None, "sd_adapter is required for last_save_in_hf"
        hf_state = self.sd_adapter.to_hf(state_dict)
        sharded = f"{checkpoint_id}/sharded"
        writer = S3StorageWriter(sharded, config=self._s3_config, overwrite=True)
        try:
            dcp.save(hf_state, storage_writer=writer, process_group=self.pg)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise unwrap_error(e)
        error: BaseException | None = None
        if dist.get_rank(self.pg) == 0:
            try:
                report = export_safetensors(sharded, checkpoint_id, config=self._s3_config, overwrite=True)
                titan_log.info("s3dcp: exported the last step to Hugging Face safetensors in %s: %d file(s), "
                               "%.1f MB", checkpoint_id, len(report.files), report.tensor_bytes / 1e6)
            except Exception as e:  # noqa: BLE001 - every rank raises, none hangs in the barrier
                error = e
        failed = [error is not None]
        dist.broadcast_object_list(failed, group_src=0, group=self.pg)
        if error is not None:
            raise error
        if failed[0]:
            raise RuntimeError(f"rank 0 failed to export {sharded} to Hugging Face safetensors in {checkpoint_id}")

    def _purge_stale_checkpoints(self) -> None:
        if self._s3 is None:
            super()._purge_stale_checkpoints()
        # s3:// folders: s3dcp's retention runs on the coordinator once each save has committed

    # ------------------------------------------------------------------ load
    def _find_load_step(self, folder: str = "") -> int:
        if self._s3 is None or (folder and folder != self.folder):
            return super()._find_load_step(folder)
        latest = self._s3.latest()  # collective: the coordinator lists, every rank gets its answer
        return -1 if latest is None else latest

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """torchtitan's load order, with ``s3://`` folders and initial paths through s3dcp:
        resume from the newest committed step of ``folder`` (or ``step``); else from
        ``initial_load_path`` (model only if ``initial_load_model_only``); else a fresh start."""
        initial = self.initial_load_path or ""
        if self._s3 is None and not is_s3_uri(initial):
            return super()._load(step)
        from torchtitan.tools import filesystem

        if self._s3 is not None and self._s3._tiers is not None:  # the local tier: the nearest copy
            loaded = self._load_nearest(step)
            if loaded:
                return True
            load_step = -1
        elif self._s3 is not None:
            load_step = self._find_load_step() if step == -1 else step
        else:
            has_folder = filesystem.exists(self.folder)
            if step != -1 and not has_folder:
                raise FileNotFoundError(f"--checkpoint.load_step={step} not found because "
                                        f"checkpoint.folder {self.folder} does not exist")
            load_step = (self._find_load_step() if step == -1 else step) if has_folder else -1

        from_hf = from_quantized = False
        if load_step != -1:  # resume: the initial_* options are ignored, as in torchtitan
            model_only = load_step == 0
            checkpoint_id = self._create_checkpoint_id(load_step)
        elif initial:
            model_only = self.initial_load_model_only
            from_hf, from_quantized = self.initial_load_in_hf, self.initial_load_in_hf_quantized
            checkpoint_id = initial
            if not is_s3_uri(initial) and not filesystem.isdir(initial):
                raise ValueError(f"Checkpoint.initial_load_path is invalid: {initial}")
        else:
            titan_log.info("No checkpoint was provided, this is a fresh start.")
            return False

        titan_log.info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        self.dcp_load(self._states_to_load(model_only), checkpoint_id=checkpoint_id, from_hf=from_hf,
                      from_quantized=from_quantized)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        titan_log.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _load_nearest(self, step: int) -> bool:
        """Resume through the manager's tiers (local copies, peers, S3); False: nothing to resume."""
        states: dict[int, dict] = {}

        def state_for(chosen: int) -> dict:  # step 0 is a seed checkpoint: the model only, as torchtitan loads it
            return states.setdefault(chosen, self._states_to_load(chosen == 0))

        begin = time.monotonic()
        try:
            loaded = self._s3.load(state_for, step=None if step == -1 else step)
        except CheckpointNotFoundError:
            if step != -1:
                raise
            return False
        if MODEL in self.states:  # torchtitan flattens the model's state into the loaded dict
            self.states[MODEL].load_state_dict(states[loaded])
        GarbageCollection.collect("GC collection for checkpoint loading.")
        titan_log.info("Loaded step %d from the %s tier in %.2f seconds (%s).", loaded, self._s3.last_load_stats["tier"],
                       time.monotonic() - begin, self._s3.last_load_stats["job_bytes"])
        return True

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """torchtitan's load of one checkpoint: ``s3://`` through s3dcp's readers (a missing or
        uncommitted checkpoint raises :class:`~s3dcp.errors.CheckpointNotFoundError`, a
        ``FileNotFoundError``, or :class:`~s3dcp.errors.IncompleteCheckpointError`)."""
        if not is_s3_uri(checkpoint_id):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        parse_s3_uri(checkpoint_id)  # a clear error for a malformed path
        if from_hf:
            from .safetensors_reader import S3SafetensorsReader

            if from_quantized:
                raise ConfigError(f"quantized Hugging Face checkpoints cannot be loaded from {checkpoint_id}")
            assert self.sd_adapter is not None, "loading Hugging Face safetensors needs sd_adapter"
            hf_state = self.sd_adapter.to_hf(state_dict)
            _dcp_load(hf_state, S3SafetensorsReader(checkpoint_id, config=self._s3_config), self.pg)
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state))
            return
        _dcp_load(state_dict, S3StorageReader(checkpoint_id, config=self._s3_config), self.pg)
        if MODEL in self.states:  # torchtitan flattens the model's state into the loaded dict
            self.states[MODEL].load_state_dict(state_dict)

    # ------------------------------------------------------------------ helpers
    def _step_of(self, checkpoint_id: str) -> int | None:
        m = re.fullmatch(re.escape(self.folder.rstrip("/")) + r"/step-(\d+)/?", checkpoint_id)
        return int(m.group(1)) if m else None


def _dcp_load(state_dict: dict[str, Any], reader: S3StorageReader, process_group: Any = None) -> None:
    """Load on the group the checkpoints are saved with (None: the default group)."""
    try:
        dcp.load(state_dict, storage_reader=reader, process_group=process_group)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise unwrap_error(e)  # chained from DCP's exception
