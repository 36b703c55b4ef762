"""The tagged tree that stores ``planner_data`` (both format versions).

``planner_data`` belongs to whichever planner wrote the checkpoint, so it is stored as a
*tagged tree*: ``None``, bools, ints, strings, finite floats and lists are plain JSON; every
other value is a one-key object whose key names its type::

    {"__tuple__": [...]}            tuple
    {"__dict__": [[k, v], ...]}     dict, always tagged, so any key type (and a user key that
                                    happens to be "__tuple__") survives, in insertion order
    {"__bytes__": "<base64>"}       bytes
    {"__float__": "nan"}            nan, "inf" or "-inf" (JSON has no literal for them)
    {"__size__": [...]}             torch.Size
    {"__dtype__": "float32"}        torch.dtype

Anything else is refused with a TypeError naming it and where it was; there is no pickle
fallback. Exact types are required (an IntEnum or a namedtuple is refused) because decoding
could not give them back.
"""

from __future__ import annotations

import base64
import math
import sys
from typing import Any

from ...errors import MetadataFormatError
from ..context import At
from .fields import _ints, _list, _short, _str, _type_name
from .names import check_name
from .plain import TreeDtype, TreeSize


def encode_tree(obj: Any, path: str) -> Any:
    """Encode a planner_data-like tree with the tags described in the module docstring; ``path`` names it in errors."""
    t = type(obj)
    if obj is None or t is bool or t is int or t is str:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}  # 'nan', 'inf', '-inf'
    if t is list:
        return [encode_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if t is tuple:
        return {"__tuple__": [encode_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if t is dict:
        return {"__dict__": [[encode_tree(k, f"{path} key {k!r}"), encode_tree(v, f"{path}[{k!r}]")]
                             for k, v in obj.items()]}
    if t is bytes:
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    torch = sys.modules.get("torch")  # a torch.Size or torch.dtype exists only once torch is imported
    if torch is not None and t is torch.Size:
        return {"__size__": list(obj)}
    if torch is not None and t is torch.dtype:
        name = str(obj).removeprefix("torch.")
        if vars(torch).get(name) is not obj:
            raise TypeError(f"cannot encode dtype {obj!r}: not a known torch dtype")
        return {"__dtype__": name}
    raise TypeError(
        f"{path}: cannot encode a {_type_name(obj)} in s3dcp metadata; allowed are None, bool, int, "
        "float, str, bytes, list, tuple, dict, torch.Size and torch.dtype (s3dcp never pickles)"
    )


_PLAIN = frozenset({type(None), bool, int, float, str})


def decode_tree(node: Any, where: str) -> Any:
    """Inverse of :func:`encode_tree`, without torch, on a freshly parsed JSON value (whose lists
    it reuses, decoded in place): a torch.Size comes back as a
    :class:`~s3dcp.format.metadata.plain.TreeSize`, a torch.dtype as a
    :class:`~s3dcp.format.metadata.plain.TreeDtype` (``s3dcp.format.metadata.dcp`` makes torch
    objects of them). A bad node raises MetadataFormatError naming ``where``."""
    t = type(node)
    if t in _PLAIN:
        return node
    if t is list:
        # Decoded in place (the parsed JSON is the decoder's own), and plain values and lists of
        # them without a call each: a list of a million numbers took a second through the
        # recursion, and a 10 MB object holds five million.
        if _PLAIN.issuperset(map(type, node)):
            return node
        for i, v in enumerate(node):
            tv = type(v)
            if tv not in _PLAIN and not (tv is list and _PLAIN.issuperset(map(type, v))):
                node[i] = decode_tree(v, At(where, "[", i, "]"))
        return node
    if len(node) != 1:
        msg = f"{where}: expected a one-key tagged object, got keys {_short(sorted(node))}"
        raise MetadataFormatError(msg)
    ((tag, body),) = node.items()
    if tag == "__tuple__":
        return tuple(decode_tree(_list(body, where), where))
    if tag == "__dict__":
        out = {}
        for i, pair in enumerate(_list(body, where)):
            if type(pair) is not list or len(pair) != 2:
                raise MetadataFormatError(f"{where}: entry {i} of a __dict__ is not a [key, value] pair")
            key = decode_tree(pair[0], At(where, " key ", i))
            try:
                out[key] = decode_tree(pair[1], At(where, "[", i, "]"))
            except TypeError:  # a list can be a value, never a key: encode_tree writes keys as tuples
                raise MetadataFormatError(f"{where} key {i}: corrupt __dict__: a {_type_name(key)} cannot be a dict key") from None
        return out
    if tag == "__bytes__":
        return base64.b64decode(_str(body, where), validate=True)
    if tag == "__float__":
        if body not in ("nan", "inf", "-inf"):
            raise MetadataFormatError(f"{where}: bad __float__ value {_short(body)}")
        return float(body)
    if tag == "__size__":
        return TreeSize(_ints(body, where))
    if tag == "__dtype__":
        return TreeDtype(check_name("dtype", body))
    raise MetadataFormatError(f"{where}: unknown tag {_short(tag)}")
