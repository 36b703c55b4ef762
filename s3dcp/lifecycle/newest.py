"""The newest committed step of a run, as every rank agrees on it (:func:`agreed`), and the rule
that a manager never saves at or below it (:func:`refuse_older`): a run started over an earlier
one would mix with it on resume. With a local tier an S3 outage does not stop a run's saves:
the check is skipped, with a warning, and the local-only steps go on being kept."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import UNREACHABLE, CheckpointError, CheckpointExistsError

__all__ = ["agreed", "later", "refuse_older"]

log = logging.getLogger("s3dcp")


def later(known: int | None, step: int) -> int:
    """The later of a newest step known so far (None: none) and ``step``."""
    return step if known is None else max(known, step)


def refuse_older(manager: Any, step: int) -> None:
    """Refuse ``step`` at or below the newest committed step: the bucket's when ``manager`` first
    saves (a run started over an earlier one; while S3 cannot be listed, each save asks again),
    then the newest it saved."""
    if not manager._checked:  # the first save: what the bucket holds already (collective: every rank refuses, or none)
        in_s3, problem = manager._agreed_latest(outage_ok=manager._tiers is not None)
        manager._checked = problem is None  # S3 not consulted: the next save asks again
        if in_s3 is not None:
            manager._newest, manager._newest_in_s3 = later(manager._newest, in_s3), later(manager._newest_in_s3, in_s3)
        if problem is not None:
            log.warning("S3 could not be listed (%s): checkpoint step %d is saved without checking for a newer "
                        "committed step of %s; the local tier goes on, and each S3 step is tried in turn",
                        problem, step, manager.base)
    newest = manager._newest
    if newest is not None and step <= newest:
        raise CheckpointExistsError(
            f"{manager.base} already holds a committed checkpoint at step {newest} ({manager.uri(newest)}); this "
            f"manager does not save step {step} beside it (resuming takes the newest step, so two runs would mix). "
            f"Resume from it (step = manager.load(state_dict), then save later steps), give this run a base folder "
            f"of its own, or delete the old run's checkpoints first (s3dcp ls {manager.base}/ lists them; s3dcp rm "
            "URI --yes)")


def agreed(ask: Callable[[], Any], process_group: Any, coordinator: bool, outage_ok: bool,
           failed: str) -> tuple[Any, str | None]:
    """(``ask()``'s value on the coordinator, None) on every rank (collective under
    torch.distributed: the others must not wait in a broadcast the coordinator never joins);
    its error on the coordinator and ``CheckpointError(failed: why)`` elsewhere, except with
    ``outage_ok``, where S3 could not be reached (:data:`~s3dcp.errors.UNREACHABLE`): (None, why)
    on every rank."""
    box: list[Any] = [None]
    error: BaseException | None = None
    if coordinator:
        try:
            box[0] = ("ok", ask())
        except UNREACHABLE as e:
            error = None if outage_ok else e
            box[0] = ("unreachable", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        except Exception as e:  # noqa: BLE001 - raised below, after the broadcast
            error = e
            box[0] = ("error", f"{type(e).__name__}: {e}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, group_src=0, group=process_group)
    if error is not None:
        raise error
    status, value = box[0]
    if status == "unreachable" and outage_ok:
        return None, value
    if status != "ok":
        raise CheckpointError(f"{failed}: {value}")
    return value, None
