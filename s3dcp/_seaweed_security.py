"""What keeps a local SeaweedFS server's inner ports to the user who started it: weed's own
security settings, with secrets made afresh at every start.

``weed mini`` opens ten TCP ports on 127.0.0.1, and every local user may connect to each. Only
the S3 port checks the server's keys (SigV4); by default the others take anyone's requests:
another user could read, list, plant and delete objects through the filer's HTTP port, drop a
bucket's volumes through the master's, or do all of it over gRPC. So:

    port                        without this start's secrets
    master HTTP, filer HTTP     off (-disableHttp): only the master's status page and the
                                health checks answer
    volume HTTP                 every read and write of stored bytes needs a JWT signed with a
                                key made at start (jwt.signing, jwt.signing.read); refused
    gRPC: master, volume,       mutual TLS with a certificate made at start, trusted alone:
    filer, s3, admin            a client without its key is refused in the handshake
    S3                          SigV4 with the server's access key and secret, as before

What still answers anyone: the master's status page and the volume server's ``/status`` (bucket
names, volume counts and sizes; never object names or bytes), and the health checks. The
signing keys reach weed through its environment (``WEED_*``; only its user can read a process's
environment), never its command line; the certificate and its key are files in the data
directory's ``grpc-tls/`` (0700; the key 0600), remade at every start. Making the certificate
needs the ``openssl`` command.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

from .errors import ConfigError

__all__ = ["WEED_FLAGS", "weed_env"]

# The master's and the filer's HTTP APIs, off: S3 reaches them over gRPC.
WEED_FLAGS = ("-disableHttp",)
_JWT_KEYS = ("WEED_JWT_SIGNING_KEY", "WEED_JWT_SIGNING_READ_KEY",
             "WEED_JWT_FILER_SIGNING_KEY", "WEED_JWT_FILER_SIGNING_READ_KEY")
# Every part of weed that serves or dials gRPC (security.toml's [grpc.<name>] sections).
_GRPC_PARTS = ("MASTER", "VOLUME", "FILER", "S3", "ADMIN", "WORKER", "CLIENT", "MSG_BROKER", "MSG_AGENT", "MQ")
_CERT_DAYS = 3650  # remade at every start; a server runs for as long as it likes


def weed_env(data_dir: str) -> dict[str, str]:
    """The ``WEED_*`` variables of one start: fresh JWT signing keys, and a fresh self-signed
    certificate (made in ``data_dir/grpc-tls``) that every gRPC server presents and every gRPC
    client must present."""
    env = {name: secrets.token_hex(32) for name in _JWT_KEYS}
    cert, key = _make_certificate(os.path.join(data_dir, "grpc-tls"))
    env["WEED_GRPC_CA"] = cert  # trusted alone: only this start's key proves it
    for part in _GRPC_PARTS:
        env[f"WEED_GRPC_{part}_CERT"] = cert
        env[f"WEED_GRPC_{part}_KEY"] = key
    return env


def _make_certificate(directory: str) -> tuple[str, str]:
    """A P-256 key and a self-signed certificate for 127.0.0.1 in ``directory`` (made 0700;
    files 0600): paths of the certificate and of the key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("the local S3 server needs the openssl command to make the certificate that keeps "
                          "weed's gRPC ports to you; install openssl (apt install openssl, say)")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    for path in (cert, key):
        if os.path.lexists(path):
            os.unlink(path)
    done = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", str(_CERT_DAYS), "-subj", "/CN=s3dcp-local-seaweedfs",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, umask=0o077, timeout=60)
    if done.returncode != 0:
        raise ConfigError(f"openssl could not make the local server's gRPC certificate (exit {done.returncode}): "
                          f"{done.stderr.strip()[-500:]}")
    return cert, key
