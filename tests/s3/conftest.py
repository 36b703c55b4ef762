"""Fixtures of the s3 tests: the fault proxy in front of the session's server."""

from urllib.parse import urlsplit

import pytest

from fault_proxy import FaultProxy


@pytest.fixture
def proxy(s3_server):
    """A fault proxy in front of the server, stopped when the test ends."""
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as p:
        yield p
