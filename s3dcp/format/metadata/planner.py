"""``planner_data`` as references into the fqn table (format version 3).

DCP's planners store the flatten mapping in ``planner_data``: for every flat key, the path to
its value in the nested state dict. The key is almost always an fqn the header already holds,
and the path is that fqn split on dots, with some dots kept inside one element::

    "model.layers.0.w"                 -> ("model", "layers", "0", "w")      every part its own element
    "model.layers.0.w"                 -> ("model", "layers.0.w")            {"model": model.state_dict()}
    "optim.state.layers.0.w.exp_avg"   -> ("optim", "state", "layers.0.w", "exp_avg")
    "optim.param_groups.0.lr"          -> ("optim", "param_groups", 0, "lr")   a list index is an int

Version 2 stores each path in full (~100 bytes per tensor: 1.9 MB of a 2.7 MB object at 20,000
tensors). Version 3 stores, per entry, which fqn is its key and which *template* rebuilds the
path from the key: ``1`` is "every part its own string", ``k >= 2`` is ``templates[k-2]``, a list
of ``[kind, parts]`` elements (kind ``"s"`` a string of that many dot-joined parts, ``"i"`` an
int of one part; parts ``0``: every part the others leave, so one template fits every depth).
Anything else (a path that is not its key, a value that is not a tuple of str and int, a
planner_data that is not a dict of str keys) is kept as a tagged tree
(:mod:`s3dcp.format.metadata.tree`): template ``0`` entries take the next of ``odd``, and a
planner_data that fits no entry form is stored whole as ``{"tree": ...}``::

    {"entries": 20000, "keys": null, "extra_keys": [], "ids": null, "templates": [], "odd": []}

``keys`` null: entry j's key is ``table[j]`` (``table`` = the fqns, then ``extra_keys``: keys that
name no fqn); else the list of ``key - previous key - 1`` (mostly 0). ``ids`` null: every entry
uses template 1; else one id per entry. The DCP case then costs a few bytes in all, and the
header is compressed (:mod:`s3dcp.format.metadata.packing`), so the lists of mostly equal small
numbers cost little more. This module works on the tagged tree's JSON, so it needs no torch:
:func:`compact` takes what ``encode_tree`` wrote, :func:`expand` builds the Python values and
hands odd nodes to the ``decode_tree`` it is given. Every count is checked and charged to the
decode's :class:`~s3dcp.format.metadata.budget.DecodeBudget` before anything is built.
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import MetadataFormatError
from ..context import At, quoted
from .budget import DecodeBudget
from .fields import _short

__all__ = ["compact", "expand", "SPLIT", "ODD"]

ODD = 0  # template id: the value is the next tagged tree of "odd"
SPLIT = 1  # template id: every dot-separated part of the key is one str element
_STAR = 0  # parts of a template element that takes every part the others leave
_W = "metadata.planner_data"


# ---------------------------------------------------------------------------------------------
# Encoding


def compact(tree: Any, fqns: list[str]) -> dict:
    """The version-3 form of ``tree`` (planner_data as ``encode_tree`` wrote it) against ``fqns``."""
    if type(tree) is not dict or len(tree) != 1 or type(tree.get("__dict__")) is not list:
        return {"tree": tree}
    pairs = tree["__dict__"]
    if any(type(k) is not str for k, _ in pairs):
        return {"tree": tree}
    table = {f: i for i, f in enumerate(fqns)}
    extra: dict[str, int] = {}
    keys: list[int] = []
    ids: list[int] = []
    templates: dict[tuple, int] = {}
    odd = []
    for key, value in pairs:
        index = table.get(key)
        if index is None:
            index = len(fqns) + extra.setdefault(key, len(extra))
        keys.append(index)
        template = _template(key, value)
        if template is None:
            ids.append(ODD)
            odd.append(value)
        elif template == SPLIT:
            ids.append(SPLIT)
        else:
            ids.append(templates.setdefault(template, len(templates)) + 2)
    deltas = [k - p - 1 for p, k in zip([-1] + keys, keys)]
    return {
        "entries": len(pairs),
        "keys": deltas if any(deltas) else None,
        "extra_keys": list(extra),
        "ids": ids if any(i != SPLIT for i in ids) else None,
        "templates": [[[kind, parts] for kind, parts in t] for t in templates],
        "odd": odd,
    }


def _template(key: str, node: Any) -> Any:
    """SPLIT, a template (tuple of (kind, parts)) rebuilding ``node`` from ``key``, or None."""
    if type(node) is not dict or len(node) != 1 or type(node.get("__tuple__")) is not list:
        return None
    elements = node["__tuple__"]
    spec = []
    texts = []
    for e in elements:
        if type(e) is str:
            spec.append(("s", e.count(".") + 1))
            texts.append(e)
        elif type(e) is int:
            try:
                texts.append(str(e))
            except ValueError:  # more digits than str() gives
                return None
            spec.append(("i", 1))
        else:
            return None
    if not elements or ".".join(texts) != key:
        return None
    if all(s == ("s", 1) for s in spec):
        return SPLIT
    widest = max(range(len(spec)), key=lambda j: spec[j][1])
    if spec[widest][1] > 1:  # the element of most parts takes whatever the others leave
        spec[widest] = (spec[widest][0], _STAR)
    return tuple(spec)


# ---------------------------------------------------------------------------------------------
# Decoding


_MIN_PARTS = 1 << 22
_PARTS_PER_BYTE = 3


def expand(node: Any, fqns: list[str], budget: DecodeBudget, decode_tree: Callable[[Any, str], Any]) -> Any:
    """planner_data from its version-3 form; ``fqns`` are the header's, already checked (str, unique)."""
    if type(node) is not dict:
        raise MetadataFormatError(f"{_W}: expected a JSON object")
    if "tree" in node:
        return decode_tree(node["tree"], "planner_data")
    n = _field(node, "entries", int)
    if n < 0:
        raise MetadataFormatError(f"{_W}.entries: {n} is negative")
    extra = _field(node, "extra_keys", list)
    if any(type(k) is not str for k in extra):
        raise MetadataFormatError(f"{_W}.extra_keys: expected an array of strings")
    table = fqns + extra if extra else fqns
    if len(set(table)) != len(table):
        raise MetadataFormatError(f"{_W}.extra_keys: a key is also an fqn or repeated")
    keys = _key_indices(node, n, len(table))
    ids = _ids(node, n)
    templates = [_compile(_check_template(t, i), i + 2) for i, t in enumerate(_field(node, "templates", list))]
    odd = _field(node, "odd", list)
    if n and max(ids) > len(templates) + 1:
        raise MetadataFormatError(f"{_W}.ids: template {max(ids)} is outside 0..{len(templates) + 1}")
    n_odd = ids.count(ODD)
    if n_odd != len(odd):
        raise MetadataFormatError(f"{_W}.odd: {len(odd)} values for {n_odd} entries of template 0")
    budget.objects(f"{_W}.entries", n, "planner_data entries")
    # Every path is built from its key's dot-separated parts, one string each. Format 3 packs a
    # real header ~8x, so a real object holds ~1.5 parts per byte (1 rank x 200,000 MoE tensors:
    # 2.0 M parts in 1.4 MB); a key of millions of dots would hold far more. Counted first.
    parts = sum(table[k].count(".") + 1 for k in keys)
    if parts > max(_MIN_PARTS, _PARTS_PER_BYTE * budget.object_bytes):
        raise MetadataFormatError(
            f"{_W}.entries: declares {parts} planner_data path parts, more than a metadata object of "
            f"{budget.object_bytes} bytes can describe; the object is damaged or crafted")
    out: dict = {}
    odd_values = iter(odd)
    for j, (k, t) in enumerate(zip(keys, ids)):
        key = table[k]
        if t == SPLIT:
            out[key] = tuple(key.split("."))
        elif t == ODD:
            out[key] = decode_tree(next(odd_values), At("planner_data[", quoted(key), "]"))
        else:
            out[key] = templates[t - 2](key)
    return out


def _field(node: dict, name: str, kind: type) -> Any:
    if name not in node:
        raise MetadataFormatError(f"{_W}: missing field {name!r}")
    value = node[name]
    if type(value) is not kind:
        raise MetadataFormatError(f"{_W}.{name}: expected a JSON {'integer' if kind is int else 'array'}")
    return value


def _ints_or_null(node: dict, name: str, n: int) -> list[int] | None:
    if name not in node:
        raise MetadataFormatError(f"{_W}: missing field {name!r}")
    values = node[name]
    if values is None:
        return None
    if type(values) is not list or len(values) != n or any(type(v) is not int for v in values):
        raise MetadataFormatError(f"{_W}.{name}: expected null or an array of {n} integers")
    return values


def _key_indices(node: dict, n: int, table: int) -> list[int]:
    deltas = _ints_or_null(node, "keys", n)
    if deltas is None:
        if n > table:
            raise MetadataFormatError(f"{_W}.entries: {n} entries name the first {n} keys, the table has {table}")
        return range(n)
    keys, previous = [], -1
    for d in deltas:
        previous += d + 1
        if not 0 <= previous < table:
            raise MetadataFormatError(f"{_W}.keys: key {previous} is outside the table (0..{table - 1})")
        keys.append(previous)
    if len(set(keys)) != n:
        raise MetadataFormatError(f"{_W}.keys: an fqn is the key of two entries")
    return keys


def _ids(node: dict, n: int) -> list[int]:
    ids = _ints_or_null(node, "ids", n)
    if ids is None:
        return [SPLIT] * n
    if ids and min(ids) < 0:
        raise MetadataFormatError(f"{_W}.ids: a template id is negative")
    return ids


def _check_template(t: Any, i: int) -> tuple:
    where = f"{_W}.templates[{i}]"
    if type(t) is not list or not t:
        raise MetadataFormatError(f"{where}: expected a non-empty array of [kind, parts] elements")
    out = []
    for e in t:
        if type(e) is not list or len(e) != 2 or e[0] not in ("s", "i") or type(e[1]) is not int or e[1] < 0 \
                or (e[0] == "i" and e[1] != 1):
            raise MetadataFormatError(f"{where}: bad element {_short(e, 60)} (expected ['s', parts] or ['i', 1])")
        out.append((e[0], e[1]))
    if sum(1 for _, parts in out if parts == _STAR) > 1:
        raise MetadataFormatError(f"{where}: more than one element takes the remaining parts")
    return tuple(out)


def _compile(template: tuple, t: int) -> Callable[[str], tuple]:
    """A function rebuilding a path from its key by ``template`` (id ``t``, for errors): one split
    from the left and one from the right around the element that takes the remaining parts."""
    sizes = [p for _, p in template]
    ints = [j for j, (kind, _) in enumerate(template) if kind == "i"]
    star = next((j for j, p in enumerate(sizes) if p == _STAR), None)
    pre, post = (sizes, []) if star is None else (sizes[:star], sizes[star + 1:])
    n_pre, n_post = sum(pre), sum(post)
    simple = all(p == 1 for p in pre + post)

    def texts(key: str) -> list[str] | None:
        if star is None:
            parts = key.split(".")
            return None if len(parts) != n_pre else parts if simple else _group(parts, pre)
        head = key.split(".", n_pre) if n_pre else [key]
        if len(head) != n_pre + 1:
            return None
        tail = head[-1].rsplit(".", n_post) if n_post else [head[-1]]  # the middle keeps >= 1 part
        if len(tail) != n_post + 1:
            return None
        if simple:
            return head[:-1] + tail
        return _group(head[:-1], pre) + tail[:1] + _group(tail[1:], post)

    def build(key: str) -> tuple:
        out = texts(key)
        if out is None:
            raise MetadataFormatError(f"{_W}: template {t} does not fit key {key[:80]!r} ({key.count('.') + 1} parts)")
        for j in ints:
            out[j] = _canonical_int(out[j], key, t)
        return tuple(out)

    return build


def _group(parts: list[str], sizes: list[int]) -> list[str]:
    out, pos = [], 0
    for p in sizes:
        out.append(".".join(parts[pos:pos + p]))
        pos += p
    return out


def _canonical_int(text: str, key: str, t: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or str(value) != text:  # int() also takes " 1", "+1", "1_0", "٣"
        raise MetadataFormatError(f"{_W}: template {t} reads {text[:40]!r} of key {key[:80]!r} as an int")
    return value
