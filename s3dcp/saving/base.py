"""What an incremental save inherits from its base: the base's items (BaseIndex). The rule that a
base is a sibling is :func:`s3dcp.format.references.check_base` (pure, so the manager checks it
without importing torch).

    base (a committed sibling, e.g. run/step-1000) ──.metadata──► BaseIndex: per item (FQN +
        chunk offsets) its object, byte range, length, dtype, shape and CRC64NVME
    write_data, per rank, per staged item ──crc64nvme──► same item, length, dtype, shape, CRC?
        ├─ yes: ItemLocation(object_name="../step-1000/__0_0.<save id>.distcp", the base's range)
        │       — nothing uploaded; a reference the base held is copied as is (no chains)
        └─ no:  uploaded as in a full save
    commit (coordinator): marker, base unchanged, every referenced object there at the size
        the base records (one LIST per referenced directory), then .metadata as always
        (the order that keeps a concurrent delete of the base safe: :mod:`s3dcp.saving.referenced`)

**Deciding "unchanged".** Only from the bytes staged for this save: FQN and chunk offsets (the
:class:`MetadataIndex`), stored dtype and shape, byte length, and a CRC64NVME of the bytes
(the item checksum every save records by default; the base must hold one).
Never from tensor version counters, ``requires_grad`` or identity, which miss writes through
``.data`` and other aliases. The chance that a changed item of equal length has the same
CRC64 is 2^-64 ≈ 5.4e-20 per changed item (for data that is not chosen adversarially; a change
confined to 64 consecutive bits is always detected). A run that saves 10^6 changed items per
checkpoint for 10^5 checkpoints has a chance of about 5e-9 of ever mistaking one. CRC is not a
cryptographic hash: someone who can write tensors meant to collide can make one.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError
from ..format.layout import ItemLocation, object_sizes
from ..format.references import REFERENCE_CHECKSUM, check_base, reference_name, split_reference
from ..loading.reader import S3StorageReader
from ..s3.client import S3Client
from ..uri import S3Uri

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["BaseIndex"]

log = logging.getLogger("s3dcp")


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
            log.warning("incremental base %s records no %s item checksums (its items have %r: saved by an "
                        "earlier s3dcp, or with item_checksum=%r or checksums off?): items without one are "
                        "uploaded; checkpoints saved with the default item checksum (%r) can be bases", base,
                        REFERENCE_CHECKSUM, (first.checksum or "none").split(":")[0],
                        (first.checksum or "none").split(":")[0], REFERENCE_CHECKSUM)

    @classmethod
    def load(cls, client: S3Client, target: S3Uri, base: S3Uri) -> "BaseIndex":
        """Read the base's metadata; refuse a base that is not a committed checkpoint."""
        check_base(target, base)
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
