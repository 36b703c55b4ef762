"""Reading a checkpoint's ``.metadata`` object: one GET, retried, with typed errors; no torch.

:func:`fetch_metadata_bytes` is the one GET of ``.metadata`` that the storage reader
(:meth:`s3dcp.loading.reader.S3StorageReader.fetch_metadata`, which decodes it for DCP) and the
light commands (``s3dcp inspect`` and ``verify``, which decode it without torch:
:func:`s3dcp.format.metadata.decode_plain`) share: throttling, 5xx answers and dropped connections
are retried beyond the CRT's own retries; a missing object is told apart as
:class:`IncompleteCheckpointError` (data objects but no commit marker) or
:class:`CheckpointNotFoundError`, which names the checkpoints right below the path when there
are some (a run's folder given for one of its steps).
"""

from __future__ import annotations

import logging
import random
import time

from ..errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    NoSuchKeyError,
    S3ConnectionError,
    S3DCPError,
    S3ServerError,
    ThrottlingError,
)
from ..format.layout import METADATA_NAME, is_data_object
from ..s3.client import S3Client
from ..uri import S3Uri, natural_order

__all__ = ["fetch_metadata_bytes"]

log = logging.getLogger("s3dcp")

_METADATA_ATTEMPTS = 4  # reads of .metadata, each with the CRT's own retries inside
_METADATA_BACKOFF_S = 0.2
_BELOW_CHECKED = 200  # folders below a path without a checkpoint whose .metadata is looked for
_BELOW_NAMED = 8  # of those found, how many the error names


def fetch_metadata_bytes(client: S3Client, uri: S3Uri) -> bytes:
    """The bytes of ``uri``'s ``.metadata``, or a typed error (see the module docstring)."""
    try:
        return _get_with_retries(client, uri.bucket, uri.key(METADATA_NAME))
    except NoSuchKeyError as e:
        objects, prefixes = client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
        data = [o for o in objects if is_data_object(o.key.rpartition("/")[2])]
        if data:
            raise IncompleteCheckpointError(
                f"{uri} is incomplete: {len(data)} data object(s) but no {METADATA_NAME} (the commit "
                "marker, written last). The save that wrote it failed or is still running; load an "
                "earlier checkpoint, and run `s3dcp gc` to remove the leftovers") from e
        raise CheckpointNotFoundError(f"no checkpoint at {uri} (no {METADATA_NAME} and no data objects)"
                                      f"{_below(client, uri, prefixes)}") from e


def _below(client: S3Client, uri: S3Uri, prefixes: list[str]) -> str:
    """What to say of the folders right below a path with no checkpoint (a run, say): the
    committed checkpoints among them (one HEAD of ``.metadata`` each, for the last
    ``_BELOW_CHECKED`` folders in name order), or nothing."""
    checked = sorted(prefixes, key=natural_order)[-_BELOW_CHECKED:]  # the newest, for numbered steps
    heads = [(p, client.head(uri.bucket, f"{p}{METADATA_NAME}")) for p in checked]
    found = []
    for prefix, head in heads:
        try:
            head.result()
        except S3DCPError:  # not a checkpoint, or not ours to see: this is only a hint
            continue
        found.append(prefix[len(uri.dir_prefix):].rstrip("/"))
    if not found:
        return ""
    shown = found if len(found) <= _BELOW_NAMED else [*found[:2], "…", *found[-(_BELOW_NAMED - 3):]]
    more = f", {len(prefixes) - len(checked)} more folder(s) not looked at" if len(prefixes) > len(checked) else ""
    return (f"; it holds {len(found)} checkpoint(s) right below it: {', '.join(shown)}{more} — load one of them, "
            f"e.g. {uri.child(found[-1])} (s3dcp ls {uri}/ lists them)")


def _get_with_retries(client: S3Client, bucket: str, key: str) -> bytes:
    for attempt in range(_METADATA_ATTEMPTS):
        try:
            return client.get(bucket, key).result()
        except (ThrottlingError, S3ServerError, S3ConnectionError) as e:
            if attempt + 1 == _METADATA_ATTEMPTS:
                raise
            delay = min(_METADATA_BACKOFF_S * 2 ** attempt, 5.0) * (0.5 + random.random() / 2)
            log.info("reading s3://%s/%s failed (%s); retrying in %.2f s", bucket, key, type(e).__name__, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
