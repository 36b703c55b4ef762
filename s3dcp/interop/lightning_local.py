"""S3CheckpointIO's local tier: each Lightning checkpoint also kept in a directory of the node,
every ``s3_every``-th checkpoint step also sent to S3 (the others kept on the node only), and a
load served from the node's copy when it is complete, intact and the save S3 would give.

    <local_dir>/<checkpoint file name>/rank-0/   the objects, .metadata and the marker, as the
                                                 manager's local tier keeps them (format/local.py)
                                       .s3-save  a copy kept on the node only: the save of that
                                                 name S3 held when it was made (JSON; null: none)

    save    NodeTier.goes_to_s3(global_step), copy_for(uri) ─► the writer (upload or not)
            ─► committed(copy, metadata): .s3-save (node only), then the marker; one INFO line
    load    reader_for(uri): the complete copy, if S3 holds the save it was made beside
            (one GET of S3's .metadata) ─► S3CheckpointIO reads it, S3 otherwise
    remove  removed(uri): the copy goes (S3's by the caller)

Lightning saves through its CheckpointIO on global rank 0 alone, so one rank's copy is the
whole checkpoint. A name is saved again and again (``last.ckpt``), and another node may have
sent a newer save of it to S3 since this node's copy was made: a copy is loaded only while S3
holds the save it was made beside — its own (a checkpoint that went to S3 too), or the one S3
held when a node-only copy was made (none included). When S3 cannot be asked, the copy is
loaded, with a warning. Every item read from it is verified against its checksum.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._private_dir import private_dir
from ..errors import (CheckpointNotFoundError, ConfigError, IncompleteCheckpointError, MetadataFormatError,
                      S3ConnectionError)
from ..format.layout import METADATA_NAME
from ..format.local import LOCAL_METADATA_NAME
from ..lifecycle.holdings import scan
from ..loading.fetch import fetch_metadata_bytes
from ..loading.reader import S3StorageReader
from ..loading.tiered import TieredClient
from ..saving.local_copy import LocalCopy, remove_copy, write_private
from ..uri import object_key, parse_s3_uri

__all__ = ["NodeCopy", "NodeTier", "S3_SAVE_NAME"]

log = logging.getLogger("s3dcp")

S3_SAVE_NAME = ".s3-save"
_MAX_S3_SAVE_BYTES = 1024
_UNREADABLE = object()  # a node-only copy whose .s3-save is missing or not ours: never loaded


@dataclass
class NodeCopy:
    """A complete copy of one checkpoint on this node, ready to be read."""

    reader: S3StorageReader
    client: TieredClient  # its bytes per tier, once read
    dir: Path
    in_s3: bool  # the checkpoint went to S3 too
    s3_holds: Any  # the save S3 holds under its name: a save id, None (none), or _UNREADABLE (not asked)


class NodeTier:
    """Where S3CheckpointIO's checkpoints go and which copy a load reads (module docstring)."""

    def __init__(self, local_dir: str | os.PathLike, s3_every: int = 1) -> None:
        if not isinstance(s3_every, int) or isinstance(s3_every, bool) or s3_every < 1:
            raise ConfigError(f"s3_every={s3_every!r} must be an int >= 1: 1 sends every checkpoint to S3, K every "
                              "K-th checkpoint step (the first included); the others stay on the node only")
        self.dir = Path(private_dir(local_dir, what="local_dir", tighten=True))  # private to this user, or refused
        self.s3_every = s3_every
        self._lock = threading.Lock()
        self._last_step: Any = object()  # global_step of the last save (nothing equals it at first)
        self._steps = 0  # checkpoint steps saved by this plugin
        self._to_s3 = True
        self._in_s3: dict[str, str | None] = {}  # uri -> the save this plugin left in S3 under it (None: none)

    def goes_to_s3(self, step: int | None) -> bool:
        """Whether the checkpoint of Lightning's ``global_step`` ``step`` goes to S3: every
        ``s3_every``-th checkpoint step this plugin saves, the first included. Every file saved
        at one step goes alike (the top-k file and ``last.ckpt``); None: a step of its own."""
        with self._lock:
            if step is None or step != self._last_step:
                self._to_s3 = self._steps % self.s3_every == 0
                self._steps += 1
                self._last_step = step
            return self._to_s3

    def copy_for(self, uri: str, *, in_s3: bool) -> LocalCopy:
        """The copy a save of ``uri`` writes (``<local_dir>/<file name>/rank-0``): a local error
        fails the save only where the checkpoint is kept on the node alone (``in_s3`` False)."""
        return LocalCopy(self.dir, _name(uri), uri, _step(_name(uri)), required=not in_s3)

    def committed(self, copy: LocalCopy, metadata: Any, *, in_s3: bool, step: int | None) -> None:
        """The save of ``copy`` returned: a node-only copy records the save S3 holds under its
        name; then the copy is completed (metadata, then the marker) and the INFO line says
        where the checkpoint went."""
        from ..format.metadata import encode_metadata

        if copy.rank is None:  # written in DCP's process executor's child
            copy.rank = 0
        with self._lock:
            before = self._in_s3.get(copy.base)
        if not in_s3:  # before the marker: a complete copy always has it
            write_private(copy.dir / S3_SAVE_NAME, json.dumps({"s3_save_id": before}).encode())
        save_id = metadata.storage_meta.save_id
        marker = copy.prepare(encode_metadata(metadata), metadata.storage_data.values(), save_id=save_id,
                              world_size=1, in_s3=in_s3, saved_at=time.time())
        if marker is not None:  # one rank: nobody else to agree with
            copy.seal(marker)
        if copy.failure is not None:
            return  # said (a warning) by the copy; S3 holds the checkpoint
        if in_s3:
            with self._lock:
                self._in_s3[copy.base] = save_id
            log.info("checkpoint step %s committed to %s (and kept on the node, %s)", step, copy.base, copy.dir)
        else:
            log.info("checkpoint step %s kept on the node (%s), not in S3 (s3_every=%d)%s", step, copy.dir,
                     self.s3_every, f"; S3's {copy.base} is an earlier save" if before is not None else "")

    def removed(self, uri: str) -> None:
        """``uri`` is being deleted: its copy goes, and S3 holds none under its name."""
        remove_copy(self.dir / _name(uri) / "rank-0")  # the marker first: never read half deleted
        shutil.rmtree(self.dir / _name(uri), ignore_errors=True)
        with self._lock:
            self._in_s3[uri] = None

    def reader_for(self, uri: str, client: Any) -> NodeCopy | None:
        """This node's copy of ``uri`` when it is complete and S3 holds the save it was made
        beside (or cannot be asked); else None: S3's is loaded."""
        name = _name(uri)
        found = scan(self.dir, uri, lambda d: _step(name) if d == name else None).get((_step(name), 0))
        if found is None:
            return None
        marker, rank_dir = found
        beside = marker.save_id if marker.in_s3 else _s3_save_before(rank_dir)
        if beside is _UNREADABLE:
            return None
        try:
            held = _s3_save(client, uri)
        except S3ConnectionError as e:
            log.warning("could not ask S3 which save of %s it holds (%s); loading this node's copy %s, which a "
                        "newer save sent to S3 from elsewhere would have replaced", uri, e, rank_dir)
            held = _UNREADABLE
        else:
            if held != beside:
                log.info("this node's copy %s is not the save of %s that S3 holds now (saved since, from elsewhere):"
                         " loading S3's", rank_dir, uri)
                return None
        s3_uri = parse_s3_uri(uri)
        metadata = (rank_dir / LOCAL_METADATA_NAME).read_bytes()
        tiered = TieredClient(client, s3_uri.bucket, {n: object_key(s3_uri, n) for n in marker.objects}, metadata,
                              s3_uri.key(LOCAL_METADATA_NAME))
        for n in marker.objects:
            tiered.add_file(n, rank_dir / n)
        return NodeCopy(S3StorageReader(uri, config=client.config, client=tiered), tiered, rank_dir, marker.in_s3,
                        held)


def _name(uri: str) -> str:
    return uri.rstrip("/").rpartition("/")[2]


def _step(name: str) -> int:
    m = re.search(r"step=(\d+)", name)
    return int(m.group(1)) if m else 0


def _s3_save(client: Any, uri: str) -> str | None:
    """The save id of the checkpoint S3 holds at ``uri`` (None: none; "" for metadata that does
    not decode, which no copy's save id equals: S3's own load then says what is wrong)."""
    from ..format.metadata import decode_metadata

    s3_uri = parse_s3_uri(uri)
    try:
        data = fetch_metadata_bytes(client, s3_uri)  # throttling, 5xx and dropped connections retried
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return None
    try:
        storage = decode_metadata(data, source=str(s3_uri.child(METADATA_NAME))).storage_meta
    except MetadataFormatError:
        return ""
    return (storage.save_id or "") if storage is not None else ""


def _s3_save_before(rank_dir: Path) -> Any:
    """The save a node-only copy was made beside (its ``.s3-save``; untrusted: bounded, checked),
    or _UNREADABLE."""
    path = rank_dir / S3_SAVE_NAME
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_S3_SAVE_BYTES + 1)
        doc = json.loads(data) if len(data) <= _MAX_S3_SAVE_BYTES else None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        log.warning("local copy %s is kept on the node only and its %s is unreadable (%s); not used", rank_dir,
                    S3_SAVE_NAME, e)
        return _UNREADABLE
    value = doc.get("s3_save_id", _UNREADABLE) if isinstance(doc, dict) else _UNREADABLE
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 64):
        log.warning("local copy %s: its %s is not one s3dcp wrote; not used", rank_dir, S3_SAVE_NAME)
        return _UNREADABLE
    return value
