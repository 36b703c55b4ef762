"""S3 operations as futures: a small surface over awscrt's S3Client.

    shared-memory file ──put_file()──► the CRT's PUT reading the file by path (multipart above the
                                       threshold, each part with its checksum, no copy of ours)
    caller buffers ──put()──► the CRT's PUT from a stream over them (small objects, .metadata)
    caller buffers ◄─get_scatter()── the CRT's ranged GET, parts in parallel, each body chunk
                                      copied into the buffers that cover it
    head / list / delete / copy / list_uploads / abort ── CRT "DEFAULT" requests, XML parsed here
    (transport="sockets", opt-in: multipart uploads and ranged reads over s3dcp's own sockets,
     s3dcp.s3.sockets and s3dcp.s3.socket_reads)

Owns :class:`S3Client`: every operation's surface, what each single request sends (its
addressing and headers come from :mod:`s3dcp.s3.addressing`) and how its answer becomes a value
(:class:`PutResult`; :class:`ObjectInfo` and :class:`UploadInfo` are defined with the listings
and exported here). Flows of several requests live beside it and send through
:meth:`S3Client._default`: paginated listings (:mod:`s3dcp.s3.listing`), batched deletes
(:mod:`s3dcp.s3.deletes`) and server-side copy (:mod:`s3dcp.s3.copies`). It must not manage a
request once submitted (deadlines, aborts, slots: :mod:`s3dcp.s3.request`) nor own native CRT
clients or credentials (:mod:`s3dcp.s3.native`, :mod:`s3dcp.s3.crt`).

Every call returns a :class:`concurrent.futures.Future`. Errors are translated once, by
:func:`s3dcp.s3.responses.translate_error`, from HTTP status and S3 error code (never message
text) into the :mod:`s3dcp.errors` hierarchy, keeping the original as ``__cause__``.

The CRT client is created lazily, so an :class:`S3Client` pickles (DCP's process executor
sends the writer to a child process) and each process builds its own native client.
"""

from __future__ import annotations

import bisect
import io
import itertools
import logging
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence
from urllib.parse import quote, urlencode

from ..config import S3Config
from ..errors import IntegrityError, NoSuchKeyError, S3Error
from . import compat, listing
from .addressing import Addressing
from .clock import parse_http_date, with_measured_skew
from .copies import copy_object
from .deletes import delete_objects
from .listing import ObjectInfo, UploadInfo, UploadParts
from .responses import etag_of_answer, object_size_check
from .native import _acquire_native, _NativeClient, _NativeUse
from .request import _Call
from .sender import refuse_proxy
from .socket_reads import SocketRead
from .sockets import SocketUpload
from .streams import BufferStream, copy_into, finalizer, gather

__all__ = ["S3Client", "ObjectInfo", "UploadInfo", "UploadParts", "PutResult"]

log = logging.getLogger("s3dcp")

@dataclass(frozen=True)
class PutResult:
    etag: str | None
    size: int


class S3Client:
    """Futures-returning S3 operations over one lazily created awscrt ``S3Client``.

    ``put`` and ``get_range_into`` move data through the CRT's parallel multipart machinery;
    the rest are single small requests. At most ``config.max_concurrency`` requests are in
    flight per process (S3Clients of equal configs share one native client and its limit);
    requests beyond that wait in order for a free slot. No call blocks: each returns its future
    at once, so calls may be chained from callbacks on CRT threads. A request holds the
    caller's buffers only until it ends.
    """

    def __init__(self, config: S3Config | None = None) -> None:
        config = config or S3Config()
        self._profile_given = config.profile is not None  # a profile named in code beats env keys
        self.config = config.resolved()
        if self.config.transport == "sockets":  # which has no proxy support
            refuse_proxy(self.config)
        self._lock = threading.Lock()
        self._use = _NativeUse()
        weakref.finalize(self, finalizer(self._use.release))  # dropped without close(): lets go too
        self._at = Addressing(self.config)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        return {"config": self.config, "profile_given": self._profile_given}

    def __setstate__(self, state):
        self.__init__(state["config"])
        self._profile_given = state.get("profile_given", False)

    def __repr__(self) -> str:
        return f"S3Client(endpoint_url={self.config.endpoint_url!r}, region={self.config.region!r})"

    # ------------------------------------------------------------------ data plane
    def put(
        self,
        bucket: str,
        key: str,
        data: Sequence | bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        single_request: bool = False,
        content_type: str = "application/octet-stream",
    ) -> "Future[PutResult]":
        """Upload ``data`` (one buffer, or a sequence of buffers sent back to back, no copy
        into a staging area) as ``key``. Multipart above the threshold, with the configured
        checksum on every part. ``single_request=True`` forces one PUT whatever the size (up
        to S3's 5 GiB), which makes the write atomic: used for the commit marker.
        ``if_none_match=True`` (implies ``single_request``) makes the write create-only: it
        fails with :class:`PreconditionFailedError` if the key already exists, by the store's
        own precondition (``If-None-Match: *``; GCS: ``x-goog-if-generation-match: 0``) or, with
        ``compat="basic"``, by :func:`s3dcp.s3.compat.checked_put`."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        buffers = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        create_only = compat.create_only_headers(self.config.compat) if if_none_match else ()
        if create_only is None:
            body = b"".join(memoryview(b).cast("B") for b in buffers)
            return compat.checked_put(
                lambda: self.head(bucket, key),
                lambda: self.put(bucket, key, body, single_request=True, content_type=content_type),
                lambda: self.get(bucket, key), body, operation="PutObject", bucket=bucket, key=key)
        stream = BufferStream(buffers)
        single_request = single_request or if_none_match
        headers = [*self._put_headers(bucket, stream.size, content_type), *create_only]
        etag, on_headers = etag_of_answer()
        size = stream.size
        # Above the threshold the upload goes in parts; at the threshold itself the CRT's choice
        # depends on its comparison, so it counts as a single PUT here (the safe side, see
        # RequestFuture.abort).
        multipart = not single_request and size > self.config.effective_multipart_threshold_bytes
        if multipart and self.config.transport == "sockets":  # parts sent from the buffers
            checksum, common = self._at.wire_checksum(), self._at.bucket_headers()
            create = [("Content-Type", content_type), *self._at.sse_headers(), *common]
            if checksum is not None:
                create.append(("x-amz-checksum-algorithm", checksum.upper()))
            upload = SocketUpload(bucket, key, self._at.host_for(bucket), self._at.path(bucket, key), stream.views,
                                  part_size=self.config.part_size_bytes, checksum=checksum,
                                  create_headers=create, part_headers=common)
            return self._submit("PutObject", bucket, key, upload.start, result=lambda: PutResult(upload.etag, size),
                                releases=[stream.release], clean_abort=True)
        request = HttpRequest("PUT", self._at.path(bucket, key), HttpHeaders(headers), stream)
        return self._submit(
            "PutObject", bucket, key,
            lambda native, on_done: native.crt.make_request(
                type=S3RequestType.PUT_OBJECT, request=request, checksum_config=self._at.put_checksum(),
                multipart_upload_threshold=stream.size + 1 if single_request else None,
                signing_config=native.signing_for(bucket), on_headers=on_headers, on_done=on_done),
            result=lambda: PutResult(etag[0], size),
            releases=[stream.release],
            clean_abort=multipart,
        )

    def _put_headers(self, bucket: str, size: int, content_type: str) -> list[tuple[str, str]]:
        return [("Host", self._at.host_for(bucket)), ("Content-Length", str(size)), ("Content-Type", content_type),
                *self._at.sse_headers(), *self._at.bucket_headers()]

    @property
    def sends_files(self) -> bool:
        """Whether :meth:`put_file` is how large objects go (the CRT reads them from the file);
        with ``transport="sockets"`` they go from memory (:meth:`put`)."""
        return self.config.transport == "crt"

    def put_file(self, bucket: str, key: str, path: str, nbytes: int, *, keep=(), stream_parts: bool = True,
                 content_type: str = "application/octet-stream") -> "Future[PutResult]":
        """Upload the first ``nbytes`` of the file at ``path`` as ``key``. The CRT reads the file
        part by part on its own threads straight into its requests (``S3FileIoOptions(
        should_stream=True)``: no part buffers of its own, no Python in the loop); multipart
        above the threshold, each part with the configured checksum. The ``Content-Length``
        says how many of the file's bytes are the object (the file may be longer). ``keep`` is
        held until the request has ended: what keeps ``path`` naming the file (a
        ``/proc/self/fd`` path names another file once its descriptor is closed and reused).
        ``stream_parts=False`` lets the CRT read each part into a buffer of its pool first (more
        CPU and page faults: ``benchmarks/transport_cpu.py`` measures both)."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3FileIoOptions, S3RequestType

        request = HttpRequest("PUT", self._at.path(bucket, key),
                              HttpHeaders(self._put_headers(bucket, nbytes, content_type)))
        etag, on_headers = etag_of_answer()
        held = [keep]
        return self._submit(
            "PutObject", bucket, key,
            lambda native, on_done: native.crt.make_request(
                type=S3RequestType.PUT_OBJECT, request=request, send_filepath=path,
                fio_options=S3FileIoOptions(should_stream=stream_parts), checksum_config=self._at.put_checksum(),
                signing_config=native.signing_for(bucket), on_headers=on_headers, on_done=on_done),
            result=lambda: PutResult(etag[0], nbytes),
            releases=[held.clear],
            clean_abort=nbytes > self.config.effective_multipart_threshold_bytes,
        )

    def get_range_into(self, bucket: str, key: str, offset: int, dest, *,
                       object_size_bytes: int | None = None) -> "Future[int]":
        """Read ``len(dest)`` bytes of ``key`` starting at ``offset`` into the writable buffer
        ``dest`` (bytearray, memoryview, tensor memory). Large ranges are split into parts
        fetched in parallel. Fails with :class:`IntegrityError` if the object is shorter (or not
        ``object_size_bytes`` long, see :meth:`get_scatter`)."""
        view = memoryview(dest).cast("B")
        return self.get_scatter(bucket, key, offset, offset + view.nbytes, [(offset, view)],
                                object_size_bytes=object_size_bytes)

    def get_scatter(self, bucket: str, key: str, start: int, end: int,
                    sinks: Sequence[tuple[int, memoryview]], *,
                    object_size_bytes: int | None = None) -> "Future[int]":
        """One ranged GET of bytes ``[start, end)`` of ``key``, each arriving byte copied into
        every sink ``(object_offset, writable view)`` that covers it; bytes no sink covers (the
        small holes between coalesced reads) are dropped. Resolves to the bytes received;
        a short object fails with :class:`IntegrityError`, and so does an object that does not
        hold the ``object_size_bytes`` the caller was told, before a byte reaches a sink."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        length = end - start
        if length <= 0:
            done: Future = Future()
            done.set_result(0)
            return done
        sinks = sorted(((off, memoryview(v).cast("B")) for off, v in sinks), key=lambda s: s[0])
        # a list, emptied when the request ends: the caller's buffers are not kept past it
        reach = list(itertools.accumulate((off + v.nbytes for off, v in sinks), max))  # max end so far
        received = [0]

        def on_body(chunk, offset: int, **_):
            chunk_end = offset + len(chunk)
            # the first sink that can overlap: skip every sink that ends (with all before it) before the chunk
            first = bisect.bisect_right(reach, offset)
            for sink_off, view in sinks[first:]:
                if sink_off >= chunk_end:
                    break
                lo, hi = max(offset, sink_off), min(chunk_end, sink_off + view.nbytes)
                if lo < hi:
                    copy_into(view, lo - sink_off, chunk, lo - offset, hi - lo)
            received[0] += len(chunk)

        def short(got: int) -> IntegrityError:
            return IntegrityError(f"s3://{bucket}/{key}: asked for {length} bytes at offset {start}, got {got}"
                                  " — the object is shorter than its metadata says (truncated or replaced)")

        def result(got: int) -> int:
            if got != length:
                raise short(got)
            return length

        def refine(failure: BaseException) -> BaseException:
            # a range that starts past the object's end: 416 from moto and S3 (SeaweedFS sends
            # what there is), the same short object as one that ends early; a 412: the CRT asks
            # for every part after the first If-Match its ETag, so the object changed meanwhile
            if isinstance(failure, S3Error) and failure.status in (412, 416):
                error = short(0) if failure.status == 416 else IntegrityError(
                    f"s3://{bucket}/{key} was replaced while it was read (a later part's If-Match on the "
                    "first part's ETag failed)")
                error.__cause__ = failure
                return error
            return failure

        if self.config.transport == "sockets":  # straight from the socket into the sinks
            read = SocketRead(bucket, key, self._at.host_for(bucket), self._at.path(bucket, key), start, end, sinks,
                              part_size=self.config.download_part_size_bytes, headers=self._at.bucket_headers(),
                              object_size=object_size_bytes)
            return self._submit("GetObject", bucket, key, read.start, result=lambda: result(read.received),
                                releases=[sinks.clear, reach.clear], clean_abort=True)
        headers = [("Host", self._at.host_for(bucket)), ("Range", f"bytes={start}-{end - 1}"),
                   *self._at.bucket_headers()]
        request = HttpRequest("GET", self._at.path(bucket, key), HttpHeaders(headers))
        return self._submit(
            "GetObject", bucket, key,
            lambda native, on_done: native.crt.make_request(
                type=S3RequestType.GET_OBJECT, request=request, on_body=on_body, on_done=on_done,
                on_headers=None if object_size_bytes is None else object_size_check(bucket, key, object_size_bytes),
                part_size=self.config.download_part_size_bytes, signing_config=native.signing_for(bucket)),
            result=lambda: result(received[0]),
            releases=[sinks.clear, reach.clear],
            clean_abort=True,  # a read stopped halfway leaves nothing behind
            refine=refine,
        )

    def get(self, bucket: str, key: str) -> "Future[bytes]":
        """Read a whole (small) object, e.g. the metadata object, in one request."""
        return self._default("GetObject", "GET", bucket, key, result=lambda status, headers, body: body,
                             extra_headers=self._at.bucket_headers())

    # ------------------------------------------------------------------ control plane
    def head(self, bucket: str, key: str) -> "Future[ObjectInfo]":
        """Size, ETag and modification time of ``key``. A missing key and a missing bucket give
        distinct errors (a 404 to HEAD has no body, so the bucket is checked on a 404)."""
        outer: Future = Future()

        def result(status, headers, body) -> ObjectInfo:
            h = {name.lower(): value for name, value in headers}
            return ObjectInfo(key=key, size=int(h.get("content-length", 0)), etag=h.get("etag"),
                              last_modified=parse_http_date(h.get("last-modified")))

        inner = self._default("HeadObject", "HEAD", bucket, key, result=result,
                              extra_headers=self._at.bucket_headers())

        def done(f: Future) -> None:
            err = f.exception()
            if err is None:
                outer.set_result(f.result())
            elif isinstance(err, NoSuchKeyError) and err.code is None:
                self.head_bucket(bucket).add_done_callback(
                    lambda b: outer.set_exception(b.exception() or err))
            else:
                outer.set_exception(err)

        inner.add_done_callback(done)
        return outer

    def head_bucket(self, bucket: str) -> "Future[None]":
        return self._default("HeadBucket", "HEAD", bucket, "", result=lambda status, headers, body: None,
                             extra_headers=self._at.bucket_headers())

    def list(self, bucket: str, prefix: str = "", *, delimiter: str | None = None,
             page_size: int = 1000, first_page_only: bool = False) -> "Future[tuple[list[ObjectInfo], list[str]]]":
        """All objects under ``prefix`` (every page; ``first_page_only``: one request, at most
        ``page_size`` entries), and the common prefixes when a ``delimiter`` is given."""
        return listing.list_objects(self._default, bucket, prefix, delimiter, page_size, self._at.bucket_headers(),
                                    first_page_only=first_page_only)

    def delete(self, bucket: str, keys: Iterable[str]) -> "Future[None]":
        """Delete ``keys`` in batches of 1,000 (DeleteObjects). Missing keys are not errors."""
        return delete_objects(self._default, bucket, keys, self._at.bucket_headers())

    def list_uploads(self, bucket: str, prefix: str = "") -> "Future[list[UploadInfo]]":
        """Unfinished multipart uploads under ``prefix`` (every page)."""
        return listing.list_uploads(self._default, bucket, prefix, self._at.bucket_headers())

    def upload_activity(self, bucket: str, key: str, upload_id: str) -> "Future[float | None]":
        """When an unfinished multipart upload last received a part (seconds since the epoch;
        None when it has no parts yet), from ListParts, every page."""
        return gather([self.upload_parts(bucket, key, upload_id)], lambda found: found[0].newest)

    def upload_parts(self, bucket: str, key: str, upload_id: str) -> "Future[UploadParts]":
        """The parts an unfinished multipart upload holds (count, bytes, newest), from ListParts."""
        return listing.upload_activity(self._default, bucket, key, upload_id, self._at.bucket_headers())

    def abort_upload(self, bucket: str, key: str, upload_id: str) -> "Future[None]":
        """Abort a multipart upload; an upload that is already gone is not an error."""
        outer: Future = Future()
        f = self._default("AbortMultipartUpload", "DELETE", bucket, key, query={"uploadId": upload_id},
                          result=lambda status, headers, body: None, extra_headers=self._at.bucket_headers())

        def done(f: Future) -> None:
            err = f.exception()
            if err is None or (isinstance(err, S3Error) and err.status == 404):
                outer.set_result(None)
            else:
                outer.set_exception(err)

        f.add_done_callback(done)
        return outer

    def copy(self, bucket: str, source_key: str, key: str, size: int, *,
             multipart_threshold_bytes: int = 5 * 1024 ** 3) -> "Future[int]":
        """Server-side copy of ``source_key`` (``size`` bytes, from a HEAD or a listing) to
        ``key`` in the same bucket; no bytes pass through this process. One ``CopyObject`` up
        to ``multipart_threshold_bytes`` (S3's limit is 5 GiB), above it a multipart upload of
        ``UploadPartCopy`` ranges of ``part_size_bytes`` (more when 10,000 parts would not
        do), aborted if any part fails. Resolves to ``size``."""
        return copy_object(self._default, self.abort_upload, bucket, source_key, key, size,
                           part_size_bytes=self.config.part_size_bytes,
                           multipart_threshold_bytes=multipart_threshold_bytes,
                           sse_headers=self._at.sse_headers(), bucket_headers=self._at.bucket_headers())

    def close(self) -> None:
        """Stop using the shared native client. It shuts down once no S3Client uses it and its
        last request has ended (after a short linger, so back-to-back checkpoints reuse its
        connections); requests in flight finish normally. Using this S3Client again is fine:
        it takes a native client again."""
        self._use.release()

    # ------------------------------------------------------------------ internals
    def _native(self) -> "_NativeClient":
        with self._lock:
            native = self._use.native
            if native is None or native.closed:
                self._use.release()
                native = self._use.native = _acquire_native(self.config, self._at.tls, self._profile_given)
            return native

    def _submit(self, operation: str, bucket: str, key: str, start: Callable, *, result: Callable,
                releases: Sequence[Callable[[], None]] = (), clean_abort: bool = False,
                refine: Callable[[BaseException], BaseException] | None = None) -> Future:
        """Queue one CRT meta request; return a future with its translated outcome. Never blocks:
        it may be called from a CRT callback (the next page of a listing).

        ``start(native_client, on_done)`` makes the request once a slot is free (at most
        ``max_concurrency`` per process and configuration). When the request ends, success or
        not, its slot goes to the next queued request, its deadline is dropped and ``releases``
        run, so nothing keeps the caller's buffers alive after the future is done.
        ``clean_abort``: cancelling the request once sent leaves nothing stored (a read, a
        multipart upload), see :meth:`RequestFuture.abort`. ``refine`` maps the translated
        error of a failed request to what it means for this call.
        """
        refine = with_measured_skew(refine, lambda: self._default(  # the CRT withholds a skewed answer's Date
            "HeadBucket", "HEAD", bucket, "", result=lambda status, headers, body: headers))
        call = _Call(operation, bucket, key, start, result, releases, self.config.request_timeout_s, clean_abort,
                     refine)
        self._native().submit(call)
        return call.future

    def _default(self, operation: str, method: str, bucket: str, key: str, *, result: Callable,
                 query: dict | None = None, body: bytes | None = None, extra_headers=()) -> Future:
        """One small request of ``operation``; ``result(status, headers, body)`` makes its value."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        status_headers: list = [None, []]
        chunks: list[bytes] = []

        def on_headers(status_code, headers, **_):
            status_headers[0], status_headers[1] = status_code, headers

        def collect(chunk, **_):
            chunks.append(bytes(chunk))

        path = self._at.path(bucket, key) if key else self._at.bucket_path(bucket)
        if query:
            path += "?" + urlencode(query, quote_via=quote, safe="-_.~")
        headers = [("Host", self._at.host_for(bucket)), *extra_headers]
        stream = None
        if body is not None:
            headers.append(("Content-Length", str(len(body))))
            stream = io.BytesIO(body)
        request = HttpRequest(method, path, HttpHeaders(headers), stream)

        def value():
            return result(status_headers[0], status_headers[1], b"".join(chunks))

        return self._submit(
            operation, bucket, key,
            lambda native, on_done: native.crt.make_request(
                type=S3RequestType.DEFAULT, operation_name=operation, request=request,
                signing_config=native.signing_for(bucket), on_headers=on_headers, on_body=collect, on_done=on_done),
            result=value,
        )

