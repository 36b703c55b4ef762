"""What the metadata fuzzer (benchmarks/fuzz.py) runs past the decoder: every other consumer of
stored bytes, each given what a mutated object decodes to, none allowed to fail but with an
S3DCPError (a result, or a refusal naming what is wrong).

    decoded object ──► verify's checks (declared.problems, every item's location; torch-free)
                   ──► rm's and gc's reading of it (references.object_names, on the raw bytes)
    validated      ──► the reader's planning: DCP's load planner over a state dict of the declared
                       tensors (when they are small enough to make), ItemReads.plan of every
                       ReadItem, the object key of every item (what GETs would be issued)
                   ──► cooperative planning: schedule_plans for two ranks loading the same state
                   ──► export's planning: _select, layout.pack, and the declared-size check
                       against objects of the sizes the items say (or shorter)
    safetensors    ──► parse_header of a mutated file, then the S3SafetensorsReader's metadata
                       built from it and validated, as a load would

No server: a client stand-in answers LIST and HEAD with the object sizes the metadata implies
(shortened at random), and nothing else. Names of consumers reached are counted by the driver.
"""

from __future__ import annotations

import json
import random
import struct
import zlib
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from s3dcp.config import S3Config
from s3dcp.errors import S3DCPError
from s3dcp.format import layout
from s3dcp.format.context import At, quoted
from s3dcp.format.metadata.declared import problems
from s3dcp.format.metadata.locations import check_item
from s3dcp.format.references import object_names
from s3dcp.s3.listing import ObjectInfo
from s3dcp.uri import S3Uri, object_key

__all__ = ["CONSUMERS", "after_decode", "after_validate", "safetensors_seeds", "mutate_safetensors",
           "check_safetensors"]

CONSUMERS = ("decode", "validate", "lookups", "verify", "references", "reader", "cooperative", "export",
             "safetensors")
_URI = S3Uri("fuzz-bucket", "run/step-2")
# The reader's planning needs destination tensors of the declared sizes; they are made with
# torch.empty (address space: planning never touches their pages), up to this much in all.
_MAX_STATE_BYTES = 4 << 30
_SLOT_BYTES = 8 << 20


class FakeClient:
    """LIST and HEAD of objects of ``sizes`` (key -> bytes); nothing else is asked of it."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    @staticmethod
    def _done(value: Any) -> Future:
        f: Future = Future()
        f.set_result(value)
        return f

    def list(self, bucket: str, prefix: str, delimiter: str | None = None) -> Future:
        objs = [ObjectInfo(k, n) for k, n in self.sizes.items() if k.startswith(prefix) and "/" not in k[len(prefix):]]
        return self._done((objs, []))

    def head(self, bucket: str, key: str) -> Future:
        return self._done(ObjectInfo(key, self.sizes.get(key, 0)))


def after_decode(data: bytes, plain: Any, reached: set) -> None:
    """verify's torch-free checks of a decoded object (``plain``; None: the decoder refused it),
    and rm's and gc's reading of its names (from the raw bytes, whatever the decoder said)."""
    if plain is not None:
        _verify(plain, reached)
    reached.add("references")
    try:
        object_names(data, "fuzz")
    except S3DCPError:
        pass


def _verify(plain: Any, reached: set) -> None:
    reached.add("verify")
    problems(plain)
    if plain.storage is not None:
        for key, loc in plain.storage.items():
            try:
                check_item(loc, At("item ", quoted(key.fqn)))
            except S3DCPError:
                pass


def _sizes(md: Any, rng: random.Random) -> dict[str, int]:
    """Object sizes as the items imply them, one of them shortened at times."""
    ends: dict[str, int] = {}
    for loc in (md.storage_data or {}).values():
        try:
            key = object_key(_URI, loc.object_name)
        except S3DCPError:
            continue
        ends[key] = max(ends.get(key, 0), loc.offset + loc.length)
    if ends and rng.random() < 0.3:
        key = rng.choice(sorted(ends))
        ends[key] = rng.choice([0, 1, ends[key] // 2, max(0, ends[key] - 1)])
    return ends


def after_validate(md: Any, rng: random.Random, reached: set) -> None:
    """The reader's, cooperative reads' and export's planning over a validated Metadata."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from s3dcp.interop import export
    from s3dcp.loading.cooperative import PeerInfo, schedule_plans
    from s3dcp.loading.items import ItemReads
    from s3dcp.loading.sizes import check_declared_sizes

    client = FakeClient(_sizes(md, rng))
    reached.add("export")
    try:
        report = export.ExportReport("fuzz", "fuzz")
        tensors = export._select(md, _URI, (), None, report)
        layout.pack([t.nbytes for t in tensors], 5 << 30)
        check_declared_sizes(client, _URI, md, [t.fqn for t in tensors])
    except S3DCPError:
        pass

    state: dict[str, Any] = {}
    total = 0
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            nbytes = meta.properties.dtype.itemsize * int(torch.Size(meta.size).numel())
            if total + nbytes > _MAX_STATE_BYTES:
                continue  # a load of a subset of the checkpoint, as any caller may ask
            total += nbytes
            state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            state[fqn] = None
    reached.add("reader")
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, md, is_coordinator=True)
    plan = planner.create_local_plan()
    reads = ItemReads(_URI, md.storage_data, client, verify=True, allow_pickle=False, coalesce_gap_bytes=1 << 20)
    for item in plan.items:
        try:
            read = reads.plan(item, planner, _SLOT_BYTES)
            object_key(_URI, read.location.object_name)
        except S3DCPError:
            pass
    reached.add("cooperative")
    plans = [replace(plan, storage_data=PeerInfo(f"node{r}", "")) for r in range(2)]
    try:
        schedule_plans(plans, reads.location, verify=True, slot_bytes=_SLOT_BYTES, gap_bytes=1 << 20,
                       window_bytes=rng.choice([1 << 20, 64 << 20]))
    except S3DCPError:
        pass


# ---------------------------------------------------------------------------------------------
# safetensors headers


def safetensors_seeds() -> list[tuple[str, bytes]]:
    """Real safetensors files (small tensors of several dtypes, one 0-d, one empty) as the
    safetensors package writes them."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
               "model.w": torch.randn(8, 8, generator=g), "model.b": torch.zeros(8, dtype=torch.float16),
               "scale": torch.tensor(0.5), "empty": torch.zeros(0, 4), "ids": torch.arange(5)}
    return [("safetensors", save(tensors, metadata={"format": "pt"}))]


def _split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def mutate_safetensors(src: Any, raw: bytes, json_edit) -> tuple[bytes, str]:
    """One hostile edit of a safetensors file: its header's values (any of them, a long name,
    a shape of many dimensions, a dtype of another JSON type), its length field, or its bytes."""
    if len(raw) < 16:
        return raw, "nothing left to mutate"
    kind = src.integer(0, 7)
    if kind == 0:
        cut = src.integer(0, len(raw) - 1)
        return raw[:cut], f"truncated to {cut}"
    if kind == 1:
        out = bytearray(raw)
        out[src.integer(0, len(out) - 1)] ^= 1 << src.integer(0, 7)
        return bytes(out), "bit flip"
    if kind == 2:
        return struct.pack("<Q", src.interesting(struct.unpack_from("<Q", raw)[0]) % 2**64) + raw[8:], "header length"
    try:
        doc, data = _split(raw)
        names = [k for k in doc if k != "__metadata__" and type(doc[k]) is dict]
    except (ValueError, TypeError, struct.error, UnicodeDecodeError):  # not a header any more: cut it
        return raw[:-1], "truncated by 1"
    name = src.choice(names) if names else None
    if kind == 3 and name:
        doc[name]["shape"] = [1] * src.size((65, 1000, 200_000, 3_400_000))
        what = f"shape of {len(doc[name]['shape'])} dims"
    elif kind == 4 and name:
        doc[name]["dtype"] = src.choice([["F32"], {"F32": 1}, 7, None, "F32", "Q8", ""])
        what = f"dtype {doc[name]['dtype']!r}"
    elif kind == 5 and name:
        doc["n" * src.size((1000, 200_000, 3_000_000))] = doc.pop(name)
        what = "long name"
    else:
        what = json_edit(src, doc)
    text = json.dumps(doc).encode()
    return struct.pack("<Q", len(text)) + text + data, what


def check_safetensors(raw: bytes, reached: set) -> str:
    """parse_header, then the S3SafetensorsReader's metadata of it, validated: 'accepted' or
    'refused'; anything but an S3DCPError propagates."""
    from s3dcp.format.metadata import validate_metadata
    from s3dcp.format.safetensors import parse_header
    from s3dcp.interop.safetensors_reader import S3SafetensorsReader

    reached.add("safetensors")
    try:
        header = parse_header(raw, source="fuzz", file_size=len(raw))
        reader = S3SafetensorsReader("s3://fuzz-bucket/hf", config=S3Config(region="us-east-1"), client=FakeClient({}))
        reader.read_headers = lambda: {"model.safetensors": header}
        validate_metadata(reader.fetch_metadata(), source="fuzz")
    except S3DCPError:
        return "refused"
    return "accepted"


def seed_of(data: bytes) -> random.Random:
    """A random source fixed by the object, for the consumers' own choices (a shortened object)."""
    return random.Random(zlib.crc32(data))
