"""The environment users run the CLI in, for every CLI test (one call of it: cli_run.py)."""

import pytest


@pytest.fixture(autouse=True)
def s3_env(monkeypatch, s3_server):
    """The CLI takes its endpoint and credentials from the environment, as users run it."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)

