"""Which object keys the checkpoints under one parent prefix use: every committed ``.metadata``
and every pending-references marker (References, references()). A save that overwrites reads it
before deleting the replaced objects; every deletion (rm, retention, gc) reads it.

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

import logging
from concurrent.futures import wait
from dataclasses import dataclass, field

from ..errors import MetadataFormatError, NoSuchKeyError
from ..format.layout import METADATA_NAME, PENDING_NAME
from ..format.references import object_names, pending_names
from ..s3.client import S3Client
from ..uri import S3Uri, object_key

__all__ = ["References", "references"]

log = logging.getLogger("s3dcp")


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
