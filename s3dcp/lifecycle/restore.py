"""A restore through the tiers (``CheckpointManager.load`` with a local_dir), every rank:

    1. survey      each rank scans its node's local_dir (complete copies: marker, files at their
                   sizes); the coordinator lists S3's committed steps and reads the .metadata of
                   the one S3 would give (its save id: S3's save is that step's truth). S3
                   unreachable: the restore goes on from the nodes, with a warning (where they
                   hold nothing complete: S3's error, never CheckpointNotFoundError)
    2. choose      one save (step and save id), the same on every rank (holdings.choose_save):
                   the newest step the tiers together hold in full; stale copies are named once
    3. metadata    S3's where S3 committed the save (a node's copy of it is never trusted over
                   S3's), else a node's copy of that very save (sent by a rank that has one);
                   none readable on any node: that save's copies are left out, and 2 runs again
    4. dcp.load    through loading/tiered.py: this node's files of that save, objects sent by
                   peers, the rest from S3; every item verified against its checksum
    5. only if that fails a checksum: the nodes' copies of the save are checked (each node's by
                   its ranks), a corrupt one is named in the log, and 2-4 run again without it

Every collective here and in the transfers is bounded by a liveness watch: a rank that fails
makes every rank raise (its own error there, PeerReadError elsewhere) and a rank that dies ends
the others' restore within seconds, not at the group's timeout.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

from ..errors import (UNREACHABLE, CheckpointNotFoundError, IntegrityError, MetadataFormatError, PeerReadError,
                      S3ConnectionError, unwrap_error)
from ..format.local import LOCAL_METADATA_NAME, rank_dir_name
from ..loading.cooperative import node_name
from ..loading.liveness import Watch, attempt, broadcast_bytes, gather_objects
from .holdings import Choice, S3View, check_copy, choose_save, held, scan

__all__ = ["from_s3", "restore"]

log = logging.getLogger("s3dcp")

_restores = itertools.count()  # this process's restores: every rank counts the same


class _Job:
    """The restore's collectives over ``group`` (None: no torch.distributed), each bounded;
    ``also``: the groups of DCP's collectives that follow (their timeout shortened when it breaks)."""

    def __init__(self, group: Any, dist_on: bool, also: tuple = ()) -> None:
        self.group, self.on = group, dist_on
        self.rank = 0
        self.watch = None
        self._loads = itertools.count()  # the dcp.loads of this restore: every rank counts the same
        if dist_on:
            import torch.distributed as dist

            self.rank = dist.get_rank(group)
            self.key = f"s3dcp/restore/{attempt()}/{next(_restores)}"  # the same on every rank
            self.watch = Watch(group, f"{self.key}/broken", "restore", also=also)

    def transfers_key(self) -> str:
        """The store key of the next load's transfers watch: the same on every rank (a key that
        differed would tell no other rank that this one broke)."""
        return f"{self.key}/tiered/{next(self._loads)}/broken" if self.on else "s3dcp/tiered/broken"

    def gather(self, value: Any) -> list:
        return self._guard(lambda: gather_objects(value, self.group, self.watch)) if self.on else [value]

    def together(self, step: Callable[[], Any]) -> list:
        """Every rank's ``step()``, or, where it raised on any rank, an error on every rank: its
        own on the rank that failed, PeerReadError naming that rank on the others."""
        try:
            said = ("ok", step())
        except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
            said, error = ("error", f"{type(e).__name__}: {e}"), e
        every = self.gather(said)
        if said[0] == "error":
            raise error
        failed = [r for r, (kind, _) in enumerate(every) if kind == "error"]
        if failed:
            raise PeerReadError(f"the restore stopped: rank {failed[0]} failed: {every[failed[0]][1]}", failed)
        return [value for _, value in every]

    def broadcast(self, data: bytes | None, src: int) -> bytes:
        return self._guard(lambda: broadcast_bytes(data, src, self.group, self.watch)) if self.on else data

    def _guard(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except BaseException as e:
            self.watch.broke(e)
            raise


def restore(tier: Any, manager: Any, state_dict: dict | Callable[[int], dict],
            step: int | None = None) -> tuple[int, dict]:
    """Load the save the tiers hold in full (the newest, or of ``step``) into ``state_dict`` (or
    the dict it gives for that step); return the step and the load's figures (see
    :attr:`CheckpointManager.last_load_stats`)."""
    started = time.perf_counter()
    sync = tier.job()  # its gloo group: the job's own may be NCCL's, which carries no CPU tensors
    job = _Job(sync.group if sync is not None else None, sync is not None, also=(tier.process_group,))
    me, base = job.rank, str(tier.base)

    s3_metadata: list = [None]  # the coordinator's: the .metadata of the step S3 would give

    def survey():
        s3 = None
        if me == 0:
            view, s3_metadata[0], problem = _s3_survey(manager, tier, step)
            s3 = (view, problem)
        return node_name(), {key: marker for key, (marker, _) in scan(tier.dir, base, tier.step_of).items()}, s3

    reports = job.together(survey)
    s3_view, s3_problem = reports[0][2]  # s3_problem: (the error's type name, why) when S3 could not be consulted
    # this node's copies, as all its ranks found them (one rank's scan may run before another
    # rank of the node sealed its copy of the save it just made): (step, saving rank) -> (marker, dir)
    here = {key: (marker, tier.dir / tier.name(key[0]) / rank_dir_name(key[1]))
            for node, report, _ in reports if node == reports[me][0] for key, marker in report.items()}
    if s3_problem is not None:
        log.warning("restoring from the nodes' copies without S3, which could not be consulted (%s): a step "
                    "committed to S3 after the nodes' newest copy, or a step deleted from S3, is not seen",
                    s3_problem[1])
    nodes = [r[0] for r in reports]
    markers = [(r[0], r[1]) for r in reports]
    excluded: set = set()  # (node, step, saving rank) of the copies found corrupt
    checked: set = set()
    while True:
        choice = choose_save(markers, s3_view, wanted=step, excluded=frozenset(excluded))
        if choice is None and s3_view is None:  # not "not found": S3 may hold it (resuming from 0 would lose it)
            raise _outage(s3_problem, f"the nodes hold no complete save{'' if step is None else f' of step {step}'} "
                                      f"of {base} in {tier.dir}, and S3 could not be consulted")
        if choice is None:
            raise CheckpointNotFoundError(
                f"no checkpoint{'' if step is None else f' at step {step}'} of {base} is held in full by the "
                f"local copies ({tier.dir} on each node), their replicas or S3: {held(markers, s3_view)}")
        if me == 0 and choice.ignored and not excluded:
            node, s, rank, why = choice.ignored[0]
            log.warning("restoring step %d (save %s): %d copie(s) on the nodes are not used, e.g. %s's of rank %d: "
                        "%s; retention removes them", choice.step, choice.save_id or "?", len(choice.ignored), node,
                        rank, why)
        used: dict = {}  # the metadata the load went by: the copies are checked against it
        try:
            stats = _load(tier, manager, state_dict, job, choice, nodes, markers, here, excluded,
                          s3_metadata[0] if choice.in_s3 else None, used)
        except _NoMetadata as e:  # every rank: no copy of the save is of use, so another save is chosen
            if me == 0:
                log.warning("%s: its copies are not used", e)
            excluded |= {(node, s, rank) for node, report in markers for (s, rank), m in report.items()
                         if s == choice.step and m.save_id == choice.save_id}
            continue
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failure = unwrap_error(e)
            failures = getattr(failure, "rank_errors", None) or {me: failure}
            if choice.step in checked or not any(isinstance(f, IntegrityError) for f in failures.values()):
                raise
        else:
            stats["seconds"] = round(time.perf_counter() - started, 3)
            log.info("restored step %d (save %s) from %s: %d bytes from the node's copies, %d from peers, %d from "
                     "S3 on this rank (job: %s) in %.2f s", choice.step, choice.save_id or "?", stats["tier"],
                     stats["local_bytes"], stats["peer_bytes"], stats["s3_bytes"], stats["job_bytes"],
                     stats["seconds"])
            return choice.step, stats
        checked.add(choice.step)
        mine = job.together(lambda: _check_node(choice, here, excluded, nodes, me, used.get("metadata")))
        found = set().union(*mine)
        if not found - excluded:  # no local copy is to blame: the bytes came from S3 or a peer
            raise failure
        excluded |= found


class _NoMetadata(Exception):
    """No node's copy of the chosen save has a readable .metadata (one not fsynced, say, after a
    power loss), and S3 did not commit the save: its copies are of no use."""


def _outage(problem: tuple[str, str], what: str) -> Exception:
    """The error for ``what`` where S3 could not be consulted (``problem``: the coordinator's
    error's type name and text): of that type (an S3ConnectionError where it is none of
    UNREACHABLE's), never a CheckpointNotFoundError."""
    kind = {cls.__name__: cls for cls in UNREACHABLE}.get(problem[0], S3ConnectionError)
    return kind(f"{what} ({problem[1]}); restore again once S3 answers")


def _s3_survey(manager: Any, tier: Any, wanted: int | None) -> tuple[S3View | None, bytes | None, tuple | None]:
    """What S3 holds: (view, the .metadata bytes of the step S3 would give, None), or (None, None,
    (the error's type name, why)) when S3 cannot be reached; other errors (a refusal, a missing
    bucket) are raised."""
    from ..format.metadata import decode_metadata
    from ..loading.fetch import fetch_metadata_bytes

    try:
        committed = frozenset(info.step for info in manager.list() if info.committed)
        target = wanted if wanted in committed else max(committed) if committed and wanted is None else None
        if target is None:
            return S3View(committed), None, None
        uri = tier.base.child(tier.name(target))
        data = fetch_metadata_bytes(manager.client, uri)
    except UNREACHABLE as e:
        return None, None, (type(e).__name__, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    metadata = decode_metadata(data, source=str(uri))
    return S3View(committed, {target: getattr(metadata.storage_meta, "save_id", "") or ""}), data, None


def _load(tier: Any, manager: Any, state_dict: Any, job: _Job, choice: Choice, nodes: list, markers: list,
          here: dict, excluded: set, s3_metadata: bytes | None, used: dict) -> dict:
    """dcp.load of the chosen save from the nearest copies (``used["metadata"]``: the metadata it
    goes by); the load's figures."""
    import torch.distributed.checkpoint as dcp

    from .._dcp_warning import ours
    from ..format.metadata import decode_metadata
    from ..loading.tiered import TieredClient, TieredReader
    from ..uri import object_key

    me = job.rank
    uri = tier.base.child(tier.name(choice.step))
    gone = {(s, r) for n, s, r in excluded if n == nodes[me]}  # this node's corrupt copies
    mine = {(s, r): (m, d) for (s, r), (m, d) in here.items()
            if s == choice.step and m.save_id == choice.save_id and (s, r) not in gone}

    if choice.in_s3:  # S3's own: the coordinator read it (the step S3 gives is the one S3 can be chosen for)
        data = job.broadcast(s3_metadata, 0)
    else:  # a copy of this save on a node: this node's, or sent by a rank whose node has one
        data = _local_metadata(mine, choice)
        have = job.gather(data is not None)
        if not all(have):
            if not any(have):  # on every rank (each heard every rank's): the restore chooses again
                raise _NoMetadata(f"no node holds a readable {LOCAL_METADATA_NAME} of {uri} (save "
                                  f"{choice.save_id}), and S3 did not commit it")
            data = job.broadcast(data, have.index(True))
    metadata = decode_metadata(data, source=str(uri))
    used["metadata"] = metadata
    if choice.save_id and (getattr(metadata.storage_meta, "save_id", "") or "") != choice.save_id:
        raise MetadataFormatError(f"{uri}: its metadata is of save {metadata.storage_meta.save_id!r}, not of the "
                                  f"save {choice.save_id!r} chosen")
    names = {loc.object_name for loc in metadata.storage_data.values()}
    holders: dict[str, set[int]] = {}  # object -> ranks whose node holds an intact copy of it, of this save
    for rank, (node, report) in enumerate(markers):
        for (s, saver), marker in report.items():
            if s == choice.step and marker.save_id == choice.save_id and (node, s, saver) not in excluded:
                for name in marker.objects:
                    if name in names:
                        holders.setdefault(name, set()).add(rank)
    local_paths = {name: rank_dir / name for marker, rank_dir in mine.values() for name in marker.objects
                   if name in names}
    client = TieredClient(manager.client, uri.bucket, {n: object_key(uri, n) for n in names}, data,
                          uri.key(LOCAL_METADATA_NAME))
    try:
        reader = ours(TieredReader(str(uri), client=client, holders=holders, node_of=nodes, local_paths=local_paths,
                                   process_group=tier.process_group, transfer_group=job.group,
                                   watch_key=job.transfers_key()))
        state = state_dict(choice.step) if callable(state_dict) else state_dict  # see CheckpointManager.load
        dcp.load(state, storage_reader=reader, process_group=tier.process_group, no_dist=not job.on)
    finally:
        client.close()
    mine_bytes = dict(client.bytes)
    totals = job.gather(mine_bytes)
    job_bytes = {t: sum(b[t] for b in totals) for t in ("local", "peer", "s3")}
    farthest = "s3" if job_bytes["s3"] else "peer" if job_bytes["peer"] else "local"
    return {"step": choice.step, "save_id": choice.save_id, "tier": farthest, "local_bytes": mine_bytes["local"],
            "peer_bytes": mine_bytes["peer"], "s3_bytes": mine_bytes["s3"], "job_bytes": job_bytes,
            "corrupt_copies": sorted([s, r] for _, s, r in excluded)}


def _local_metadata(copies: dict, choice: Choice) -> bytes | None:
    """The bytes of a .metadata of the chosen save on this node (from the first copy whose file
    decodes and names that save: one that does not is named in the log and the next is tried),
    or None."""
    from ..format.metadata import decode_metadata

    for (_, rank), (_, rank_dir) in sorted(copies.items()):
        path = rank_dir / LOCAL_METADATA_NAME
        try:
            data = path.read_bytes()
            decoded = decode_metadata(data, source=str(path))
        except (MetadataFormatError, OSError) as e:
            log.warning("local copy %s: its %s is unreadable (%s); not used", rank_dir, LOCAL_METADATA_NAME, e)
            continue
        if (getattr(decoded.storage_meta, "save_id", "") or "") == choice.save_id:
            return data
        log.warning("local copy %s: its %s is of another save than its marker; not used", rank_dir,
                    LOCAL_METADATA_NAME)
    return None


def _check_node(choice: Choice, here: dict, excluded: set, nodes: list[str], me: int, metadata: Any) -> set:
    """(node, step, saving rank) of this node's copies of the chosen save this rank checks (the
    node's ranks share them) that fail the checksums of ``metadata`` (the load's: S3's where S3
    committed the save, so a copy consistent only with its own .metadata fails too)."""
    gone = {(s, r) for n, s, r in excluded if n == nodes[me]}
    copies = {k: v for k, v in here.items() if k[0] == choice.step and v[0].save_id == choice.save_id and k not in gone}
    if metadata is None:
        return set()
    locations = list(metadata.storage_data.values())
    peers = [r for r, n in enumerate(nodes) if n == nodes[me]]
    bad = set()
    for (s, rank), (marker, rank_dir) in sorted(copies.items()):
        if rank % len(peers) != peers.index(me):
            continue
        problem = check_copy(rank_dir, marker, locations)
        if problem is not None:
            log.warning("local copy %s of step %d is corrupt (%s): its objects come from the next tier", rank_dir,
                        s, problem)
            bad.add((nodes[me], s, rank))
    return bad


def from_s3(manager: Any, state_dict: dict | Callable[[int], dict], step: int | None) -> int:
    """CheckpointManager.load without a local tier: checkpoint ``step`` (default: the newest
    committed) read from S3 into ``state_dict`` (or the dict it gives for that step); the step."""
    import torch.distributed.checkpoint as dcp

    from .._dcp_warning import ours
    from ..format.layout import METADATA_NAME
    from ..loading.reader import S3StorageReader

    if step is None:
        step = manager.latest()
        if step is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {manager.base} (no directory matching "
                f"{manager.name_format!r} holds a {METADATA_NAME}); nothing to resume from")
    else:
        manager._saves.drain()  # no DCP collective of ours may run beside a save's
    reader = ours(S3StorageReader(manager.uri(step), config=manager.config, client=manager.client))
    state_dict = state_dict(step) if callable(state_dict) else state_dict
    started = time.perf_counter()
    dcp.load(state_dict, storage_reader=reader, process_group=manager.process_group, no_dist=not _dist_on())
    if manager._is_coordinator():  # the restore's one INFO line (with local_dir: restore()'s)
        log.info("restored step %d from %s: %d bytes from S3 on this rank in %.2f s", step, manager.uri(step),
                 reader.last_read_bytes or 0, time.perf_counter() - started)
    return step


def _dist_on() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
