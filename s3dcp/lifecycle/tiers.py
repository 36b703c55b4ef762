"""Restart from the nearest copy: a CheckpointManager's local tier, peer replicas and S3.

    save(step), every rank:
      begin_save     every s3_every-th checkpoint also goes to S3 (the first one included);
                     room is made in local_dir (local_keep_last, local_budget_bytes)
      the writer     writes each object to local_dir/<step>/rank-<R>/ as it uploads it (or
                     instead: a local-only step), see saving/local_copy.py
      committed      the save returned on every rank: .metadata and the marker, last; the copy
                     is then sent to a peer node in the background (lifecycle/replicas.py);
                     older local copies beyond local_keep_last go
    load(), every rank:
      1. what each node holds (complete copies: marker, files at their sizes) and what S3 holds
      2. the newest step every saving rank's part of which is held somewhere: locally, by a
         peer node, or in S3 — the same step on every rank, never a mix
      3. dcp.load through loading/tiered.py: local files, objects sent by peers, the rest from
         S3, every item verified as it is read
      4. only if that fails a checksum: the nodes' copies of the step are checked (shared among
         each node's ranks); a corrupt one is named in the log and its objects come from the
         next tier (step 2 again, without it)

Owns the tier policy (which steps go where, what is kept, which step a restore takes, what is
intact); what a node's local_dir holds is lifecycle/holdings.py's, the files
saving/local_copy.py's, the transfers lifecycle/replicas.py's and loading/tiered.py's. What it
cannot survive: a node lost together with the node holding its replicas, for a step not in S3
(the restore then takes an older step).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointNotFoundError, ConfigError, MetadataFormatError, PeerReadError
from ..format.local import LOCAL_METADATA_NAME, rank_dir_name
from ..saving.local_copy import LocalCopy
from ..uri import S3Uri
from .holdings import check_copy, choose_step, entries, scan

__all__ = ["LocalTier", "choose_step", "scan"]

log = logging.getLogger("s3dcp")


class LocalTier:
    """The local (and peer) tier of one CheckpointManager (see the module docstring)."""

    def __init__(self, local_dir: str | os.PathLike, *, base: S3Uri, name: Callable[[int], str],
                 step_of: Callable[[str], int | None], s3_every: int = 1, keep_last: int = 2,
                 budget_bytes: int | None = None, replicas: int = 0, process_group: Any = None) -> None:
        for field, value, low in (("s3_every", s3_every, 1), ("local_keep_last", keep_last, 1),
                                  ("local_replicas", replicas, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{field}={value!r} must be an int >= {low}")
        if replicas > 1:
            raise ConfigError(f"local_replicas={replicas}: one replica per copy is supported (0 or 1)")
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise ConfigError(f"local_budget_bytes={budget_bytes!r} must be a positive int or None")
        self.dir = Path(local_dir)
        self.base, self.name, self.step_of = base, name, step_of
        self.s3_every, self.keep_last, self.budget_bytes = s3_every, keep_last, budget_bytes
        self.replicas_wanted = replicas
        self.process_group = process_group
        self.replicas = None  # lifecycle.replicas.Replicas, made at the first save (collective)
        self._saves = 0
        self._writing: set[int] = set()  # steps whose copy is being written: never retained away
        # held while retention decides and deletes, and while a step starts or stops being
        # written: a save's commit (on an upload thread) retains while the next save begins
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ save
    def begin_save(self, step: int, state_dict: dict) -> tuple[LocalCopy, bool]:
        """The local copy for ``step`` and whether it also goes to S3. Room is made for it now;
        where there is none, the copy carries the refusal, raised in write_data so every rank
        fails the save together (DCP spreads the error) instead of one leaving the others
        waiting in a collective."""
        to_s3 = self._saves % self.s3_every == 0
        self._saves += 1
        if self.replicas_wanted and self.replicas is None and _dist_on():
            from .replicas import Replicas

            self.replicas = Replicas(self.process_group)
        from ..saving.statetree import tensors

        copy = LocalCopy(self.dir, self.name(step), str(self.base), step)
        with self._lock:
            self._writing.add(step)  # before any retention can list its directory
            try:
                self._make_room(step, sum(t.nbytes for t in tensors(state_dict)))
            except ConfigError as e:
                copy.refusal = e
        return copy, to_s3

    def failed(self, copy: LocalCopy) -> None:
        """The save of ``copy``'s step failed: its copy goes."""
        with self._lock:
            self._writing.discard(copy.step)
            copy.discard()

    def committed(self, step: int, copy: LocalCopy, *, metadata: Any, in_s3: bool) -> None:
        """The save of ``step`` returned on this rank (``metadata``: DCP's, every rank gets it):
        complete the copy, replicate, retain."""
        from ..format.metadata import encode_metadata

        if copy.rank is None:  # written by DCP's process executor's child: this rank's, as DCP numbers it
            copy.rank = _rank(self.process_group)
        copy.commit(encode_metadata(metadata), save_id=metadata.storage_meta.save_id,
                    world_size=_world(self.process_group) if _dist_on() else 1, in_s3=in_s3)
        with self._lock:
            self._writing.discard(step)
            if self.replicas is not None:
                self.replicas.submit(copy.root, copy.rank)
            self._retain(keep={step})

    def wait(self) -> None:
        """Every replication so far done (raising its error, once)."""
        if self.replicas is not None:
            self.replicas.wait()

    def _own_dirs(self, step_dir: Path) -> list[Path]:
        """This rank's copies in a step's directory: its own and the replicas it received."""
        mine = {_rank(self.process_group)} | set(self.replicas.source_ranks if self.replicas is not None else ())
        return [step_dir / rank_dir_name(r) for r in sorted(mine) if (step_dir / rank_dir_name(r)).is_dir()]

    def _steps(self) -> list[tuple[int, Path]]:
        return sorted((s, d) for d in entries(self.dir) if (s := self.step_of(d.name)) is not None)

    def _usage(self) -> dict[int, int]:
        """Bytes of this rank's copies, by step (a replica being received counts as far as it is)."""
        return {step: sum(_size(f) for d in self._own_dirs(step_dir) for f in entries(d))
                for step, step_dir in self._steps()}

    def _retain(self, keep: set[int] = frozenset(), room_for: int = 0) -> None:
        """Delete this rank's copies beyond the newest ``keep_last`` complete steps, and older
        ones still while ``room_for`` more bytes would not fit the budget; never one in ``keep``,
        nor the newest complete step, nor one being written or replicated."""
        with self._lock:
            self._retain_locked(keep, room_for)

    def _retain_locked(self, keep: set[int], room_for: int) -> None:
        complete = sorted({s for (s, r) in scan(self.dir, str(self.base), self.step_of)
                           if r == _rank(self.process_group)})
        busy = self._writing | self._replicating()
        kept = set(complete[-self.keep_last:]) | set(keep) | set(complete[-1:]) | busy
        usage = self._usage()
        for step, step_dir in self._steps():
            over = self.budget_bytes is not None and sum(usage.values()) + room_for > self.budget_bytes
            newest = complete[-1] if complete else None
            if step in kept and not (over and step not in keep | busy and step != newest):
                continue
            for d in self._own_dirs(step_dir):
                shutil.rmtree(d, ignore_errors=True)
            usage.pop(step, None)
            try:
                step_dir.rmdir()
            except OSError:
                pass

    def _replicating(self) -> set[int]:
        """Steps whose copies are still being sent to, or received from, a peer."""
        if self.replicas is None:
            return set()
        return {s for root in self.replicas.pending() if (s := self.step_of(root.name)) is not None}

    def _make_room(self, step: int, nbytes: int) -> None:
        need = nbytes * (2 if self.replicas is not None and self.replicas.active else 1)
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise ConfigError(
                f"local_budget_bytes={self.budget_bytes} cannot hold checkpoint step {step}: this rank's "
                f"copy{' and the replica it holds' if need > nbytes else ''} take {need} bytes; raise it")
        self._retain(room_for=need)
        if self.budget_bytes is not None:
            used = sum(self._usage().values())
            if used + need > self.budget_bytes:
                raise ConfigError(
                    f"local_budget_bytes={self.budget_bytes} cannot hold checkpoint step {step} ({need} bytes) "
                    f"beside the newest complete local copy ({used} bytes, kept for a restart); raise the "
                    "budget or checkpoint less state")
        self.dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.dir).free
        if free < need:
            raise ConfigError(f"local_dir {self.dir} has {free} bytes free; checkpoint step {step} needs {need} "
                              "(a tmpfs such as /dev/shm: its size, or a container's --shm-size)")

    # ------------------------------------------------------------------ restore
    def restore(self, manager: Any, state_dict: dict | Callable[[int], dict],
                step: int | None = None) -> tuple[int, dict]:
        """Load the newest step the tiers hold in full (or ``step``) into ``state_dict`` (or the
        dict it gives for that step, where it is a function); return it and the load's figures
        (see :attr:`CheckpointManager.last_load_stats`).

        Every item is verified against its checksum as it is read, whatever the tier. Only when
        a load fails so (an ``IntegrityError`` on some rank: every rank hears of it through
        DCP) are the nodes' copies of the step checked, each node's by its ranks, and the load
        is made again without the corrupt ones (named in the log) — no second pass over the
        bytes when the copies are intact."""
        from ..errors import IntegrityError, unwrap_error
        from ..loading.cooperative import node_name

        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - a replica it left incomplete has no marker: not used
            log.warning("a replication before this restore failed (%s); its copies are not used", e)
        group, dist_on = self.process_group, _dist_on()
        me = _rank(group) if dist_on else 0

        def survey():
            here = scan(self.dir, str(self.base), self.step_of)
            s3_steps = {info.step for info in manager.list() if info.committed} if me == 0 else set()
            return here, s3_steps

        here, s3_steps = _together(survey, group, dist_on)
        mine = {key: (m.save_id, m.world_size, tuple(sorted(m.objects))) for key, (m, _) in here.items()}
        report = (node_name(), mine, sorted(s3_steps))
        reports = _gather(report, group) if dist_on else [report]
        nodes = [r[0] for r in reports]
        in_s3 = set(reports[0][2])
        excluded: set = set()  # (node, step, saving rank) of the copies found corrupt
        checked: set[int] = set()  # steps whose copies were checked
        while True:
            chosen = choose_step([(r[0], r[1]) for r in reports], in_s3, wanted=step, excluded=frozenset(excluded))
            if chosen is None:
                raise CheckpointNotFoundError(
                    f"no checkpoint{'' if step is None else f' at step {step}'} of {self.base} is held in full by "
                    f"the local copies ({self.dir} on each node), their replicas or S3")
            try:
                return chosen, self._load_step(manager, state_dict, chosen, reports, here, excluded, in_s3)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                failure = unwrap_error(e)
                failures = getattr(failure, "rank_errors", None) or {me: failure}
                if chosen in checked or not any(isinstance(f, IntegrityError) for f in failures.values()):
                    raise
            checked.add(chosen)
            bad = _together(lambda: self._check_node(chosen, here, excluded, nodes, me), group, dist_on)
            found = set().union(*_gather(bad, group)) if dist_on else bad
            if not found - excluded:  # no local copy is to blame: the bytes came from S3 or a peer
                raise failure
            excluded |= found

    def _check_node(self, step: int, here: dict, excluded: set, nodes: list[str], me: int) -> set:
        """(node, step, saving rank) of this node's copies of ``step`` this rank checks (the node's
        ranks share them) that fail their checksums."""
        gone = {(s, r) for n, s, r in excluded if n == nodes[me]}
        metadata = _local_metadata(here, step, gone)
        if metadata is None:
            return set()
        locations = metadata[1].storage_data.values()
        peers = [r for r, n in enumerate(nodes) if n == nodes[me]]
        intact = {k: v for k, v in here.items() if k not in gone}
        return {(nodes[me], s, r) for s, r in
                self.verify(step, intact, lambda rank: rank % len(peers) == peers.index(me), locations)}

    def _load_step(self, manager: Any, state_dict: dict, chosen: int, reports: list, here: dict, excluded: set,
                   in_s3: set) -> dict:
        """dcp.load of step ``chosen`` from the nearest copies; the load's figures."""
        import torch.distributed.checkpoint as dcp

        from .._dcp_warning import ours
        from ..loading.tiered import TieredClient, TieredReader
        from ..uri import object_key

        group, dist_on = self.process_group, _dist_on()
        nodes = [r[0] for r in reports]
        me = _rank(group) if dist_on else 0
        gone = {(s, r) for n, s, r in excluded if n == nodes[me]}  # this node's corrupt copies
        uri = self.base.child(self.name(chosen))

        def local_metadata() -> tuple[bytes | None, set[str] | None]:
            found = _local_metadata(here, chosen, gone)
            return (None, None) if found is None else (found[0], _object_names(found[1]))

        # the metadata: a copy on this node, else S3's, else sent by a rank whose node has one
        metadata_bytes, names = _together(local_metadata, group, dist_on)
        if dist_on:
            have = _gather(metadata_bytes is not None, group)
            if not all(have) and chosen not in in_s3:
                import torch.distributed as dist

                box = [metadata_bytes]
                dist.broadcast_object_list(box, group_src=have.index(True), group=group)
                metadata_bytes = box[0]
        if names is None:
            def other_metadata() -> tuple[bytes, set[str]]:
                from ..format.metadata import decode_metadata
                from ..loading.fetch import fetch_metadata_bytes

                data = metadata_bytes if metadata_bytes is not None else fetch_metadata_bytes(manager.client, uri)
                return data, _object_names(decode_metadata(data, source=str(uri)))

            metadata_bytes, names = _together(other_metadata, group, dist_on)
        else:
            _together(lambda: None, group, dist_on)  # the ranks that fetch may fail: every rank hears of it
        holders: dict[str, set[int]] = {}  # object -> ranks whose node holds an intact copy of it
        for rank, (_, report, _) in enumerate(reports):
            for (s, saver), (_, _, objects) in report.items():
                if s == chosen and (nodes[rank], s, saver) not in excluded:
                    for name in objects:
                        holders.setdefault(name, set()).add(rank)
        # only this save's objects (their names carry its id): a stale copy of another save of
        # the same step, left on a node, is not read
        local_paths = {name: rank_dir / name for (s, saver), (marker, rank_dir) in here.items()
                       if s == chosen and (s, saver) not in gone for name in marker.objects if name in names}
        client = TieredClient(manager.client, uri.bucket, {n: object_key(uri, n) for n in names}, metadata_bytes,
                              uri.key(LOCAL_METADATA_NAME))
        try:
            reader = ours(TieredReader(str(uri), client=client, holders=holders, node_of=nodes,
                                       local_paths=local_paths, process_group=group))
            state = state_dict(chosen) if callable(state_dict) else state_dict  # see CheckpointManager.load
            dcp.load(state, storage_reader=reader, process_group=group, no_dist=not dist_on)
        finally:
            client.close()
        mine_bytes = dict(client.bytes)
        totals = _gather(mine_bytes, group) if dist_on else [mine_bytes]
        job = {tier: sum(t[tier] for t in totals) for tier in ("local", "peer", "s3")}
        farthest = "s3" if job["s3"] else "peer" if job["peer"] else "local"
        return {"step": chosen, "tier": farthest, "local_bytes": mine_bytes["local"],
                "peer_bytes": mine_bytes["peer"], "s3_bytes": mine_bytes["s3"], "job_bytes": job,
                "corrupt_copies": sorted([s, r] for _, s, r in excluded)}

    def verify(self, step: int, copies: dict, share: Callable[[int], bool], locations) -> set[tuple[int, int]]:
        """(step, saving rank) of this node's copies of ``step`` (those ``share`` gives this rank)
        whose bytes do not match the item checksums; each is named in the log."""
        bad = set()
        for (s, rank), (marker, rank_dir) in sorted(copies.items()):
            if s != step or not share(rank):
                continue
            problem = check_copy(rank_dir, marker, locations)
            if problem is not None:
                log.warning("local copy %s of step %d is corrupt (%s): its objects come from the next tier",
                            rank_dir, step, problem)
                bad.add((s, rank))
        return bad


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # deleted meanwhile
        return 0


def _local_metadata(here: dict, step: int, excluded: set) -> tuple[bytes, Any] | None:
    """The bytes of a .metadata of ``step`` on this node and DCP's Metadata decoded from them
    (from the first copy whose file decodes: one that does not is named in the log and the next
    is tried; they all hold the save's one metadata), or None."""
    from ..format.metadata import decode_metadata

    for (s, rank), (_, rank_dir) in sorted(here.items()):
        if s == step and (s, rank) not in excluded:
            path = rank_dir / LOCAL_METADATA_NAME
            data = path.read_bytes()
            try:
                return data, decode_metadata(data, source=str(path))
            except MetadataFormatError as e:
                log.warning("local copy %s: its %s is unreadable (%s); not used", rank_dir, LOCAL_METADATA_NAME, e)
    return None


def _object_names(metadata) -> set[str]:
    """The objects DCP's ``metadata`` names."""
    return {loc.object_name for loc in metadata.storage_data.values()}


def _together(step: Callable[[], Any], group: Any, dist_on: bool) -> Any:
    """``step()``'s value on every rank, or, where it raised on any rank, an error on every rank:
    its own on the rank that failed, :class:`PeerReadError` naming that rank on the others (one
    rank failing alone before a collective would leave the others waiting in it)."""
    try:
        value, error = step(), None
    except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
        value, error = None, e
    if dist_on:
        said = _gather(None if error is None else f"{type(error).__name__}: {error}", group)
        failed = [r for r, text in enumerate(said) if text is not None]
        if failed and error is None:
            raise PeerReadError(f"the restore stopped: rank {failed[0]} failed: {said[failed[0]]}", failed)
    if error is not None:
        raise error
    return value


def _gather(value: Any, group: Any) -> list:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _dist_on() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank(group: Any = None) -> int:
    if not _dist_on():
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)
