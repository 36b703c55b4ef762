"""A Lightning checkpoint dict as DCP items, and back: every tensor one raw item (a name from its
path in the dict), everything else ``torch.save``d into one more item, with each tensor's place
marked, so that int keys, empty containers and tuples come back as they were.

    split(checkpoint) ─► {name: tensor}, rest          save: tensors[REST] = pickled(rest)
    destinations(metadata) ─► empty tensors            load: sized from the (untrusted) metadata
    join(rest, tensors) ─► the checkpoint dict again
"""

from __future__ import annotations

import collections
import io
from typing import Any

import torch

from ..errors import MetadataFormatError

__all__ = ["REST", "destinations", "join", "pickled", "split"]

REST = "__lightning_rest__"  # the item holding everything that is not a tensor
_SLOT = "__s3dcp_tensor__"  # marks where a tensor was, in the pickled rest
_MAPPINGS = (dict, collections.OrderedDict)  # walked into, and made again of the same type


def split(checkpoint: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors of ``checkpoint`` by a path-derived name, and ``checkpoint`` with each tensor
    replaced by ``(_SLOT, name)``."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            name = path or "tensor"
            if name in tensors or name == REST:
                name = f"{name}#{len(tensors)}"
            tensors[name] = obj.detach()
            return (_SLOT, name)
        if type(obj) in _MAPPINGS:  # a module's state_dict is an OrderedDict
            return type(obj)((k, walk(v, f"{path}/{k}" if path else str(k))) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj))
        return obj  # anything else (tensors inside included) is pickled with the rest

    return tensors, walk(checkpoint, "")


def join(rest: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def walk(obj: Any) -> Any:
        if type(obj) is tuple and len(obj) == 2 and obj[0] == _SLOT:
            return tensors[obj[1]]
        if type(obj) in _MAPPINGS:
            return type(obj)((k, walk(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(rest)


def destinations(metadata: Any, uri: str) -> dict[str, torch.Tensor]:
    """An empty tensor for each tensor the (untrusted) metadata declares, allocated only once its
    size agrees with the bytes its items say are stored."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored: dict[str, int] = {}
    for index, location in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + location.length
    state = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        nbytes = md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
        if nbytes != stored.get(fqn, 0):
            raise MetadataFormatError(f"{uri}: item {fqn!r} declares {tuple(md.size)} {md.properties.dtype} ({nbytes} bytes) "
                              f"but its stored chunks hold {stored.get(fqn, 0)} bytes; refusing to load it")
        state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
    return state


def pickled(rest: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(rest, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
