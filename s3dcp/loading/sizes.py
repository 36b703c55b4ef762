"""Before anything is allocated or written at the sizes a checkpoint's metadata declares: do its
objects hold them? (``s3dcp download``, ``s3dcp export``.)

Metadata can declare a 4 TiB tensor stored in a 64-byte object. A load allocates only its
destinations, which the caller made; a whole-checkpoint read (``download``: DCP's planner
allocates every tensor at its declared size) or an export (a ring buffer as large as the largest
tensor, then a file of the declared size) would allocate or write what is declared first and
only then find the object short. :func:`check_declared_sizes` refuses such metadata with a
:class:`~s3dcp.errors.MetadataFormatError` naming the tensor, before: each tensor's chunks tile
it exactly, each chunk's stored length is its bytes, and each item lies inside its object (one
LIST of the checkpoint, a HEAD for each object elsewhere: an incremental checkpoint's base).
So what is then allocated is at most what the objects hold.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from ..errors import MetadataFormatError
from ..format import layout
from ..format.context import At, quoted
from ..s3.client import S3Client
from ..uri import S3Uri, object_key

__all__ = ["check_declared_sizes"]


def check_declared_sizes(client: S3Client, uri: S3Uri, md: Any, fqns: Iterable[str] | None = None) -> None:
    """Refuse ``md`` (DCP's Metadata of the checkpoint at ``uri``) if an item of ``fqns`` (default:
    all) declares more than its objects hold; see the module docstring. A missing location is left
    to the reader, which names it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    objects, _ = client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
    sizes = {o.key: o.size for o in objects}
    wanted = None if fqns is None else set(fqns)
    storage = md.storage_data or {}
    for fqn, meta in md.state_dict_metadata.items():
        if wanted is not None and fqn not in wanted:
            continue
        tensor = isinstance(meta, TensorStorageMetadata)
        where = At(uri, ": tensor ", quoted(fqn), " of shape ", list(meta.size)) if tensor else \
            At(uri, ": item ", quoted(fqn))
        if tensor:
            layout.check_tiling(tuple(meta.size), [(c.offsets, c.sizes) for c in meta.chunks], where)
            keys = [(MetadataIndex(fqn, c.offsets), c.sizes) for c in meta.chunks]
        else:
            keys = [(MetadataIndex(fqn), None)]
        for index, chunk_sizes in keys:
            loc = storage.get(index)
            if loc is None:
                continue
            if chunk_sizes is not None:
                expected = meta.properties.dtype.itemsize * math.prod(chunk_sizes)
                if loc.length != expected:
                    raise MetadataFormatError(f"{where}: the chunk at {tuple(index.offset)} is stored in "
                                              f"{loc.length} bytes, not its {expected}")
            key = object_key(uri, loc.object_name)
            if key not in sizes:
                sizes[key] = client.head(uri.bucket, key).result().size
            layout.check_in_object(loc, sizes[key], where)
