"""``planner_data`` paths bounded by what the object declares: the list items a load would
build past the entries that use each list are charged to the decode's budget.

DCP's planners store, for every flat key, its path in the nested state dict (``planner_data``,
see :mod:`s3dcp.format.metadata.planner`). A load into an empty state dict (``s3dcp
download``, ``dcp_to_torch_save``) rebuilds the nesting from the paths of the stored items:
every element after the first that is not a string makes a list, and a number there makes it
append ``None`` until the list is that long. One entry of a 2.8 KB object with the index 10^11
ran a download out of memory.

DCP writes a list's items at ``0..n-1``, one entry or more each, so an index no larger than the
number of paths that use that list costs nothing more. Past that is what a list of empty dicts
before a tensor gives (``[{}, {}, t]`` flattens to the one path ``("l", 2)``), so it is not
refused outright: :func:`check_paths` charges the items past those entries, and every number in
a path of another kind the loader would walk (a torch.Size, bytes: never DCP's), to the
decode's :class:`~s3dcp.format.metadata.budget.DecodeBudget`, like every object a decode
builds; a negative index is refused. Only the paths of stored items (the keys of
``state_dict_metadata``) are checked: other entries are data of whichever planner wrote them,
kept as written. One walk over the paths, sharing prefixes: one dict operation per element.

    planner_data = {"opt.groups.0.lr": ("opt", "groups", 0, "lr"),
                    "opt.groups.1.lr": ("opt", "groups", 1, "lr")}   # ("opt", "groups"): 2 paths, top index 1
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from ...errors import MetadataFormatError
from ..context import quoted, shown
from .budget import DecodeBudget

__all__ = ["check_paths"]

_NUMBERS = (int, float)  # bool is an int


def check_paths(planner_data: Any, stored: Iterable[str], budget: DecodeBudget) -> None:
    """Raise MetadataFormatError naming the entry if the paths of ``planner_data`` that a load
    of the items ``stored`` uses would build more list items than ``budget`` allows, or hold a
    negative list index (see the module docstring)."""
    if type(planner_data) is not dict:
        return
    children: dict[tuple[int, Any], int] = {}  # (container, element) -> the container it leads to
    uses = [0]  # per container (0: the root dict): the paths that take an item of it
    top: list[tuple[Any, Any, int] | None] = [None]  # per container: (largest index, its entry's key, depth)
    for key in stored:
        path = planner_data.get(key) if isinstance(key, str) else None
        if type(path) is tuple or type(path) is list:
            _walk(key, path, children, uses, top)
        elif isinstance(path, (tuple, list, bytes)):
            items = sum(_slots(e, key) for e in path[1:])
            budget.objects(f"metadata.planner_data[{quoted(key)}]", items, "list items a load would build", 1)
    for node, found in enumerate(top):
        if found is None:
            continue
        index, key, depth = found
        past = _slots(index, key) - uses[node]
        if past > 0:
            budget.objects(f"metadata.planner_data[{quoted(key)}]", past,
                           f"list items (index {shown(index)} at {shown(tuple(planner_data[key][:depth]))}, past the "
                           f"{uses[node]} entries that use that list)", 1)


def _walk(key: str, path: tuple | list, children: dict, uses: list[int], top: list) -> None:
    """Count ``path`` as a use of each container it goes through; note each container's largest index."""
    node = 0
    for depth, element in enumerate(path):
        if depth:  # the root is the state dict itself, never a list
            uses[node] += 1
            if isinstance(element, _NUMBERS) and element == element:  # NaN makes no items
                if element < 0:
                    raise MetadataFormatError(f"metadata.planner_data[{quoted(key)}]: list index {shown(element)} "
                                              f"at {shown(tuple(path[:depth]))} is negative")
                if top[node] is None or element > top[node][0]:
                    top[node] = (element, key, depth)
        try:
            child = children.setdefault((node, element), len(uses))
        except TypeError:  # an unhashable element: the loader fails on it, building nothing
            return
        if child == len(uses):
            uses.append(0)
            top.append(None)
        node = child


def _slots(element: Any, key: str) -> int:
    """The list items a number makes the loader append (0 for anything else)."""
    if not isinstance(element, _NUMBERS) or element != element or element < 0:
        return 0
    if math.isinf(element):
        raise MetadataFormatError(f"metadata.planner_data[{quoted(key)}]: an infinite list index")
    return int(element) + 1
