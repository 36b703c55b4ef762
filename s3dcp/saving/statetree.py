"""Walking a state dict: copying it with every tensor replaced, and listing its tensors.

DTensors and ShardedTensors are copied as the same kind of object around staged local
tensors; other values (ints, strings, optimizer hyper-parameters) are deep-copied, so the
training loop may change anything once the copy is made.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

__all__ = ["copy_tree", "flattened", "tensors", "paths"]


def copy_tree(value: Any, stage_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor ``t`` (local shards of distributed tensors too) replaced
    by ``stage_tensor(t)``."""
    if type(value) is torch.Tensor:  # the common case first: one check per tensor, no imports
        return stage_tensor(value)
    dtensor, sharded = _kinds()
    if isinstance(value, dtensor):
        local = stage_tensor(value._local_tensor)
        return dtensor(local, value._spec, requires_grad=False)
    if isinstance(value, sharded):
        return _copy_sharded_tensor(value, stage_tensor)
    if isinstance(value, torch.Tensor):
        return stage_tensor(value)
    if isinstance(value, dict):
        return {k: copy_tree(v, stage_tensor) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_tree(v, stage_tensor) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_tree(v, stage_tensor) for v in value)
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    return copy.deepcopy(value)


def tensors(value: Any, owners: list | None = None) -> list[torch.Tensor]:
    """Every tensor ``copy_tree`` would stage, in the same order. With ``owners``, also the
    object the state holds for each one: a DTensor for its local tensor, else the tensor itself."""
    out: list[torch.Tensor] = []
    _collect(value, out, *_kinds(), owners)
    return out


def _collect(value: Any, out: list, dtensor: type, sharded: Any, owners: list | None) -> None:
    if type(value) is torch.Tensor:
        out.append(value)
    elif isinstance(value, dtensor):
        out.append(value._local_tensor)
    elif isinstance(value, sharded):
        shards = [shard.tensor for shard in value.local_shards()]
        out.extend(shards)
        if owners is not None:
            owners.extend(shards)
        return
    elif isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out, dtensor, sharded, owners)
        return
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out, dtensor, sharded, owners)
        return
    else:
        return
    if owners is not None:
        owners.append(value)


def paths(value: Any, prefix: str = "") -> list[str]:
    """The place of each tensor ``tensors(value)`` lists, in the same order, as dotted keys
    (``optim.state.0.exp_avg``; a ShardedTensor's local shards ``name[shard i]``): what an error
    names."""
    dtensor, sharded = _kinds()
    if isinstance(value, (torch.Tensor, dtensor)) and not isinstance(value, sharded):
        return [prefix or "<state>"]
    if isinstance(value, sharded):
        return [f"{prefix}[shard {i}]" for i in range(len(value.local_shards()))]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    out: list[str] = []
    for k, v in items:
        out.extend(paths(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


_KINDS: tuple[type, Any] | None = None


def _kinds() -> tuple[type, Any]:
    """(DTensor, ShardedTensor), imported once: a state of hundreds of tensors walked per
    checkpoint paid an import lookup per node. ShardedTensor is ``()`` (matches nothing) where
    torch lacks it."""
    global _KINDS
    if _KINDS is None:
        from torch.distributed.tensor import DTensor

        try:
            from torch.distributed._shard.sharded_tensor import ShardedTensor
        except ImportError:  # pragma: no cover
            ShardedTensor = ()  # noqa: N806
        _KINDS = (DTensor, ShardedTensor)
    return _KINDS


def _copy_sharded_tensor(st, stage_tensor):
    """A ShardedTensor around staged copies of ``st``'s local shards.

    Its global metadata is rewritten to describe the copies: torch checks every local shard
    against it (device, ``pin_memory``, ``requires_grad``), and a staged shard lives in host
    memory — pinned or not — and does not require grad, whatever the original did.
    """
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.remote_device import _remote_device

    local = [stage_tensor(s.tensor) for s in st.local_shards()]
    metadata = copy.deepcopy(st.metadata())
    props = metadata.tensor_properties
    props.pin_memory = bool(local) and local[0].is_pinned()
    props.requires_grad = False
    for shard_md in metadata.shards_metadata:
        if shard_md.placement is not None:
            shard_md.placement = _remote_device(f"rank:{shard_md.placement.rank()}/cpu")
    shards = []
    for s, t in zip(st.local_shards(), local):
        md = copy.deepcopy(s.metadata)
        md.placement = _remote_device(f"rank:{md.placement.rank()}/{t.device}")
        shards.append(Shard(t, md))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=st._process_group)


def flattened(state_dict: dict) -> dict:
    """``state_dict`` with every ``Stateful`` value replaced by its ``state_dict()``, as DCP saves
    it (DCP does the same again, at no cost, on a dict without Stateful values)."""
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    return _stateful_to_state_dict(state_dict)
