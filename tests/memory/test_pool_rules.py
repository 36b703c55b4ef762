"""The staging pool's rules without a server: an arena replays the plan's places, a composed
object's arena is neither counted among the staging arenas nor ever one of them."""

from __future__ import annotations

import threading

from s3dcp.config import MiB
from s3dcp.memory.pool import HostBufferPool, Placer, plan_slabs


def test_an_arena_places_the_tensors_where_the_plan_did_under_a_budget():
    """target = budget = 100 MiB, tensors of 60, 100 and 30 MiB: the plan keeps 60 and 30 in one
    slab (100 would pass the budget: a later round's); the arena made from it must place 30
    there too, not give up on every tensor after the refused one."""
    sizes = [60 * MiB, 100 * MiB, 30 * MiB]
    planned = plan_slabs(sizes, 100 * MiB, 100 * MiB)
    assert len(planned) == 1
    arena_placer = Placer(None, planned)
    arena_placer.target = 100 * MiB
    places = [arena_placer.place(n) for n in sizes]
    assert places[0] == (0, 0) and places[1] is None and places[2] is not None and places[2][0] == 0


def test_an_arena_opens_the_next_slab_where_the_plan_did():
    sizes = [60 * MiB, 50 * MiB, 200 * MiB, 10 * MiB]  # 50 does not fit beside 60: slab 1; 200 alone
    planned = plan_slabs(sizes, 100 * MiB)
    placer = Placer(100 * MiB, planned)
    assert [placer.place(n)[0] for n in sizes] == [0, 1, 2, 1]


def test_a_composed_objects_arena_is_not_a_staging_arena_nor_counted_among_them():
    pool = HostBufferPool()
    staging = pool.acquire([4 * MiB, 4 * MiB], max_in_use=1, prefault=False)
    composing = pool.acquire(3 * MiB, max_in_use=None, prefault=False)
    assert pool.in_use == 1  # the composed object's arena does not hold a checkpoint's slot
    pool.release(staging)
    # a composed object never takes the free staging arena (two slabs): a new one-slab arena
    other = pool.acquire(3 * MiB, max_in_use=None, prefault=False)
    assert other is not staging and len(other.slabs) == 1 and staging in pool._free
    pool.release(composing)
    pool.release(other)
    assert pool.in_use == 0
    # the next stage gets its slot at once, with the composed objects' arenas out
    held = [pool.acquire(3 * MiB, max_in_use=None, prefault=False) for _ in range(2)]
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire([4 * MiB, 4 * MiB], max_in_use=1)))
    t.start()
    t.join(5)
    assert got and got[0] is staging
    for arena in held + got:
        pool.release(arena)
    pool.clear()
