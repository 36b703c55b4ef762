"""How one awscrt S3Client is built from an :class:`~s3dcp.config.S3Config`.

Owns credential resolution (:func:`_credential_source`, boto3's order) and the construction of
the CRT client (credentials provider, signing, TLS, retries, part size, memory limit, S3 Express
session auth) and of the signing config that :mod:`s3dcp.s3.sender` shares with it. It must
not share, cache or close clients (:mod:`s3dcp.s3.native`) nor make requests.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..config import S3Config


def _credential_source(config: S3Config, profile_given: bool, environ) -> tuple:
    """Where this client's credentials come from, in boto3's order: keys in the config, a
    profile named in code, keys in the environment (read now, not when the process started),
    the profile from the environment, then the CRT's default chain (web identity, ECS, IMDS)."""
    if config.access_key_id is not None:
        return ("static", config.access_key_id, config.secret_access_key, config.session_token)
    if profile_given and config.profile:
        return ("profile", config.profile)
    key_id, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if key_id and secret:
        return ("static", key_id, secret, environ.get("AWS_SESSION_TOKEN") or None)
    if config.profile:
        return ("profile", config.profile)
    return ("default",)


def _make_crt_client(config: S3Config, tls: bool, source: tuple):
    """The CRT client, and the signing config it signs with (the socket transfers sign with it too).

    S3 Express One Zone is enabled: a request signed with :func:`express_signing` (a directory
    bucket's) gets its credentials from a session the CRT makes (CreateSession) and renews; the
    others are signed as they are."""
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.io import ClientBootstrap, ClientTlsContext, TlsConnectionOptions, TlsContextOptions
    from awscrt.s3 import S3Client as CrtS3Client
    from awscrt.s3 import S3RequestTlsMode, S3RetryConfig, create_default_s3_signing_config

    bootstrap = ClientBootstrap.get_or_create_static_default()
    if source[0] == "static":
        credentials = AwsCredentialsProvider.new_static(*source[1:])
    elif source[0] == "profile":
        credentials = AwsCredentialsProvider.new_profile(bootstrap, profile_name=source[1])
    else:
        credentials = AwsCredentialsProvider.new_default_chain(bootstrap)
    signing = create_default_s3_signing_config(region=config.region, credential_provider=credentials)
    tls_options = None
    if tls:
        ctx_options = TlsContextOptions()
        ctx_options.verify_peer = config.verify_tls
        if config.ca_bundle:
            ctx_options.override_default_trust_store_from_path(ca_filepath=config.ca_bundle)
        tls_options = TlsConnectionOptions(ClientTlsContext(ctx_options))
        tls_options.set_server_name(urlsplit(config.endpoint_url).hostname)
    retry = S3RetryConfig(
        max_retries=config.max_retries,
        backoff_scale_factor_ms=config.retry_backoff_base_ms,
        max_backoff_secs=config.retry_max_backoff_s,
    )
    if config.max_retries == 0:
        from awscrt.s3 import S3RetryMode
        retry = S3RetryConfig(retry_mode=S3RetryMode.NONE)
    client = CrtS3Client(
        bootstrap=bootstrap,
        region=config.region,
        tls_mode=S3RequestTlsMode.ENABLED if tls else S3RequestTlsMode.DISABLED,
        signing_config=signing,
        tls_connection_options=tls_options,
        part_size=config.part_size_bytes,
        multipart_upload_threshold=config.effective_multipart_threshold_bytes,
        throughput_target_gbps=float(config.throughput_target_gbps),
        memory_limit=config.effective_crt_memory_limit_bytes,
        retry_config=retry,
        connect_timeout_ms=int(config.connect_timeout_s * 1000),
        enable_s3express=True,
    )
    return client, signing


def express_signing(signing):
    """The signing config of an S3 Express One Zone directory bucket's requests: SigV4 with the
    session credentials the CRT derives from ``signing``'s (``x-amz-s3session-token``)."""
    from awscrt.auth import AwsSigningAlgorithm

    return signing.replace(algorithm=AwsSigningAlgorithm.V4_S3EXPRESS, service="s3express")


