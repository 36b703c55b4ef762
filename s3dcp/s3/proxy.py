"""Which HTTP proxy the environment names for an endpoint, read as the CRT reads it.

The CRT's connections follow ``https_proxy`` / ``HTTPS_PROXY`` for an https endpoint (a CONNECT
tunnel) and ``http_proxy`` / ``HTTP_PROXY`` for an http one (requests in absolute form), the
lower-case name first, unless ``no_proxy`` / ``NO_PROXY`` names the host: ``*``, a name (which
covers its subdomains) or an IP address or CIDR range. Measured with awscrt 0.38 through a
proxy of the tests' own (``tests/http_proxy.py``, ``tests/s3/test_deployments.py``); the
matching follows aws-c-http's ``no_proxy.c`` (curl's rules).

Owns :func:`proxy_for`. The native clients are keyed by it (a changed proxy takes effect for
the next client, as changed credentials do) and the socket transport, which has no proxy
support, refuses a configuration it applies to. It must not send anything.
"""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

__all__ = ["proxy_for"]


def proxy_for(endpoint_url: str, environ=None) -> tuple[str, str] | None:
    """``(variable, proxy URL)`` of the proxy the CRT's connections to ``endpoint_url`` go
    through, or None: none is named for its scheme, or ``NO_PROXY`` names its host."""
    env = os.environ if environ is None else environ
    parts = urlsplit(endpoint_url)
    names = ("https_proxy", "HTTPS_PROXY") if parts.scheme == "https" else ("http_proxy", "HTTP_PROXY")
    found = next(((name, env[name]) for name in names if env.get(name)), None)
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    if found is None or _bypassed(parts.hostname or "", no_proxy):
        return None
    return found


def _bypassed(host: str, no_proxy: str) -> bool:
    """Whether ``no_proxy`` (comma-separated) names ``host``."""
    if no_proxy.strip() == "*":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    host = host.rstrip(".").lower()
    for pattern in (p.strip() for p in no_proxy.split(",")):
        if address is not None:
            try:
                if address in ipaddress.ip_network(pattern.strip("[]"), strict=False):
                    return True
            except ValueError:
                continue
        else:
            pattern = pattern.strip(".").lower()
            if pattern and (host == pattern or host.endswith("." + pattern)):
                return True
    return False
