"""The s3dcp exception hierarchy.

Every error that crosses the library boundary is an :class:`S3DCPError`. Errors that come
from an S3 response carry the bucket, key, HTTP status, S3 error code and request id, and are
classified once, in :func:`s3dcp.s3.responses.translate_error`, by status and error code, never by
message text.

    S3DCPError
    ├── ConfigError                 bad S3Config value or unusable environment
    │   ├── WrongRegionError            (also an S3Error) the bucket is in another region than the one configured
    │   └── ClockSkewError              (also an S3Error) S3 refused the request time: this machine's clock is off
    ├── CheckpointError             checkpoint-level problems
    │   ├── CheckpointNotFoundError     nothing at that path
    │   ├── IncompleteCheckpointError   data objects but no metadata (commit marker)
    │   ├── CheckpointExistsError       saving onto a committed checkpoint without overwrite=True
    │   ├── MetadataFormatError         metadata that is not ours, garbage, or of an unknown version
    │   ├── IntegrityError              checksum mismatch or truncated object
    │   ├── TornCheckpointError         a tensor changed while staging copied it in the background
    │   ├── UnsafePickleError           a non-tensor item holds more than plain data (see allow_pickle)
    │   └── LocalCopyError              a node's local copy (CheckpointManager's local_dir) failed
    │       └── LocalRoomError              (also a ConfigError) no room for it: the budget, the disk
    └── S3Error                     a failed S3 request
        ├── AccessDeniedError           403: wrong or missing credentials, no permission
        ├── NoSuchBucketError           the bucket does not exist
        ├── NoSuchKeyError              the key does not exist
        ├── PreconditionFailedError     a conditional request lost (If-None-Match: *)
        ├── ThrottlingError             503 SlowDown and friends, after retries
        ├── S3ServerError               5xx after retries
        ├── S3ConnectionError           no HTTP answer: refused, reset, timed out
        └── RequestAbortedError         stopped by s3dcp: the save or load it served failed or was interrupted
"""

from __future__ import annotations

__all__ = [
    "S3DCPError",
    "ConfigError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "MetadataFormatError",
    "IntegrityError",
    "TornCheckpointError",
    "UnsafePickleError",
    "LocalCopyError",
    "LocalRoomError",
    "PeerReadError",
    "S3Error",
    "AccessDeniedError",
    "NoSuchBucketError",
    "NoSuchKeyError",
    "PreconditionFailedError",
    "ThrottlingError",
    "S3ServerError",
    "S3ConnectionError",
    "RequestAbortedError",
    "WrongRegionError",
    "ClockSkewError",
    "unwrap_error",
]


class S3DCPError(Exception):
    """Base class of every error raised by s3dcp."""


class ConfigError(S3DCPError, ValueError):
    """An S3Config field, a URI or the environment has a value s3dcp cannot use."""


class CheckpointError(S3DCPError):
    """A checkpoint-level problem (missing, incomplete, already there, corrupt)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (neither metadata nor data objects) exists at the path."""


class IncompleteCheckpointError(CheckpointError):
    """Data objects exist but the metadata object, written last as the commit marker, does not."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists at the path and overwrite was not requested."""


class MetadataFormatError(CheckpointError):
    """The metadata object is not s3dcp metadata, is corrupt, or has an unsupported format version."""


class IntegrityError(CheckpointError):
    """Stored bytes do not match their recorded checksum or length."""


class TornCheckpointError(CheckpointError):
    """A tensor changed while background staging still copied it (the training loop did not
    wait for staging): the save is refused before anything is committed. ``names`` lists the
    tensors that changed."""

    def __init__(self, message: str, *, names: list[str] | None = None) -> None:
        super().__init__(message)
        self.names = list(names or [])

    def __reduce__(self):  # keeps ``names`` across pickling (DCP's process executor, gathered errors)
        return type(self), (self.args[0],), {"names": self.names}


class UnsafePickleError(CheckpointError):
    """A non-tensor item would need arbitrary unpickling to load (the reader's ``allow_pickle``)."""


class LocalCopyError(CheckpointError):
    """A node's local copy of a checkpoint (``CheckpointManager(local_dir=...)``) could not be
    written or committed: the directory, the disk's room, its permissions. A step that also goes
    to S3 is committed there all the same (the copy is reported failed); a step kept only on the
    nodes fails on every rank."""


class LocalRoomError(LocalCopyError, ConfigError):
    """``local_budget_bytes`` or the ``local_dir``'s disk has no room for a checkpoint's copy
    beside the newest complete one (raise the budget, give the tmpfs more room, or save less)."""


class PeerReadError(S3DCPError):
    """Another rank of a cooperative load (``S3StorageReader(cooperative=True)``) failed, so
    this rank stopped with it; ``failed_ranks`` lists them, and their own errors say why. A
    collateral error: :func:`unwrap_error` prefers the failing rank's."""

    collateral = True

    def __init__(self, message: str, failed_ranks: list[int] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)

    def __reduce__(self):  # travels between ranks inside DCP's CheckpointException
        return type(self), (str(self), self.failed_ranks)


def root_error(error: BaseException) -> BaseException:
    """The original error inside DCP's ``CheckpointException`` (which wraps each failed rank's
    error with its traceback); any other error as it is. Prefer :func:`unwrap_error`, which
    also says which ranks failed and prefers s3dcp's error to a rank's collateral one."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else getattr(first, "exception", first)
        if isinstance(inner, BaseException):
            return inner
    return error


def unwrap_error(error: BaseException) -> BaseException:
    """The exception that caused DCP's ``CheckpointException`` ``error``, with ``failed_ranks``
    (ascending), ``rank_errors`` ({rank: exception}) and ``checkpoint_exception`` (``error``,
    which holds every failed rank's traceback as text) attached; any other exception as it is.

    The cause is the lowest failing rank's error, preferring an s3dcp error over another
    rank's collateral one (a rank that failed only because a peer did). It is what
    ``s3dcp.save``/``load``/``async_save`` and :class:`~s3dcp.CheckpointManager` raise, and
    what to use around DCP's own calls::

        try:
            dcp.save(state_dict, storage_writer=S3StorageWriter(uri))
        except BaseException as e:  # CheckpointException is a BaseException
            raise s3dcp.unwrap_error(e)

    Raised so, it prints one traceback: its own frames (they run through DCP to where it was
    raised) and its own ``__cause__`` (an S3 error under a missing checkpoint, say), not DCP's
    exception again, whose text repeats the same frames (``__suppress_context__`` is set).
    """
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures or isinstance(error, Exception):
        return error
    rank_errors: dict[int, BaseException] = {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        if isinstance(inner, BaseException):
            rank_errors[rank] = inner
    if not rank_errors:
        return error
    ours = [e for e in rank_errors.values() if isinstance(e, S3DCPError)]
    ours = [e for e in ours if not getattr(e, "collateral", False)] or ours
    cause = ours[0] if ours else next(iter(rank_errors.values()))
    try:
        cause.failed_ranks = sorted(rank_errors)
        cause.rank_errors = rank_errors
        cause.checkpoint_exception = error  # DCP's report (every rank's traceback) stays reachable
    except AttributeError:  # an exception type with __slots__: give it back as it is
        pass
    cause.__suppress_context__ = True  # raised inside `except CheckpointException`: not printed again
    return cause


class S3Error(S3DCPError):
    """A failed S3 request.

    Attributes name what failed so that a user can act on it; any of them may be ``None``
    when the failure happened before an HTTP response (see :class:`S3ConnectionError`).
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str | None = None,
        bucket: str | None = None,
        key: str | None = None,
        status: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
    ) -> None:
        self.operation = operation
        self.bucket = bucket
        self.key = key
        self.status = status
        self.code = code
        self.request_id = request_id
        super().__init__(self._format(message))

    def _format(self, message: str) -> str:
        where = f"s3://{self.bucket}/{self.key or ''}" if self.bucket else None
        details = [
            f"{name}={value}"
            for name, value in (
                ("operation", self.operation),
                ("object", where),
                ("status", self.status),
                ("code", self.code),
                ("request_id", self.request_id),
            )
            if value is not None
        ]
        return f"{message} ({', '.join(details)})" if details else message

    def __reduce__(self):
        # Keep the attributes when the error crosses a process boundary (DCP's process executor).
        return (_rebuild_s3_error, (type(self), self.args[0], self.__dict__.copy()))


def _rebuild_s3_error(cls, text, attrs):
    err = cls.__new__(cls)
    Exception.__init__(err, text)
    err.__dict__.update(attrs)
    return err


class AccessDeniedError(S3Error, PermissionError):
    """HTTP 403: the credentials are wrong, missing, or lack permission."""


class NoSuchBucketError(S3Error):
    """The bucket does not exist (or is not visible to these credentials)."""


class NoSuchKeyError(S3Error, FileNotFoundError):
    """The key does not exist."""


class PreconditionFailedError(S3Error, FileExistsError):
    """A conditional request failed: an ``If-None-Match: *`` PUT found the key already there."""


class ThrottlingError(S3Error):
    """The server kept asking us to slow down (503 SlowDown) after all retries."""


class S3ServerError(S3Error):
    """The server kept failing (HTTP 5xx) after all retries."""


class S3ConnectionError(S3Error, ConnectionError):
    """No usable HTTP answer: connection refused or reset, DNS failure, or a timeout."""


class RequestAbortedError(S3Error):
    """s3dcp stopped the request before it ended, because the save or load it served had
    already failed or was interrupted (Ctrl-C); that first error is what the caller sees."""


class WrongRegionError(S3Error, ConfigError):
    """S3 answered that the bucket is in another region (301 PermanentRedirect, or a 400 naming
    the region): :attr:`bucket_region` names it (None where S3 did not), and the message says
    which setting to change. Not followed, see docs/aws.md."""

    def __init__(self, message: str, *, bucket_region: str | None = None, **fields) -> None:
        self.bucket_region = bucket_region
        super().__init__(message, **fields)


class ClockSkewError(S3Error, ConfigError):
    """S3 refused the request's time (``RequestTimeTooSkewed``): this machine's clock differs from
    S3's by more than S3 allows (15 minutes). :attr:`skew_s` is by how many seconds the clock is
    ahead (negative: behind), or None where no answer said the server's time."""

    def __init__(self, message: str, *, skew_s: float | None = None, **fields) -> None:
        self.skew_s = skew_s
        super().__init__(message, **fields)


# S3 could not be reached or did not serve (after retries), as opposed to S3 refusing a request:
# the local tier restores and saves on through these (CheckpointManager with local_dir)
UNREACHABLE = (S3ConnectionError, S3ServerError, ThrottlingError)
