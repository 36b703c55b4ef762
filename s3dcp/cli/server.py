"""The commands that set up S3 rather than checkpoints: ``s3dcp server`` (a local SeaweedFS server to
try things out, :mod:`s3dcp.localserver`) and ``s3dcp mb`` (create a bucket, through boto3)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from ..config import S3Config
from ..errors import AccessDeniedError, S3ConnectionError, S3Error
from ..localserver import DEFAULT_BUCKET
from ..uri import parse_s3_uri
from .common import UsageError
from .output import print_json

__all__ = ["cmd_server", "cmd_mb"]


# ---------------------------------------------------------------------- server
def cmd_server(args) -> int:
    from .. import localserver

    buckets = [] if args.no_bucket else (args.bucket or [DEFAULT_BUCKET])
    if args.pid is not None and not (args.stop or args.print_env):
        raise UsageError("--pid goes with --print-env or --stop (s3dcp server --list shows the pids)")
    if args.all and not args.stop:
        raise UsageError("--all goes with --stop")
    if args.json and not args.list:
        raise UsageError("--json goes with --list")
    if args.list:
        return localserver.list_servers(as_json=args.json)
    if args.stop:
        if args.all and args.pid is not None:
            raise UsageError("--stop takes --pid or --all, not both")
        return localserver.stop(pid=args.pid, all_servers=args.all)
    # the environment keeps the secret off command lines (the background server gets it so too);
    # taken out of it here, so weed's environment does not hold it twice
    secret_key = os.environ.pop(localserver.SECRET_KEY_ENV, None)
    options = dict(buckets=buckets, data_dir=args.dir, port=args.port, access_key=args.access_key,
                   secret_key=args.secret_key if args.secret_key is not None else secret_key)
    if args.print_env:
        return localserver.print_env(**options, pid=args.pid)
    return localserver.run(**options)


# ---------------------------------------------------------------------- mb
def cmd_mb(args) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    uri = parse_s3_uri(args.uri)
    if uri.prefix:
        raise UsageError(f"{args.uri}: mb takes a bucket (s3://{uri.bucket}), not a prefix")
    config = S3Config(endpoint_url=args.endpoint_url, region=args.region).resolved()
    request: dict[str, Any] = {"Bucket": uri.bucket}
    if config.region != "us-east-1":  # S3 wants it everywhere but its first region
        request["CreateBucketConfiguration"] = {"LocationConstraint": config.region}
    created = True
    try:
        _boto3(config).create_bucket(**request)
    except ClientError as e:
        error = e.response.get("Error", {})
        code = error.get("Code")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        request_id = e.response.get("ResponseMetadata", {}).get("RequestId") or None
        fields = dict(operation="CreateBucket", bucket=uri.bucket, status=status, code=code, request_id=request_id)
        if code == "BucketAlreadyOwnedByYou":
            created = False
        elif code == "BucketAlreadyExists":
            raise S3Error(f"bucket {uri.bucket!r} exists and belongs to another account (bucket names are "
                          "global on AWS): pick another name", **fields) from e
        elif status == 403:
            raise AccessDeniedError("CreateBucket was refused: these credentials may not create buckets "
                                    "(s3:CreateBucket)", **fields) from e
        else:
            raise S3Error(f"CreateBucket failed: {error.get('Message') or code}", **fields) from e
    except BotoCoreError as e:
        raise S3ConnectionError(f"CreateBucket failed without an HTTP answer from {config.endpoint_url}: {e}",
                                operation="CreateBucket", bucket=uri.bucket) from e
    if args.json:
        print_json({"uri": str(uri), "created": created, "region": config.region,
                     "endpoint_url": config.endpoint_url})
    else:
        print(f"{'created' if created else 'exists already (yours)'}: s3://{uri.bucket} "
              f"({config.region}, {config.endpoint_url})")
    return 0


def _boto3(config: S3Config):
    """A boto3 client for the CLI's resolved config (credentials from boto3's usual chain)."""
    import boto3
    from botocore.config import Config

    from ..config import is_loopback_host

    options: dict[str, Any] = {"signature_version": "s3v4", "retries": {"max_attempts": config.max_retries + 1,
                                                                        "mode": "standard"}}
    if config.use_path_style:
        options["s3"] = {"addressing_style": "path"}
    if is_loopback_host(urlsplit(config.endpoint_url).hostname or ""):
        options["proxies"] = {}  # loopback traffic never goes through a proxy from the environment
    session = boto3.session.Session(profile_name=config.profile) if config.profile else boto3.session.Session()
    return session.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                          verify=config.ca_bundle or config.verify_tls, config=Config(**options))
