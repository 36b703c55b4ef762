"""What a local user without the local server's secrets gets from its ports and files.

:func:`main` (HTTP requests and file access, standard library only) is run by
tests/test_local_server_security.py as another user (``nobody``, when the tests run as root),
with any Python that user may run, its source handed to ``python -c`` so that user needs no
access to this checkout:

    python -c "$(cat anonymous_probe.py)" '{"ports": {...}, "bucket": "b", "key": "k", "paths": [...]}'

It prints one JSON object: for each request, what came back (HTTP status and the start of the
body), and for each path, whether it could be read. :func:`grpc_checks` (needs grpcio) makes
the gRPC requests; mutual TLS answers a certificate, not a uid, so the test makes them itself.
They only ask and report; the test decides what is acceptable.
"""

import json
import os
import socket
import ssl
import sys
import urllib.error
import urllib.request


def http(port: int, method: str, path: str) -> list:
    """[status or None, the body's first 2,000 characters, or the error's name]."""
    body = b"planted by another user" if method in ("PUT", "POST") else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(request, timeout=15) as answer:
            return [answer.status, answer.read(2000).decode("latin-1")]
    except urllib.error.HTTPError as e:
        return [e.code, e.read(2000).decode("latin-1")]
    except OSError as e:
        return [None, type(e).__name__]


def grpc_call(port: int, method: str, request: bytes, tls: bool) -> list:
    """[gRPC status code name ("OK" when answered), details or the answer's bytes as text]. With
    ``tls``, over TLS trusting whatever certificate the port shows, but with none of its own."""
    import grpc

    target = f"127.0.0.1:{port}"
    if tls:
        try:
            pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=15).encode()
        except (OSError, ssl.SSLError) as e:
            return ["NO_TLS", type(e).__name__]
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=pem))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            answers = list(channel.unary_stream(method)(request, timeout=15))
        except grpc.RpcError as e:
            return [e.code().name, e.details() or ""]
    return ["OK", b"".join(answers).decode("latin-1")]


def field(number: int, text: str) -> bytes:
    """A protobuf string field (length under 128)."""
    data = text.encode()
    return bytes([number << 3 | 2, len(data)]) + data


def readable(path: str) -> str:
    """"yes", or the error's name: a directory is listed, a socket connected to, a file read."""
    try:
        if os.path.isdir(path):
            os.listdir(path)
        elif path.endswith(".sock"):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except OSError as e:
        return type(e).__name__
    return "yes"


def main(args: dict) -> dict:
    p, bucket, key = args["ports"], args["bucket"], args["key"]
    out = {"uid": os.getuid(), "http": {}, "files": {}}
    for label, port, method, path in [
        ("filer GET object", p["filer.port"], "GET", f"/buckets/{bucket}/{key}"),
        ("filer GET listing", p["filer.port"], "GET", f"/buckets/{bucket}/?pretty=y"),
        ("filer PUT object", p["filer.port"], "PUT", f"/buckets/{bucket}/planted"),
        ("filer DELETE object", p["filer.port"], "DELETE", f"/buckets/{bucket}/{key}"),
        ("master GET /dir/assign", p["master.port"], "GET", "/dir/assign"),
        ("master GET /dir/lookup", p["master.port"], "GET", "/dir/lookup?volumeId=1&read=yes"),
        ("master POST /submit", p["master.port"], "POST", "/submit"),
        ("master GET /vol/grow", p["master.port"], "GET", f"/vol/grow?collection={bucket}&count=1"),
        ("master GET /col/delete", p["master.port"], "GET", f"/col/delete?collection={bucket}"),
        ("volume GET needle", p["volume.port"], "GET", "/1,0100000000"),
        ("volume PUT needle", p["volume.port"], "PUT", "/1,0100000000"),
        ("volume DELETE needle", p["volume.port"], "DELETE", "/1,0100000000"),
        ("admin GET /", p["admin.port"], "GET", "/"),
        ("master status page", p["master.port"], "GET", "/"),
        ("volume /status", p["volume.port"], "GET", "/status"),
    ]:
        out["http"][label] = http(port, method, path)
    for path in args.get("paths", []):
        out["files"][path] = readable(path)
    return out


def grpc_checks(p: dict, bucket: str, key: str) -> dict:
    """Each gRPC port asked without credentials, plain and over TLS: label -> [code, details]."""
    directory, name = f"/buckets/{bucket}/{key}".rsplit("/", 1)
    list_request = field(1, directory)
    delete_request = field(1, directory) + field(2, name) + b"\x18\x01"  # is_delete_data
    out = {}
    for tls in (False, True):
        how = "TLS" if tls else "plain"
        out[f"filer ListEntries ({how})"] = grpc_call(
            p["filer.port.grpc"], "/filer_pb.SeaweedFiler/ListEntries", list_request, tls)
        out[f"filer DeleteEntry ({how})"] = grpc_call(
            p["filer.port.grpc"], "/filer_pb.SeaweedFiler/DeleteEntry", delete_request, tls)
        out[f"master CollectionList ({how})"] = grpc_call(
            p["master.port.grpc"], "/master_pb.Seaweed/CollectionList", b"", tls)
        out[f"volume VolumeServerStatus ({how})"] = grpc_call(
            p["volume.port.grpc"], "/volume_server_pb.VolumeServer/VolumeServerStatus", b"", tls)
        for server in ("s3", "admin"):  # a method no server has: UNIMPLEMENTED means it was reached
            out[f"{server} any method ({how})"] = grpc_call(p[f"{server}.port.grpc"], "/s3dcp.Probe/Reach", b"", tls)
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
