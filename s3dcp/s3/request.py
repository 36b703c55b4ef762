"""One S3 request from submission to its end: its future, its deadline, its abort, its slot.

    S3Client._submit ──► _Call ──(a free slot)──► CRT meta request ──on_done──► _end: release, free slot, future

Owns :class:`RequestFuture` (a future that can abort its request), :func:`abort_all`,
:func:`abort_and_wait`, and ``_Call``, which holds a request's references (CRT request,
deadline, caller buffers) only until it ends and translates its outcome. It must not build
requests (:mod:`s3dcp.s3.client`) nor decide when a request gets a slot (the admission queue of
:mod:`s3dcp.s3.native`, whose native client is handed to :meth:`_Call.start`); it imports neither.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any, Iterable, Protocol

from ..errors import RequestAbortedError, S3ConnectionError, S3DCPError
from .responses import translate_error
from .streams import deadlines

__all__ = ["RequestFuture", "abort_all", "abort_and_wait"]


class Slots(Protocol):
    """What a call needs of the native client it runs on (:class:`s3dcp.s3.native._NativeClient`)."""

    crt: Any  # the awscrt S3Client that makes the request
    sender: Any  # the SocketSender of multipart uploads and ranged reads (s3dcp.s3.sender), or None

    def unqueue(self, call: "_Call") -> bool:
        """Take a call that has not started out of the queue; False if it is not there."""

    def finished(self) -> None:
        """A started call ended: its slot goes to the next one."""


class RequestFuture(Future):
    """The future of one S3 request, which can be stopped with :meth:`abort`."""

    def __init__(self, call: "_Call") -> None:
        super().__init__()
        self._call: _Call | None = call  # dropped when the request ends

    def abort(self, *, only_if_clean: bool = False) -> None:
        """Stop the request: one still queued never starts; one in flight is cancelled in the
        CRT (which also aborts a multipart upload). The future then fails with
        :class:`RequestAbortedError`, or keeps the outcome the request had already reached; it
        is done only once the CRT holds none of the request's buffers. Never blocks.

        A single PUT cancelled after its body went out may still be stored by the server, even
        after a DELETE that followed it. ``only_if_clean`` leaves such a request to finish:
        only a queued request, a read or a multipart upload (whose parts the abort discards)
        is stopped."""
        call = self._call
        if call is not None:
            call.abort(only_if_clean=only_if_clean)


def abort_all(futures: Iterable[Future], *, only_if_clean: bool = False) -> None:
    """Abort every request of ``futures`` not over yet (others are left alone); never blocks."""
    for f in futures:
        if isinstance(f, RequestFuture) and not f.done():
            f.abort(only_if_clean=only_if_clean)


def abort_and_wait(futures: Iterable[Future], *, only_if_clean: bool = False) -> None:
    """Abort the requests of ``futures`` not over yet (see :meth:`RequestFuture.abort`) and wait
    until every one has ended (the CRT then holds none of their buffers). Used when a save or
    load fails or is interrupted, before its buffers are let go."""
    futures = list(futures)
    abort_all(futures, only_if_clean=only_if_clean)
    wait(futures)


class _Call:
    """One request from submission to its end: what starts it, the future it completes, and
    the references (request, deadline, caller buffers) dropped the moment it ends."""

    __slots__ = ("operation", "bucket", "key", "_start", "_result", "_refine", "_releases", "_timeout_s",
                 "_clean_abort", "future", "_request", "_deadline", "_timed_out", "_aborted", "_finished", "_native",
                 "_waits_in")

    def __init__(self, operation, bucket, key, start, result, releases, timeout_s, clean_abort=False,
                 refine=None) -> None:
        self.operation, self.bucket, self.key = operation, bucket, key
        self._start, self._result, self._releases = start, result, list(releases)
        # what a translated failure means for this call (e.g. 416: a short object); a future of
        # that error where it takes one more request to say (the clock's skew)
        self._refine = refine
        self._timeout_s = timeout_s
        self._clean_abort = clean_abort  # see RequestFuture.abort
        self.future = RequestFuture(self)
        self._request = None
        self._deadline = None
        self._timed_out = False
        self._aborted = False
        self._finished = False
        self._native: Slots | None = None
        self._waits_in: Slots | None = None  # the native client whose queue it may wait in

    def start(self, native: Slots) -> bool:
        """Make the CRT request; False if that failed or the call was aborted while it waited
        (the call is then over, its future failed)."""
        self._native = native
        if self._aborted:
            self._end(error=self._abort_error(), free_slot=False)
            return False
        # The request may end on a CRT thread before _start returns: the deadline exists before
        # it (so _end always finds it to cancel), and the request is kept only if not over yet.
        if self._timeout_s is not None:
            self._deadline = deadlines().add(self._timeout_s, self._expire)
        try:
            request = self._start(native, self._on_done)
        except BaseException as e:  # noqa: BLE001 - reaches the future
            self._end(error=e, free_slot=False)
            return False
        self._request = request
        if self._finished:  # _end sets _finished before it clears _request: one of us clears it
            self._request = None
        elif self._timed_out or self._aborted:  # the deadline passed, or abort(), before make_request returned
            request.cancel()
        return True

    def abort(self, *, only_if_clean: bool = False) -> None:
        """Stop the request (see :meth:`RequestFuture.abort`)."""
        if self._finished:
            return
        sent_is_fine = self._clean_abort or not only_if_clean
        if sent_is_fine:
            self._aborted = True  # start(), if it is about to run, cancels what it makes
        queue = self._waits_in
        if queue is not None and queue.unqueue(self):  # never started: over now
            self._aborted = True
            self._end(error=self._abort_error(), free_slot=False)
            return
        if not sent_is_fine:
            return
        request = self._request  # None: start() is making it, and cancels it once stored
        if request is not None:
            request.cancel()

    def _abort_error(self) -> RequestAbortedError:
        return RequestAbortedError(f"{self.operation} aborted", operation=self.operation,
                                   bucket=self.bucket, key=self.key)

    def _expire(self) -> None:
        if self._finished:
            return
        self._timed_out = True  # start() cancels a request it has not stored yet
        request = self._request
        if request is not None:
            request.cancel()

    def _on_done(self, error=None, **_) -> None:
        # Runs once on a CRT thread; must not block.
        self._end(error=error, free_slot=True)

    def _end(self, *, error, free_slot: bool) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            if error is None:
                value, failure = self._result(), None
            elif self._timed_out:
                value, failure = None, S3ConnectionError(
                    f"{self.operation} timed out after request_timeout_s={self._timeout_s}",
                    operation=self.operation, bucket=self.bucket, key=self.key)
                failure.__cause__ = error
            elif isinstance(error, S3DCPError):
                value, failure = None, error
            elif self._aborted:
                value, failure = None, self._abort_error()
                failure.__cause__ = error
            else:  # keeps the CRT error as __cause__
                value, failure = None, translate_error(error, operation=self.operation,
                                                       bucket=self.bucket, key=self.key)
                if self._refine is not None:
                    failure = self._refine(failure)
        except BaseException as e:  # noqa: BLE001 - e.g. a short read found by result()
            value, failure = None, e
        # Let go of everything this request held before anyone hears of its outcome.
        if self._deadline is not None:
            self._deadline.cancel()
        for release in self._releases:
            release()
        self._start = self._result = self._refine = self._request = self._deadline = self._waits_in = None
        self._releases = []
        self.future._call = None
        native, self._native = self._native, None
        if free_slot and native is not None:
            native.finished()
        if failure is None:
            self.future.set_result(value)
        elif isinstance(failure, Future):  # refine sent a follow-up request to say what failed (clock.py)
            failure.add_done_callback(lambda f: self.future.set_exception(f.result()))
        else:
            self.future.set_exception(failure)
