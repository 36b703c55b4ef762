"""Incremental checkpoints: unchanged items are references into a sibling checkpoint.

    base (a committed sibling, e.g. run/step-1000) ──.metadata──► BaseIndex: per item (FQN +
        chunk offsets) its object, byte range, length, dtype, shape and CRC64NVME
    write_data, per rank, per staged item ──crc64nvme──► same item, length, dtype, shape, CRC?
        ├─ yes: ItemLocation(object_name="../step-1000/__0_0.<save id>.distcp", the base's range)
        │       — nothing uploaded; a reference the base held is copied as is (no chains)
        └─ no:  uploaded as in a full save
    commit (coordinator): marker, base unchanged, every referenced object there at the size
        the base records (one LIST per referenced directory), then .metadata as always (below)

References are plain object names relative to the checkpoint directory, so the metadata format
does not change: ``"__0_0.tok.distcp"`` is the checkpoint's own object, ``"../<sibling>/<name>"``
one of a sibling under the same parent prefix (:func:`s3dcp.uri.object_key` resolves and
polices them). Loading an incremental checkpoint reads exactly the bytes a full one would,
only from other keys, and verifies them against the same checksums.

**Deciding "unchanged".** Only from the bytes staged for this save: FQN and chunk offsets (the
:class:`MetadataIndex`), stored dtype and shape, byte length, and a CRC64NVME of the bytes
(the item checksum that every incremental-capable save records; the base must hold one).
Never from tensor version counters, ``requires_grad`` or identity, which miss writes through
``.data`` and other aliases. The chance that a changed item of equal length has the same
CRC64 is 2^-64 ≈ 5.4e-20 per changed item (for data that is not chosen adversarially; a change
confined to 64 consecutive bits is always detected). A run that saves 10^6 changed items per
checkpoint for 10^5 checkpoints has a chance of about 5e-9 of ever mistaking one. CRC is not a
cryptographic hash: someone who can write tensors meant to collide can make one.

**Deleting.** Nothing referenced is deleted. :func:`references` reads every committed
``.metadata`` under a parent prefix, and every pending-references marker, and collects the keys
they use; retention (:class:`s3dcp.CheckpointManager`), ``s3dcp rm`` (:func:`delete_checkpoint`)
and ``s3dcp gc`` all go through it. Deleting a checkpoint removes its metadata first (it is no
longer loadable), then only those of its objects nothing references, and frees objects of
earlier-deleted checkpoints that only it still referenced. :func:`materialize` copies the
referenced objects into the checkpoint (server-side) so it stands alone.

**Commit against a concurrent delete.** Checking the base's objects and then committing is
not enough: a delete of the base that reads the references before the commit and deletes after
the check would leave a committed checkpoint with a dangling reference. So the two sides follow
a protocol (S3 is strongly consistent: a request that starts after another one completed sees
its effect; every step below waits for the previous one to complete):

    save of T on base B (coordinator, in finish)    delete of B (rm, retention)
    s1 PUT T/.pending-references (what T uses)      d1 DELETE B/.metadata
    s2 HEAD B/.metadata: there, and the object      d2 LIST the parent, GET every sibling's
       whose ETag set-up saw (else: refuse)            marker, then every sibling's .metadata
    s3 LIST: every object there, exact size         d3 DELETE the objects nothing in d2 uses
    s4 PUT T/.metadata (the commit)
    s5 DELETE T/.pending-references

Suppose T commits. Then s2 found B's metadata, so s2 came before d1, and s1 before d2 began.
d2 lists after s1, so T's directory is listed; it reads T's marker before T's metadata. If the
marker GET finds nothing, s5 completed before it, so s4 did too and the metadata GET after it
finds T's metadata. Either way d2 sees what T references, and d3 keeps it. If instead d1 came
first, s2 refuses and T never commits. The same holds for every object T references through B
(objects of earlier-deleted checkpoints that B references): any deleter reads references either
while B's metadata (which names them) exists, or after d1 and so after s1. ``gc`` reads
references the same way and, like a save's leftovers, ignores and deletes markers older than
its ``older_than_s`` (a save that died between s1 and s5). A marker costs one small PUT and
one DELETE per incremental save, and one GET per sibling directory per reference scan.

Limit: the marker has one name per checkpoint directory (so a scan needs one GET, not a LIST,
per directory). Two saves racing to the *same* path share it: the loser of the conditional
commit deletes it, which leaves the winner's s1..s4 window unprotected against a concurrent
delete of its base. Saving twice to one path at once is itself an error (one of them fails).
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from concurrent.futures import wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable

from ..s3.client import S3Client
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    MetadataFormatError,
    NoSuchKeyError,
)
from ..format.layout import (
    METADATA_NAME,
    PENDING_NAME,
    ItemLocation,
    is_data_object,
    new_save_id,
    object_sizes,
    parse_object_name,
)
from ..uri import S3Uri, object_key, parent_prefix, parse_s3_uri

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = [
    "REFERENCE_CHECKSUM", "BaseIndex", "check_base", "is_reference", "split_reference", "reference_name", "sources",
    "object_names", "encode_pending", "pending_names", "References", "held_for_references",
    "references", "DeleteResult", "delete_checkpoint", "MaterializeResult", "materialize",
]

log = logging.getLogger("s3dcp")

REFERENCE_CHECKSUM = "crc64nvme"  # the per-item checksum incremental saves record and compare


# ---------------------------------------------------------------------------- names
def is_reference(object_name: str) -> bool:
    """Whether ``object_name`` (relative to a checkpoint) names an object of a sibling."""
    return object_name.startswith("../")


def split_reference(object_name: str) -> tuple[str | None, str]:
    """``("step-1000", "__0_0.tok.distcp")`` for a reference, ``(None, name)`` for an own object."""
    if is_reference(object_name):
        _, directory, name = object_name.split("/", 2)
        return directory, name
    return None, object_name


def reference_name(directory: str, name: str) -> str:
    """The object name, relative to a checkpoint, of object ``name`` of sibling ``directory``."""
    return f"../{directory}/{name}"


def check_base(target: S3Uri, base: S3Uri) -> None:
    """Refuse a base that is not a sibling of ``target`` (same bucket, same parent prefix,
    another directory): references are ``../<sibling>/<name>`` and deletion counts them per
    parent prefix, so a base anywhere else could be deleted under the checkpoint."""
    if base.bucket != target.bucket or parent_prefix(base) != parent_prefix(target) or not target.prefix \
            or base.prefix == target.prefix or not base.prefix:
        raise ConfigError(
            f"incremental_from={str(base)!r} cannot be the base of {target}: a base must be another "
            f"checkpoint in the same directory (s3://{target.bucket}/{parent_prefix(target)}<name>), so that "
            "its objects are counted as referenced before anything there is deleted")


# ---------------------------------------------------------------------------- save side
class BaseIndex:
    """What an incremental save compares its items with: the base checkpoint's locations.

    Made on every rank in ``set_up_storage_writer`` (before any upload); :meth:`reference` is
    asked once per staged item in ``write_data``.
    """

    def __init__(self, target: S3Uri, base: S3Uri, storage_data: dict) -> None:
        check_base(target, base)
        self.target, self.base = target, base
        self._base_dir = base.prefix.rpartition("/")[2]
        self._own_dir = target.prefix.rpartition("/")[2]
        self._locations = storage_data  # a dict, or metadata v2's lazy mapping: only looked-up items are built
        first = storage_data[next(iter(storage_data))] if storage_data else None
        if first is not None and not (first.checksum or "").startswith(REFERENCE_CHECKSUM + ":"):
            log.warning("incremental base %s records no %s item checksums (saved by a full save with item "
                        "checksum %r?): items without one are uploaded; save the first checkpoint of an incremental "
                        "run with item_checksum=%r", base, REFERENCE_CHECKSUM,
                        (first.checksum or "none").split(":")[0], REFERENCE_CHECKSUM)

    @classmethod
    def load(cls, client: S3Client, target: S3Uri, base: S3Uri) -> "BaseIndex":
        """Read the base's metadata; refuse a base that is not a committed checkpoint."""
        check_base(target, base)
        from ..loading.reader import S3StorageReader

        try:
            metadata = S3StorageReader(str(base), client=client).fetch_metadata()
        except (CheckpointNotFoundError, IncompleteCheckpointError) as e:
            raise type(e)(f"incremental_from={str(base)!r} is not a committed checkpoint, so {target} cannot "
                          f"reference it: {e}") from e
        return cls(target, base, metadata.storage_data or {})

    def object_sizes(self) -> dict[str, tuple[int, bool]]:
        """Per object the base's items live in, named as the new checkpoint names it: ``(size,
        exact)``. The base's own objects hold only its items, packed from offset 0, so their
        size is where the last one ends (exact). Objects the base itself references (of an
        earlier, deleted checkpoint) hold items the base does not name: the base knows only
        where its last one ends (a lower bound). Built on the coordinator, at commit."""
        storage = self._locations
        extents = storage.object_extents() if hasattr(storage, "object_extents") else object_sizes(storage.values())
        out: dict[str, tuple[int, bool]] = {}
        for name, end in extents.items():
            directory, obj = split_reference(name)
            out[reference_name(directory or self._base_dir, obj)] = (end, directory is None)
        return out

    def reference(self, index: "MetadataIndex", nbytes: int, dtype: str | None, shape: tuple | None,
                  checksum: str | None) -> ItemLocation | None:
        """The base's location of this item, as the new checkpoint names it, when the item is
        unchanged; None when it must be uploaded."""
        loc = self._locations.get(index)
        if (loc is None or checksum is None or not checksum.startswith(REFERENCE_CHECKSUM + ":")
                or loc.checksum != checksum or loc.length != nbytes or loc.dtype != dtype
                or (tuple(loc.shape) if loc.shape is not None else None) != shape):
            return None
        directory, name = split_reference(loc.object_name)
        directory = directory or self._base_dir  # the base's own object, or the base's reference as is
        if directory == self._own_dir:
            return None  # an object of the directory being written: never refer to ourselves
        return replace(loc, object_name=reference_name(directory, name))


def sources(locations: Iterable[ItemLocation]) -> dict:
    """Where a checkpoint's item bytes are: ``{"written": {"items", "bytes"}, "inherited":
    {"<sibling>": {"items", "bytes"}}}`` (what ``s3dcp inspect`` shows)."""
    out: dict = {"written": {"items": 0, "bytes": 0}, "inherited": {}}
    for loc in locations:
        directory = split_reference(loc.object_name)[0]
        entry = (out["written"] if directory is None
                 else out["inherited"].setdefault(directory, {"items": 0, "bytes": 0}))
        entry["items"] += 1
        entry["bytes"] += loc.length
    return out


# ---------------------------------------------------------------------------- deletion side
_V2_MAGIC = b"\x89S3DCPMD"  # s3dcp.format.metadata.v2.MAGIC, repeated here so that reading names needs no torch
_V2_HEAD = struct.Struct("<8sQ")


def object_names(raw: bytes, source: str) -> set[str]:
    """The object names a ``.metadata`` object uses. Versions 1 (one JSON document) and 2 (its
    header's interned ``object_names``, after checking the trailer CRC) are read directly,
    without importing torch, so ``s3dcp ls`` and ``rm`` stay light; anything else is decoded in
    full by :func:`s3dcp.format.metadata.decode_metadata`, which also says what is wrong with it."""
    names = _v2_names(raw) if raw[:len(_V2_MAGIC)] == _V2_MAGIC else _v1_names(raw)
    if names is not None:
        return names
    from ..format.metadata import decode_metadata

    metadata = decode_metadata(raw, source=source)
    return {loc.object_name for loc in (metadata.storage_data or {}).values()}


def _v1_names(raw: bytes) -> set[str] | None:
    try:
        doc = json.loads(raw)
        if doc.get("format") != "s3dcp-metadata" or doc.get("version") != 1:
            return None
        names = {entry["location"]["object_name"] for entry in doc.get("storage_data") or []}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return names if all(isinstance(n, str) for n in names) else None


def _v2_names(raw: bytes) -> set[str] | None:
    view = memoryview(raw)
    try:
        _, head_len = _V2_HEAD.unpack_from(view)
        if _V2_HEAD.size + head_len + 4 > len(view) or \
                zlib.crc32(view[:-4]) != struct.unpack_from("<I", view, len(view) - 4)[0]:
            return None
        header = json.loads(bytes(view[_V2_HEAD.size:_V2_HEAD.size + head_len]))
        if header.get("format") != "s3dcp-metadata" or header.get("version") != 2:
            return None
        storage = header.get("storage_data")
        names = set(storage["object_names"]) if storage is not None else set()
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
        return None
    return names if all(isinstance(n, str) for n in names) else None


_PENDING_FORMAT = "s3dcp-pending-references"


def encode_pending(save_id: str, base: str, names: Iterable[str]) -> bytes:
    """The body of a save's ``.pending-references`` marker: the object names (relative to the
    checkpoint, as in its metadata) that the save is about to commit references to."""
    return json.dumps({"format": _PENDING_FORMAT, "version": 1, "save_id": save_id, "base": base,
                       "object_names": sorted(names)}).encode()


def pending_names(raw: bytes, source: str) -> set[str]:
    """The object names a ``.pending-references`` marker lists; :class:`MetadataFormatError`
    naming ``source`` when it is not one."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != _PENDING_FORMAT or doc.get("version") != 1:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        names = set(doc["object_names"])
        if not all(isinstance(n, str) for n in names):
            raise ValueError("object_names holds a non-string")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MetadataFormatError(f"{source} is not a pending-references marker of s3dcp ({e})") from e
    return names


@dataclass
class References:
    """What the committed checkpoints (and the saves about to commit) under one parent prefix use."""

    parent: str  # the listing prefix, e.g. "run/"
    committed: set[str] = field(default_factory=set)  # directory prefixes with .metadata ("run/step-1/")
    keys: dict[str, set[str]] = field(default_factory=dict)  # object key -> directories referencing it
    unreadable: list[str] = field(default_factory=list)  # .metadata / marker keys that could not be read
    pending: set[str] = field(default_factory=set)  # directories with a pending-references marker

    def users(self, key: str) -> set[str]:
        return self.keys.get(key, set())


def references(client: S3Client, bucket: str, parent: str, *, ignore: frozenset[str] = frozenset()) -> References:
    """Every object key used by a committed checkpoint directly under ``parent`` (a listing
    prefix such as ``"run/"``), or listed by the pending-references marker of a save there
    about to commit: one LIST, then every sibling's marker, then every sibling's ``.metadata``
    (each round in parallel; markers strictly before metadata, see the protocol in the module
    docstring). A metadata object or marker that cannot be decoded is recorded in
    ``unreadable``: its references are unknown, and callers must then delete nothing that it
    could reference. Marker keys in ``ignore`` (stale ones ``gc`` is deleting) are not read."""
    _, prefixes = client.list(bucket, parent, delimiter="/").result()
    refs = References(parent)
    markers = {d: client.get(bucket, f"{d}{PENDING_NAME}") for d in prefixes if f"{d}{PENDING_NAME}" not in ignore}
    wait(list(markers.values()))  # every marker read completes before any metadata read starts
    metadata = {d: client.get(bucket, f"{d}{METADATA_NAME}") for d in prefixes}
    wait(list(metadata.values()))
    for kind, futures in (("marker", markers), ("metadata", metadata)):
        for directory, future in sorted(futures.items()):
            err = future.exception()
            if isinstance(err, NoSuchKeyError):
                continue
            if err is not None:
                raise err
            source = f"s3://{bucket}/{directory}{PENDING_NAME if kind == 'marker' else METADATA_NAME}"
            uri = S3Uri(bucket, directory.rstrip("/"))
            try:
                names = (pending_names(future.result(), source) if kind == "marker"
                         else object_names(future.result(), source))
                keys = {object_key(uri, name) for name in names}
            except MetadataFormatError:
                log.warning("cannot read %s: what it references is unknown, nothing it could use is deleted", source,
                            exc_info=True)
                refs.unreadable.append(source[len(f"s3://{bucket}/"):])
                keys = set()
            (refs.pending if kind == "marker" else refs.committed).add(directory)
            for key in keys:
                refs.keys.setdefault(key, set()).add(directory)
    return refs


def held_for_references(client: S3Client, bucket: str, by_dir: dict) -> dict[str, set[str]]:
    """The directories of ``by_dir`` (listing prefix -> its objects, as
    :func:`s3dcp.lifecycle.manager.scan_directories` gives) that are deleted checkpoints kept only for
    their references — no ``.metadata``, and every data object referenced by a committed
    sibling — each with the sibling directories that reference them. :meth:`CheckpointManager.list`
    does not show them; ``s3dcp ls`` shows them as kept. Reads references only when there is
    such a candidate."""
    candidates = {d: objs for d, objs in by_dir.items()
                  if all(o.key.rpartition("/")[2] != METADATA_NAME for o in objs)
                  and any(is_data_object(o.key.rpartition("/")[2]) for o in objs)}
    held: dict[str, set[str]] = {}
    cache: dict[str, References] = {}
    for directory, objs in candidates.items():
        parent = directory.rstrip("/").rpartition("/")[0]
        parent = f"{parent}/" if parent else ""
        if parent not in cache:
            cache[parent] = references(client, bucket, parent)
        refs = cache[parent]
        data = [o for o in objs if is_data_object(o.key.rpartition("/")[2])]
        if all(refs.users(o.key) for o in data):
            held[directory] = set().union(*(refs.users(o.key) for o in data))
    return held


def _own_references(client: S3Client, uri: S3Uri, names: set[str]) -> set[str]:
    """Keys outside ``uri`` that its metadata and its pending-references marker (those of
    ``names`` present) reference; empty for one that is missing or unreadable."""
    keys: set[str] = set()
    for name in sorted(names & {METADATA_NAME, PENDING_NAME}):
        source = str(uri.child(name))
        try:
            raw = client.get(uri.bucket, uri.key(name)).result()
            used = pending_names(raw, source) if name == PENDING_NAME else object_names(raw, source)
            keys |= {object_key(uri, n) for n in used}
        except (NoSuchKeyError, MetadataFormatError):
            continue
    return {k for k in keys if not k.startswith(uri.dir_prefix)}


@dataclass
class DeleteResult:
    """What :func:`delete_checkpoint` did. Unpacks as ``(deleted objects, deleted bytes)``."""

    deleted_objects: int = 0
    deleted_bytes: int = 0
    kept: list[str] = field(default_factory=list)  # keys of its objects other checkpoints reference
    kept_bytes: int = 0
    released: list[str] = field(default_factory=list)  # objects of deleted checkpoints only it referenced

    def __iter__(self):
        return iter((self.deleted_objects, self.deleted_bytes))


def delete_checkpoint(client: S3Client, uri: S3Uri, *,
                      on_deleted: Callable[[int], None] | None = None) -> DeleteResult:
    """Delete the checkpoint at ``uri``, keeping what other checkpoints reference.

    Order: read what its metadata (and a pending-references marker) references; delete the
    ``.metadata`` (from then on it is neither committed, loadable, nor a valid base: a save
    on it that has not passed its commit check refuses to commit, and a half-finished deletion
    reads as incomplete, never as a corrupt checkpoint); only then read the references of
    every sibling, committed and pending (the order the protocol in the module docstring
    needs); delete its data objects that none of them references; delete its own marker, if a
    save here never finished; then delete objects of earlier-deleted siblings that only this
    checkpoint still referenced. Objects that s3dcp did not write, and deeper directories, are
    left alone. When a sibling's metadata or marker cannot be read, no data object is deleted
    (``s3dcp gc`` removes them once that is fixed)."""
    objects, _ = client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
    metadata = [o for o in objects if o.key.rpartition("/")[2] == METADATA_NAME]
    data = [o for o in objects if is_data_object(o.key.rpartition("/")[2])]
    markers = [o for o in objects if o.key.rpartition("/")[2] == PENDING_NAME]
    result = DeleteResult()
    own_refs = _own_references(client, uri, {o.key.rpartition("/")[2] for o in metadata + markers})
    if metadata:
        client.delete(uri.bucket, [o.key for o in metadata]).result()
        result.deleted_objects += len(metadata)
        result.deleted_bytes += sum(o.size for o in metadata)
        if on_deleted:
            on_deleted(len(metadata))
    refs = references(client, uri.bucket, parent_prefix(uri))
    if refs.unreadable:
        result.kept = sorted(o.key for o in data)
        result.kept_bytes = sum(o.size for o in data)
        log.warning("deleted %s's metadata but kept its %d data object(s): %s cannot be read, so what it "
                    "references is unknown", uri, len(data), ", ".join(refs.unreadable))
        return result
    doomed = [o for o in data if not refs.users(o.key)]
    kept = [o for o in data if refs.users(o.key)]
    for i in range(0, len(doomed), 1000):
        batch = doomed[i:i + 1000]
        client.delete(uri.bucket, [o.key for o in batch]).result()
        if on_deleted:
            on_deleted(len(batch))
    result.deleted_objects += len(doomed)
    result.deleted_bytes += sum(o.size for o in doomed)
    result.kept = sorted(o.key for o in kept)
    result.kept_bytes = sum(o.size for o in kept)
    if markers:  # a save here that never finished: it will not commit with its objects gone
        client.delete(uri.bucket, [o.key for o in markers]).result()
        result.deleted_objects += len(markers)
        result.deleted_bytes += sum(o.size for o in markers)
        refs = references(client, uri.bucket, parent_prefix(uri))
        if refs.unreadable:
            return result
    result.released = _release(client, uri.bucket, own_refs, refs)
    if kept:
        log.info("deleted %s; kept %d of its object(s) (%d bytes) that other checkpoints reference", uri,
                 len(kept), result.kept_bytes)
    return result


def _release(client: S3Client, bucket: str, keys: Iterable[str], refs: References) -> list[str]:
    """Delete those of ``keys`` (objects in sibling directories) that no committed checkpoint
    references and whose directory is no committed checkpoint: leftovers of deleted bases."""
    doomed = sorted(k for k in keys
                    if not refs.users(k) and f"{k.rpartition('/')[0]}/" not in refs.committed
                    and is_data_object(k.rpartition("/")[2]) and k.startswith(refs.parent))
    if doomed:
        client.delete(bucket, doomed).result()
    return doomed


# ---------------------------------------------------------------------------- materialize
@dataclass
class MaterializeResult:
    """What :func:`materialize` did."""

    uri: str
    copied_objects: int = 0
    copied_bytes: int = 0
    items: int = 0  # items that were references
    released: list[str] = field(default_factory=list)


def materialize(uri: str, *, client: S3Client | None = None, config=None,
                **copy_options) -> MaterializeResult:
    """Make the checkpoint at ``uri`` self-contained: copy every object it references into
    its own directory with server-side copies (``CopyObject``, ``UploadPartCopy`` above the
    multipart threshold: no bytes pass through this machine), then replace its metadata by one
    that names the copies. The checkpoint stays committed and loadable throughout (the new
    metadata is one atomic PUT, written after every copy exists). Objects of deleted bases
    that only this checkpoint referenced are deleted afterwards. ``copy_options`` go to
    :meth:`s3dcp.s3.client.S3Client.copy` (``multipart_threshold_bytes``)."""
    from ..format.metadata import decode_metadata, encode_metadata

    target = parse_s3_uri(uri)
    client = client or S3Client(config)
    source = str(target.child(METADATA_NAME))
    try:
        raw = client.get(target.bucket, target.key(METADATA_NAME)).result()
    except NoSuchKeyError as e:
        raise CheckpointNotFoundError(f"no committed checkpoint at {target} (no {METADATA_NAME})") from e
    metadata: Metadata = decode_metadata(raw, source=source)
    storage = dict((metadata.storage_data or {}).items())  # a plain dict (v2 decodes lazily, read-only)
    metadata.storage_data = storage
    referenced = sorted({loc.object_name for loc in storage.values() if split_reference(loc.object_name)[0]})
    result = MaterializeResult(str(target))
    if not referenced:
        return result
    token = new_save_id()
    renamed: dict[str, str] = {}
    for i, name in enumerate(referenced):
        parsed = parse_object_name(split_reference(name)[1])
        renamed[name] = f"__{parsed.rank if parsed else 0}_{i}.{token}.distcp"
    heads = {name: client.head(target.bucket, object_key(target, name)) for name in referenced}
    wait(list(heads.values()))
    missing = [name for name, f in heads.items() if f.exception() is not None]
    if missing:
        raise CheckpointError(f"materialize {target}: {len(missing)} referenced object(s) cannot be read, first "
                              f"{object_key(target, missing[0])}: {heads[missing[0]].exception()}; nothing was "
                              "changed") from heads[missing[0]].exception()
    # Each copy is the prefix the checkpoint uses, up to its last item there: the source may hold
    # more (items of its own checkpoint this one changed), and an incremental save based on this
    # one checks its own objects at exactly where their last item ends. A prefix is a ranged
    # (UploadPartCopy) copy; the whole object, one CopyObject.
    ends = object_sizes(loc for loc in storage.values() if loc.object_name in renamed)
    futures = {}
    for name, new in renamed.items():
        options = dict(copy_options)
        if ends[name] < heads[name].result().size:
            options["multipart_threshold_bytes"] = 0
        futures[name] = client.copy(target.bucket, object_key(target, name), target.key(new), ends[name], **options)
    wait(list(futures.values()))
    failed = [(name, f.exception()) for name, f in futures.items() if f.exception() is not None]
    if failed:
        client.delete(target.bucket, [target.key(renamed[n]) for n in futures if futures[n].exception() is None])
        name, err = failed[0]
        raise CheckpointError(f"materialize {target}: copying {object_key(target, name)} failed ({err}); "
                              "nothing was changed") from err
    result.copied_objects = len(renamed)
    result.copied_bytes = sum(f.result() for f in futures.values())
    for index, loc in storage.items():
        if loc.object_name in renamed:
            storage[index] = replace(loc, object_name=renamed[loc.object_name])
            result.items += 1
    client.put(target.bucket, target.key(METADATA_NAME), encode_metadata(metadata),
               single_request=True, content_type="application/json").result()
    refs = references(client, target.bucket, parent_prefix(target))
    if not refs.unreadable:
        result.released = _release(client, target.bucket, (object_key(target, n) for n in referenced), refs)
    log.info("materialized %s: %d object(s), %d bytes copied server-side for %d item(s)", target,
             result.copied_objects, result.copied_bytes, result.items)
    return result
