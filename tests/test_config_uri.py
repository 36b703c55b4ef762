"""Pure parts: URI parsing and config validation/resolution (no server)."""

import logging

import pytest

from s3dcp import S3Config, config
from s3dcp.config import MiB
from s3dcp.errors import ConfigError
from s3dcp.uri import S3Uri, parse_s3_uri


@pytest.mark.parametrize(
    "uri, bucket, prefix",
    [
        ("s3://bucket/run/step-1", "bucket", "run/step-1"),
        ("s3://bucket/run/step-1/", "bucket", "run/step-1"),
        ("s3://my.bucket-1", "my.bucket-1", ""),
        ("s3://abc/a b/ü", "abc", "a b/ü"),
    ],
)
def test_parse_s3_uri(uri, bucket, prefix):
    assert parse_s3_uri(uri) == S3Uri(bucket, prefix)


@pytest.mark.parametrize(
    "uri, words",
    [
        ("/local/path", "not an S3 URI"),
        ("s3:/bucket/x", "not an S3 URI"),
        ("s3:///x", "no bucket"),
        ("s3://Bucket/x", "not a valid bucket name"),
        ("s3://ab/x", "not a valid bucket name"),
        ("s3://bucket/a//b", "empty path segment"),
        ("s3://bucket/a/../b", "'..'"),
        (42, "must be an 's3://bucket/prefix' string"),
    ],
)
def test_parse_s3_uri_errors_name_the_problem(uri, words):
    with pytest.raises(ConfigError) as e:
        parse_s3_uri(uri)
    assert words in str(e.value)


def test_key_building():
    u = parse_s3_uri("s3://b1c/run/7")
    assert u.key(".metadata") == "run/7/.metadata"
    assert u.dir_prefix == "run/7/"
    assert str(u.child("x")) == "s3://b1c/run/7/x"
    root = parse_s3_uri("s3://b1c")
    assert root.key("k") == "k" and root.dir_prefix == ""


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("part_size_bytes", 1024, "part_size_bytes=1024 is below S3's 5 MiB minimum"),
        ("part_size_bytes", 6 * 1024 * MiB, "above S3's 5 GiB maximum"),
        ("max_concurrency", 0, "max_concurrency=0"),
        ("checksum", "md5", "checksum='md5'"),
        ("throughput_target_gbps", -1, "throughput_target_gbps=-1"),
        ("staging_budget_bytes", 10, "staging_budget_bytes=10"),
        ("addressing_style", "weird", "addressing_style='weird'"),
        ("sse", "rot13", "sse='rot13'"),
        ("endpoint_url", "ftp://x", "not an http(s) URL"),
        ("request_timeout_s", 0, "request_timeout_s=0"),
        ("max_inflight_checkpoints", 0, "max_inflight_checkpoints=0"),
        ("key_prefix_spread", 300, "key_prefix_spread=300 must be an int in [1, 256]"),
        ("crt_memory_limit_bytes", 100 * MiB, "crt_memory_limit_bytes=104857600 must be None (sized from the part size), 0"),
        ("requester_pays", "yes", "requester_pays='yes' must be True or False"),
        # before, each of these turned certificate checks off, silently (None means "the default" elsewhere)
        ("verify_tls", None, "verify_tls=None must be True or False (leave it out for the default, True)"),
        ("verify_tls", 0, "verify_tls=0 must be True or False"),
        ("verify_tls", "", "verify_tls='' must be True or False"),
        ("verify_tls", "false", "verify_tls='false' must be True or False"),
    ],
)
def test_invalid_config_values_are_named(field, value, words):
    with pytest.raises(ConfigError) as e:
        S3Config(**{field: value})
    assert words in str(e.value)


def test_verify_tls_false_is_said_once_per_https_endpoint(caplog, monkeypatch):
    monkeypatch.setattr(config, "_UNVERIFIED", set())  # once per process: this test's process
    caplog.set_level(logging.WARNING, logger="s3dcp")
    for endpoint in ("https://s3.example.test:9443", "https://s3.example.test:9443", "http://127.0.0.1:9000"):
        S3Config(endpoint_url=endpoint, verify_tls=False).resolved({})
    S3Config(endpoint_url="https://s3.other.test", verify_tls=True).resolved({})
    said = [r.getMessage() for r in caplog.records if "verify_tls=False" in r.getMessage()]
    assert len(said) == 1 and "https://s3.example.test:9443 are not checked" in said[0], said  # plain HTTP has none


def test_keys_must_come_in_pairs():
    with pytest.raises(ConfigError, match="together"):
        S3Config(access_key_id="AKIA")


def test_secrets_are_not_in_repr():
    c = S3Config(access_key_id="AKIAXXXX", secret_access_key="very-secret-value", session_token="tok-123")
    assert "very-secret-value" not in repr(c) and "tok-123" not in repr(c)
    assert "very-secret-value" not in str(c.resolved({}))


def test_resolution_follows_botocore_order(tmp_path):
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1",
           "AWS_CONFIG_FILE": str(tmp_path / "none")}
    c = S3Config().resolved(env)
    assert (c.endpoint_url, c.region) == ("http://127.0.0.1:9000", "eu-west-1")
    env["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:9001"
    env["AWS_REGION"] = "ap-south-1"
    c = S3Config().resolved(env)
    assert (c.endpoint_url, c.region) == ("http://127.0.0.1:9001", "ap-south-1")
    # explicit beats the environment
    c = S3Config(endpoint_url="http://localhost:1234", region="us-west-2").resolved(env)
    assert (c.endpoint_url, c.region) == ("http://localhost:1234", "us-west-2")


def test_defaults_to_aws_https_and_profile_file(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text("[profile dev]\nregion = ca-central-1\ns3 =\n  addressing_style = path\n")
    env = {"AWS_PROFILE": "dev", "AWS_CONFIG_FILE": str(cfg)}
    c = S3Config().resolved(env)
    assert c.region == "ca-central-1"
    assert c.endpoint_url == "https://s3.ca-central-1.amazonaws.com"
    assert c.addressing_style == "path" and c.use_path_style
    assert not S3Config().resolved({"AWS_CONFIG_FILE": str(cfg)}).use_path_style  # AWS host: virtual
    with pytest.raises(ConfigError, match="profile 'nope' not found"):
        S3Config(profile="nope").resolved({"AWS_CONFIG_FILE": str(cfg)})


def test_endpoint_without_scheme_is_https_unless_loopback():
    assert S3Config(endpoint_url="127.0.0.1:9000").resolved({}).endpoint_url == "http://127.0.0.1:9000"
    assert S3Config(endpoint_url="localhost:9000").resolved({}).endpoint_url == "http://localhost:9000"
    assert S3Config(endpoint_url="minio.internal:9000").resolved({}).endpoint_url == "https://minio.internal:9000"


@pytest.mark.parametrize("endpoint, expected", [
    ("http://[::1]", "http://[::1]"),  # an IPv6 literal without a port: port 80 (docs/aws.md)
    ("http://[::1]:9000", "http://[::1]:9000"),
    ("[::1]:9000", "http://[::1]:9000"),  # no scheme: loopback, so http
    ("[fd00::5]:9000", "https://[fd00::5]:9000"),
])
def test_ipv6_literal_endpoints(endpoint, expected):
    assert S3Config(endpoint_url=endpoint).resolved({}).endpoint_url == expected


@pytest.mark.parametrize("endpoint", ["http://::1", "http://::1:9000", "::1", "http://[::1", "http://[::1]9000"])
def test_an_ipv6_address_out_of_brackets_is_named_with_the_form_to_use(endpoint):
    with pytest.raises(ConfigError, match=r"an IPv6 address goes in brackets.*http://\[::1\]:9000"):
        S3Config(endpoint_url=endpoint)


def test_the_ca_bundle_comes_from_aws_ca_bundle_as_in_botocore(tmp_path):
    bundles = {name: tmp_path / f"{name}.pem" for name in ("explicit", "env", "profile")}
    for path in bundles.values():
        path.write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = tmp_path / "config"
    cfg.write_text(f"[default]\nca_bundle = {bundles['profile']}\n")
    env = {"AWS_CONFIG_FILE": str(cfg)}
    assert S3Config().resolved(env).ca_bundle == str(bundles["profile"])
    env["AWS_CA_BUNDLE"] = str(bundles["env"])
    assert S3Config().resolved(env).ca_bundle == str(bundles["env"])
    assert S3Config(ca_bundle=str(bundles["explicit"])).resolved(env).ca_bundle == str(bundles["explicit"])
    env["AWS_CA_BUNDLE"] = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="AWS_CA_BUNDLE='.*missing.pem' is not a file"):
        S3Config().resolved(env)


def test_the_transport_resolves_as_resolved_says(tmp_path):
    assert S3Config().resolved_transport({}) == "crt"
    assert S3Config().resolved_transport({"S3DCP_TRANSPORT": "sockets"}) == "sockets"
    assert S3Config(transport="crt").resolved_transport({"S3DCP_TRANSPORT": "sockets"}) == "crt"
    env = {"S3DCP_TRANSPORT": "sockets", "AWS_CONFIG_FILE": str(tmp_path / "none")}
    assert S3Config().resolved(env).transport == S3Config().resolved_transport(env)


def test_crt_memory_limit_is_sized_from_what_is_in_use():
    assert S3Config().effective_crt_memory_limit_bytes == 299 * MiB  # a quarter second of 10 Gb/s
    assert S3Config(part_size_bytes=128 * MiB).effective_crt_memory_limit_bytes == 512 * MiB  # four parts
    assert S3Config(throughput_target_gbps=100).effective_crt_memory_limit_bytes == 2981 * MiB
    assert S3Config(part_size_bytes=8 * MiB, throughput_target_gbps=1).effective_crt_memory_limit_bytes == 256 * MiB
    assert S3Config(crt_memory_limit_bytes=0).effective_crt_memory_limit_bytes is None  # the CRT's own
    assert S3Config(crt_memory_limit_bytes=1024 * MiB).effective_crt_memory_limit_bytes == 1024 * MiB
