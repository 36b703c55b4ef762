"""``planner_data`` paths bounded by what they declare: no list index past the entries that use
that list.

DCP's planners store, for every flat key, its path in the nested state dict (``planner_data``,
see :mod:`s3dcp.format.metadata.planner`); loading into an empty state dict (``s3dcp
download``, ``dcp_to_torch_save``) rebuilds the nesting from those paths, and a list index makes
it append ``None`` until the list is that long. One entry of a 2.8 KB object with the index
10^11 ran a download out of memory. DCP writes a list's items at indices ``0..n-1``, one entry
(at least) per item, so an honest list index is never larger than the number of entries whose
paths go through that list: :func:`check_paths` refuses a larger one, a negative one, and a
list that some path indexes with anything but an int (its loader would compare that with the
list's length: a float of 10^11 makes the same list). It walks every path once, sharing
prefixes, so it costs one dict operation per path element.

    planner_data = {"opt.groups.0.lr": ("opt", "groups", 0, "lr"),
                    "opt.groups.1.lr": ("opt", "groups", 1, "lr")}   # ("opt", "groups"): 2 entries, top index 1
"""

from __future__ import annotations

from typing import Any

from ...errors import MetadataFormatError
from ..context import quoted, shown

__all__ = ["check_paths"]


def check_paths(planner_data: Any) -> None:
    """Raise MetadataFormatError naming the entry if a path of ``planner_data`` (a dict of key ->
    tuple or list of path elements) indexes a list past the entries that use it (see the module
    docstring). Anything that is not such a path is left alone: it builds no list."""
    if type(planner_data) is not dict:
        return
    children: dict[tuple[int, Any], int] = {}  # (container, element) -> the container it leads to
    uses = [0]  # per container (0: the root dict): the paths that take an element of it
    top = [-1]  # per container: its largest int element, -1 when none
    top_at: list[tuple[Any, int] | None] = [None]  # per container: (the entry's key, depth) of that index
    named: list[Any] = [None]  # per container: a first element that is not an int (a name), or None
    for key, path in planner_data.items():
        if type(path) is not tuple and type(path) is not list:
            continue
        node = 0
        for depth, element in enumerate(path):
            if depth:  # the root is the state dict itself, never a list
                uses[node] += 1
                if type(element) is int:
                    if element < 0:
                        raise MetadataFormatError(f"metadata.planner_data[{quoted(key)}]: list index {element} at "
                                                  f"{shown(tuple(path[:depth]))} is negative")
                    if element > top[node]:
                        top[node], top_at[node] = element, (key, depth)
                elif named[node] is None:
                    named[node] = (element, key, depth)
            try:
                child = children.setdefault((node, element), len(uses))
            except TypeError:  # an unhashable element: DCP's loader fails on it, building nothing
                break
            if child == len(uses):
                uses.append(0)
                top.append(-1)
                top_at.append(None)
                named.append(None)
            node = child
    for node, index in enumerate(top):
        if index < 0:
            continue
        key, depth = top_at[node]
        prefix = shown(tuple(planner_data[key][:depth]))
        if named[node] is not None:
            element, other, _ = named[node]
            raise MetadataFormatError(
                f"metadata.planner_data[{quoted(other)}]: takes {shown(element)} of {prefix}, a list (entry "
                f"{quoted(key)} takes its item {index}); the object is damaged or crafted")
        if index > uses[node]:
            raise MetadataFormatError(
                f"metadata.planner_data[{quoted(key)}]: list index {index} at {prefix} is past the {uses[node]} "
                "entries that use that list (a load would build a list that long); the object is damaged or crafted")
