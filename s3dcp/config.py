"""S3Config: every knob of s3dcp in one frozen, validated dataclass.

Unset fields are filled by :meth:`S3Config.resolved` from the same places, in the same order,
as botocore: explicit argument, then ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_CA_BUNDLE``, then the shared config file of
``AWS_PROFILE`` (``region``, ``endpoint_url``, ``ca_bundle``, ``s3.addressing_style``). Credentials are not resolved here:
explicit keys, when given, are used as they are; otherwise the CRT's default credential
chain (environment, profile, web identity, ECS, IMDS) is asked at request time.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .errors import ConfigError

__all__ = ["S3Config", "MiB", "GiB"]

MiB = 1024 * 1024
GiB = 1024 * MiB
_CRT_MIN_MEMORY_BYTES = 256 * MiB  # the CRT refuses a smaller memory limit
_IN_FLIGHT_S = 0.25  # part buffers for this long at the target throughput

MIN_PART_SIZE_BYTES = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE_BYTES = 5 * GiB  # S3's maximum part size
CHECKSUMS = ("crc32c", "crc64nvme", None)
ADDRESSING_STYLES = ("auto", "path", "virtual")
SSE_MODES = (None, "AES256", "aws:kms")
# What the store accepts (docs/compatibility.md): "s3" flexible checksums in trailers and
# If-None-Match on PUT; "gcs" neither, create-only by x-goog-if-generation-match: 0; "basic"
# neither, create-only by a checked PUT.
COMPAT_MODES = ("s3", "gcs", "basic")
TRANSPORTS = ("sockets", "crt")  # see s3dcp.s3.sockets and s3dcp.s3.socket_reads
_GCS_HOSTS = ("storage.googleapis.com",)
log = logging.getLogger("s3dcp")
_UNVERIFIED: set[str] = set()  # https endpoints already warned of (verify_tls=False): once each per process


@dataclass(frozen=True)
class S3Config:
    """How s3dcp reaches S3 and how it moves bytes.

    All sizes are in bytes and all times in seconds; the unit is part of each name.
    ``None`` means "resolve from the environment" (see :meth:`resolved`) or "no limit".
    """

    region: str | None = None
    endpoint_url: str | None = None
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    # Transfer shape.
    part_size_bytes: int = 64 * MiB  # upload parts
    download_part_size_bytes: int = 8 * MiB  # ranged GETs a large read is split into (smaller: less buffering)
    multipart_threshold_bytes: int | None = None  # None: same as part_size_bytes
    throughput_target_gbps: float = 10.0
    max_concurrency: int = 16  # requests s3dcp keeps in flight per process (objects / ranges)
    object_size_target_bytes: int = 512 * MiB  # how much one rank packs into one data object
    coalesce_gap_bytes: int = 1 * MiB  # read ranges closer than this are fetched as one GET
    key_prefix_spread: int = 1  # data object names spread over this many key prefixes (S3 rates scale per prefix)
    crt_memory_limit_bytes: int | None = None  # cap on the CRT's part buffers; None: max(256 MiB, 4 parts); 0: CRT's own (2+ GiB)
    transport: str | None = None  # None: S3DCP_TRANSPORT, else "crt" (the AWS CRT moves every byte); "sockets": opt-in

    # Integrity.
    checksum: str | None = "crc32c"  # item checksums in the metadata, and on the wire when compat="s3"

    # What the store supports: None is S3DCP_COMPAT, else detected from the endpoint (COMPAT_MODES).
    compat: str | None = None

    # Reliability.
    max_retries: int = 5
    retry_backoff_base_ms: int = 200
    retry_max_backoff_s: int = 10
    connect_timeout_s: float = 10.0
    request_timeout_s: float | None = 600.0  # bound on one whole object transfer; None: unbounded

    # Addressing and transport.
    addressing_style: str | None = None  # "auto" | "path" | "virtual"; None: from profile, else auto
    verify_tls: bool = True  # True or False only; False logs a warning naming the endpoint
    ca_bundle: str | None = None

    # Server-side encryption and ownership checks, passed through as headers.
    sse: str | None = None  # None | "AES256" | "aws:kms"
    sse_kms_key_id: str | None = None
    expected_bucket_owner: str | None = None
    requester_pays: bool = False  # x-amz-request-payer: requester on every request (requester-pays buckets)

    # Staging (async_save).
    staging_budget_bytes: int | None = None  # None: stage the whole state at once
    max_inflight_checkpoints: int = 1
    staging: str = "blocking"  # "background": async_save returns before the copy; wait for it (docs/memory.md)

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise ConfigError("invalid S3Config: " + "; ".join(problems))

    def replace(self, **changes) -> "S3Config":
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- resolution
    def resolved(self, environ: os._Environ | dict | None = None) -> "S3Config":
        """Return a copy with region, endpoint and addressing style filled in.

        ``environ`` defaults to ``os.environ``; tests pass a dict.
        """
        env = os.environ if environ is None else environ
        profile = self.profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
        file_cfg = _profile_config(profile, env)
        s3_section = file_cfg.get("s3") if isinstance(file_cfg.get("s3"), dict) else {}

        region = (
            self.region
            or env.get("AWS_REGION")
            or env.get("AWS_DEFAULT_REGION")
            or file_cfg.get("region")
            or "us-east-1"
        )
        endpoint = (
            self.endpoint_url
            or env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL")
            or s3_section.get("endpoint_url")
            or file_cfg.get("endpoint_url")
            or f"https://s3.{region}.amazonaws.com"
        )
        endpoint = normalize_endpoint(endpoint)
        if self.verify_tls is False and endpoint.startswith("https://") and endpoint not in _UNVERIFIED:
            _UNVERIFIED.add(endpoint)
            log.warning("verify_tls=False: TLS certificates of %s are not checked; anyone on the way can read and "
                        "change what s3dcp sends and gets (ca_bundle trusts a private CA instead)", endpoint)
        style = self.addressing_style or s3_section.get("addressing_style") or "auto"
        return dataclasses.replace(
            self, region=region, endpoint_url=endpoint, profile=profile, addressing_style=style,
            compat=self.compat or _compat_from_env(env) or detect_compat(endpoint),
            transport=self.resolved_transport(env), ca_bundle=self._resolved_ca_bundle(env, file_cfg),
        )

    def resolved_transport(self, environ: os._Environ | dict | None = None) -> str:
        """The transport :meth:`resolved` gives: ``transport``, else ``S3DCP_TRANSPORT``, else "crt"."""
        return self.transport or _transport_from_env(os.environ if environ is None else environ) or "crt"

    def _resolved_ca_bundle(self, env, file_cfg: dict) -> str | None:
        """``ca_bundle``, else ``AWS_CA_BUNDLE``, else the profile's ``ca_bundle`` (botocore's order);
        a file that is not there is refused here, naming where the path came from."""
        for source, path in (("ca_bundle", self.ca_bundle), ("AWS_CA_BUNDLE", env.get("AWS_CA_BUNDLE")),
                             ("the profile's ca_bundle", file_cfg.get("ca_bundle"))):
            if path:
                path = os.path.expanduser(path)
                if not os.path.isfile(path):
                    raise ConfigError(f"{source}={path!r} is not a file: name a PEM file of CA certificates")
                return path
        return None

    @property
    def use_path_style(self) -> bool:
        """Path-style (``/bucket/key``) unless virtual-hosted was asked for on an AWS endpoint."""
        style = self.addressing_style or "auto"
        if style == "path":
            return True
        if style == "virtual":
            return False
        host = urlsplit(self.endpoint_url or "").hostname or ""
        return not host.endswith("amazonaws.com")

    @property
    def effective_multipart_threshold_bytes(self) -> int:
        return self.multipart_threshold_bytes or self.part_size_bytes

    @property
    def effective_crt_memory_limit_bytes(self) -> int | None:
        """The cap on the CRT's part buffers that s3dcp asks for (None: the CRT's own default).

        Unset, it is sized from what is in use: the larger of four parts, a quarter second of
        ``throughput_target_gbps`` (bytes in flight = bandwidth × latency), and the CRT's minimum
        of 256 MiB. With the defaults (64 MiB parts, 10 Gb/s) that is 298 MiB instead of the
        CRT's multi-GiB default, so a process's memory is its state, its staging pool and this;
        ``throughput_target_gbps=100`` gives ~3 GiB for 100 Gb/s NICs."""
        if self.crt_memory_limit_bytes == 0:
            return None
        if self.crt_memory_limit_bytes is not None:
            return self.crt_memory_limit_bytes
        in_flight = int(self.throughput_target_gbps * 1e9 / 8 * _IN_FLIGHT_S)
        return -(-max(_CRT_MIN_MEMORY_BYTES, 4 * self.part_size_bytes, in_flight) // MiB) * MiB


def normalize_endpoint(endpoint: str) -> str:
    """Give an endpoint a scheme (https unless it is a loopback address) and drop a trailing '/'.
    An IPv6 address goes in brackets (``http://[::1]:9000``, ``http://[::1]``), as in any URL."""
    endpoint = endpoint.strip().rstrip("/")
    if "://" not in endpoint:
        netloc = endpoint.split("/")[0]
        host = netloc[1:netloc.find("]")] if netloc.startswith("[") else netloc.rsplit(":", 1)[0]
        endpoint = ("http://" if is_loopback_host(host) else "https://") + endpoint
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - parsing it raises ValueError for a bad port
    except ValueError as e:
        raise ConfigError(f"endpoint_url={endpoint!r} is not a URL ({e}); an IPv6 address goes in brackets: "
                          "http://[::1]:9000") from None
    netloc = parts.netloc.rpartition("@")[2]
    if netloc.startswith("[") and not re.fullmatch(r"\[[^\]]+\](:[0-9]+)?", netloc) or (
            netloc.count(":") > 1 and not netloc.startswith("[")):
        raise ConfigError(f"endpoint_url={endpoint!r}: an IPv6 address goes in brackets, with the port after "
                          "them: http://[::1]:9000")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"endpoint_url={endpoint!r} is not an http(s) URL with a host")
    if parts.path not in ("", "/"):
        raise ConfigError(f"endpoint_url={endpoint!r} must not have a path; put the bucket in the s3:// URI")
    return endpoint


def _compat_from_env(env) -> str | None:
    """``S3DCP_COMPAT``, for tools that build their config themselves (the ``s3dcp`` command)."""
    value = (env.get("S3DCP_COMPAT") or "").strip() or None
    if value is not None and value not in COMPAT_MODES:
        raise ConfigError(f"S3DCP_COMPAT={value!r} must be one of {COMPAT_MODES}")
    return value


def _transport_from_env(env) -> str | None:
    """``S3DCP_TRANSPORT``, for tools that build their config themselves (the ``s3dcp`` command,
    the trainer integrations' job configs)."""
    value = (env.get("S3DCP_TRANSPORT") or "").strip() or None
    if value is not None and value not in TRANSPORTS:
        raise ConfigError(f"S3DCP_TRANSPORT={value!r} must be one of {TRANSPORTS}")
    return value


def detect_compat(endpoint_url: str) -> str:
    """The compatibility mode an endpoint needs, by its host name alone (nothing is sent):
    "gcs" for Google Cloud Storage's XML API, else "s3". Other stores cannot be told apart by
    name (a MinIO or Ceph endpoint is any host), so they need ``compat="basic"`` set."""
    host = (urlsplit(endpoint_url).hostname or "").lower().rstrip(".")
    if any(host == h or host.endswith("." + h) for h in _GCS_HOSTS):
        return "gcs"
    return "s3"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an IP literal) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _profile_config(profile: str | None, env) -> dict:
    """The profile's section of the shared config file, via botocore (which knows the format)."""
    if not profile and not env.get("AWS_CONFIG_FILE") and not os.path.exists(
        os.path.expanduser("~/.aws/config")
    ):
        return {}
    try:
        from botocore.configloader import load_config
    except ImportError:  # pragma: no cover - botocore is a dependency
        return {}
    path = os.path.expanduser(env.get("AWS_CONFIG_FILE", "~/.aws/config"))
    if not os.path.exists(path):
        if profile and profile != "default":
            raise ConfigError(f"AWS profile {profile!r} requested but config file {path} does not exist")
        return {}
    profiles = load_config(path).get("profiles", {})
    name = profile or "default"
    if name not in profiles:
        if profile and profile != "default":
            raise ConfigError(f"AWS profile {profile!r} not found in {path}")
        return {}
    return profiles[name]


def _validate(c: S3Config) -> list[str]:
    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(c.part_size_bytes):
        problems.append(f"part_size_bytes={c.part_size_bytes!r} must be an int")
    else:
        need(
            c.part_size_bytes >= MIN_PART_SIZE_BYTES,
            f"part_size_bytes={c.part_size_bytes} is below S3's 5 MiB minimum ({MIN_PART_SIZE_BYTES})",
        )
        need(
            c.part_size_bytes <= MAX_PART_SIZE_BYTES,
            f"part_size_bytes={c.part_size_bytes} is above S3's 5 GiB maximum ({MAX_PART_SIZE_BYTES})",
        )
    need(
        is_int(c.download_part_size_bytes) and 256 * 1024 <= c.download_part_size_bytes <= MAX_PART_SIZE_BYTES,
        f"download_part_size_bytes={c.download_part_size_bytes!r} must be an int in [256 KiB, 5 GiB]",
    )
    if c.multipart_threshold_bytes is not None:
        need(
            is_int(c.multipart_threshold_bytes) and c.multipart_threshold_bytes >= MIN_PART_SIZE_BYTES,
            f"multipart_threshold_bytes={c.multipart_threshold_bytes!r} must be an int >= 5 MiB",
        )
    need(
        isinstance(c.throughput_target_gbps, (int, float)) and 0 < c.throughput_target_gbps <= 800,
        f"throughput_target_gbps={c.throughput_target_gbps!r} must be in (0, 800]",
    )
    need(
        is_int(c.max_concurrency) and 1 <= c.max_concurrency <= 1024,
        f"max_concurrency={c.max_concurrency!r} must be an int in [1, 1024]",
    )
    need(
        is_int(c.object_size_target_bytes) and c.object_size_target_bytes >= 1 * MiB,
        f"object_size_target_bytes={c.object_size_target_bytes!r} must be an int >= 1 MiB",
    )
    need(
        is_int(c.coalesce_gap_bytes) and c.coalesce_gap_bytes >= 0,
        f"coalesce_gap_bytes={c.coalesce_gap_bytes!r} must be an int >= 0",
    )
    need(
        c.crt_memory_limit_bytes is None or c.crt_memory_limit_bytes == 0
        or (is_int(c.crt_memory_limit_bytes) and c.crt_memory_limit_bytes >= _CRT_MIN_MEMORY_BYTES
            and c.crt_memory_limit_bytes > (c.part_size_bytes if is_int(c.part_size_bytes) else 0)),
        f"crt_memory_limit_bytes={c.crt_memory_limit_bytes!r} must be None (sized from the part size), "
        "0 (the CRT's own default) or an int >= 256 MiB and above part_size_bytes (the CRT's minimum)",
    )
    need(
        is_int(c.key_prefix_spread) and 1 <= c.key_prefix_spread <= 256,
        f"key_prefix_spread={c.key_prefix_spread!r} must be an int in [1, 256]",
    )
    need(c.checksum in CHECKSUMS, f"checksum={c.checksum!r} must be one of {CHECKSUMS}")
    need(c.transport is None or c.transport in TRANSPORTS, f"transport={c.transport!r} must be one of {TRANSPORTS}")
    need(c.compat is None or c.compat in COMPAT_MODES,
         f"compat={c.compat!r} must be None (detected from the endpoint) or one of {COMPAT_MODES}")
    need(
        is_int(c.max_retries) and 0 <= c.max_retries <= 100,
        f"max_retries={c.max_retries!r} must be an int in [0, 100]",
    )
    need(
        is_int(c.retry_backoff_base_ms) and c.retry_backoff_base_ms >= 1,
        f"retry_backoff_base_ms={c.retry_backoff_base_ms!r} must be an int >= 1",
    )
    need(
        is_int(c.retry_max_backoff_s) and c.retry_max_backoff_s >= 1,
        f"retry_max_backoff_s={c.retry_max_backoff_s!r} must be an int >= 1",
    )
    need(
        isinstance(c.connect_timeout_s, (int, float)) and c.connect_timeout_s > 0,
        f"connect_timeout_s={c.connect_timeout_s!r} must be > 0",
    )
    need(
        c.request_timeout_s is None
        or (isinstance(c.request_timeout_s, (int, float)) and c.request_timeout_s > 0),
        f"request_timeout_s={c.request_timeout_s!r} must be > 0 or None",
    )
    need(
        c.addressing_style is None or c.addressing_style in ADDRESSING_STYLES,
        f"addressing_style={c.addressing_style!r} must be one of {ADDRESSING_STYLES}",
    )
    need(c.sse in SSE_MODES, f"sse={c.sse!r} must be one of {SSE_MODES}")
    need(isinstance(c.requester_pays, bool), f"requester_pays={c.requester_pays!r} must be True or False")
    need(type(c.verify_tls) is bool,  # None, 0 or "" used to turn the checks off without a word
         f"verify_tls={c.verify_tls!r} must be True or False (leave it out for the default, True)")
    need(
        c.sse_kms_key_id is None or c.sse == "aws:kms",
        "sse_kms_key_id is set but sse is not 'aws:kms'",
    )
    need(
        c.staging_budget_bytes is None
        or (is_int(c.staging_budget_bytes) and c.staging_budget_bytes >= 1 * MiB),
        f"staging_budget_bytes={c.staging_budget_bytes!r} must be None or an int >= 1 MiB",
    )
    need(
        is_int(c.max_inflight_checkpoints) and 1 <= c.max_inflight_checkpoints <= 8,
        f"max_inflight_checkpoints={c.max_inflight_checkpoints!r} must be an int in [1, 8]",
    )
    need(c.staging in ("blocking", "background"), f"staging={c.staging!r} must be 'blocking' or 'background'")
    need(
        (c.access_key_id is None) == (c.secret_access_key is None),
        "access_key_id and secret_access_key must be given together",
    )
    if c.endpoint_url is not None:
        try:
            normalize_endpoint(c.endpoint_url)
        except ConfigError as e:
            problems.append(str(e))
    return problems
