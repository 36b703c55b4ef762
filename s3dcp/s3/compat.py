"""What differs between stores that speak S3: wire checksums and create-only writes.

    compat="s3"     trailer checksums (aws-chunked)   create-only: If-None-Match: *
    compat="gcs"    none on the wire                  create-only: x-goog-if-generation-match: 0
    compat="basic"  none on the wire                  create-only: checked_put (HEAD, PUT, read back)

Owns that table and the "basic" fallback flow. Item checksums in the metadata are not touched:
every load verifies them whatever the store. It must not send a request itself (it is handed
the client's ``head``/``put``/``get``) and never imports :mod:`s3dcp.s3.client`. The modes and
their detection from the endpoint live in :mod:`s3dcp.config`; the reasons in
``docs/compatibility.md``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

from ..errors import NoSuchKeyError, PreconditionFailedError

__all__ = ["wire_checksums", "create_only_headers", "checked_put"]

_CREATE_ONLY_HEADERS = {
    "s3": (("If-None-Match", "*"),),
    "gcs": (("x-goog-if-generation-match", "0"),),  # generation 0: "no live object of this name"
    "basic": None,  # no precondition: checked_put
}


def wire_checksums(compat: str) -> bool:
    """Whether uploads carry flexible checksums (aws-chunked bodies with a checksum trailer,
    ``x-amz-checksum-*`` headers): only on stores that accept them."""
    return compat == "s3"


def create_only_headers(compat: str) -> tuple[tuple[str, str], ...] | None:
    """The headers that make a PUT fail with 412 if the key exists; None where the store has
    no such precondition (then :func:`checked_put`)."""
    return _CREATE_ONLY_HEADERS[compat]


def checked_put(head: Callable[[], Future], put: Callable[[], Future], get: Callable[[], Future],
                body: bytes, *, operation: str, bucket: str, key: str) -> Future:
    """A create-only PUT on a store without a precondition: HEAD (the key must be absent), PUT,
    then GET it back (it must be ``body``). Fails with :class:`PreconditionFailedError` when
    the key was there before, or was replaced by another writer before the read-back; resolves
    to the PUT's result otherwise.

    Not atomic: two writers whose HEADs both precede both PUTs can both succeed, the later
    PUT replacing the earlier one unseen by the earlier writer if its read-back came first.
    An object that existed before the HEAD is never overwritten. s3dcp uses it only for the
    commit, whose body names the save's own objects, so a lost race leaves one complete
    checkpoint, never a mixed one (see docs/compatibility.md)."""
    outer: Future = Future()
    where = f"s3://{bucket}/{key}"

    def fail(message: str, cause: BaseException | None = None) -> None:
        error = PreconditionFailedError(message, operation=operation, bucket=bucket, key=key)
        error.__cause__ = cause
        outer.set_exception(error)

    def guarded(step: Callable) -> Callable:
        # a step that raises (a request that cannot even start) fails the write instead of leaving it pending
        def run(*args) -> None:
            try:
                step(*args)
            except BaseException as e:  # noqa: BLE001 - it reaches the caller through the future
                if not outer.done():
                    outer.set_exception(e)
        return run

    @guarded
    def headed(f: Future) -> None:
        error = f.exception()
        if error is None:
            fail(f"{where} exists: a create-only write (checked, compat='basic') does not replace it")
        elif isinstance(error, NoSuchKeyError):
            put().add_done_callback(stored)
        else:
            outer.set_exception(error)

    @guarded
    def stored(f: Future) -> None:
        error = f.exception()
        if error is not None:
            outer.set_exception(error)
            return
        get().add_done_callback(lambda g: read_back(g, f.result()))

    @guarded
    def read_back(g: Future, result) -> None:
        error = g.exception()
        if error is None and g.result() == body:
            outer.set_result(result)
        elif error is None or isinstance(error, NoSuchKeyError):
            fail(f"{where} was replaced (or removed) by another writer right after this create-only "
                 "write (checked, compat='basic')", error)
        else:
            outer.set_exception(error)

    guarded(lambda: head().add_done_callback(headed))()
    return outer
