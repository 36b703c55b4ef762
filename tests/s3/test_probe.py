"""s3dcp.s3.probe tells a TLS/plain-HTTP mismatch apart, against real sockets on loopback."""

import http.server
import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from s3dcp.s3.probe import scheme_mismatch


def test_https_endpoint_at_a_plain_http_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        hint = scheme_mismatch(f"https://127.0.0.1:{port}")
        assert hint == (f"https://127.0.0.1:{port} answers plain HTTP, not TLS (a TLS/plain-HTTP mismatch): "
                        f"use http://127.0.0.1:{port}")
    finally:
        thread.join(timeout=10)
        server.server_close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_http_endpoint_at_a_tls_server(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_one():
        conn, _ = listener.accept()
        try:
            with context.wrap_socket(conn, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    try:
        hint = scheme_mismatch(f"http://127.0.0.1:{port}")
        assert hint is not None and "speaks TLS, not plain HTTP" in hint and f"use https://127.0.0.1:{port}" in hint
    finally:
        thread.join(timeout=10)
        listener.close()


def test_nothing_listening_is_no_mismatch():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    assert scheme_mismatch(f"https://127.0.0.1:{port}") is None
    assert scheme_mismatch(f"http://127.0.0.1:{port}") is None
