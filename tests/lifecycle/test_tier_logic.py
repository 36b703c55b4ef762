"""The local tier's pure logic, without a server: which step a restore takes, the peer mapping,
where each object is read from, the marker as untrusted input, and the space budget."""

from __future__ import annotations

import json
import shutil
import threading
import tracemalloc

import pytest

from s3dcp.errors import LocalRoomError, MetadataFormatError
from s3dcp.format.local import MARKER_NAME, MAX_MARKER_BYTES, LocalMarker
from s3dcp.lifecycle.replicas import peer_map
from s3dcp.lifecycle.holdings import S3View, choose_save, scan
from s3dcp.lifecycle.tiers import LocalTier
from s3dcp.loading.tiered import plan_sources
from s3dcp.saving.local_copy import LocalCopy, remove_copy
from s3dcp.uri import parse_s3_uri


def _marker(step, rank, save, world, at=0.0, in_s3=False):
    return LocalMarker(base="s3://bkt/run", step=step, save_id=save, rank=rank, world_size=world, objects={},
                       in_s3=in_s3, saved_at=at)


def _report(node, copies):
    return node, {(c[0], c[1]): _marker(*c) for c in copies}


def _chosen(reports, s3, **kw):
    choice = choose_save(reports, s3, **kw)
    return None if choice is None else (choice.step, choice.save_id)


def test_the_newest_save_held_in_full_by_the_tiers_together():
    a = _report("n0", [(20, 0, "x", 2), (10, 0, "w", 2)])
    b = _report("n1", [(20, 1, "x", 2), (30, 1, "y", 2)])
    s3 = S3View(frozenset({10}), {10: "w"})
    assert _chosen([a, b], s3) == (20, "x")  # 20: rank 0 on n0, rank 1 on n1
    assert _chosen([a, b], S3View(frozenset({10, 30}), {30: "y"})) == (30, "y")  # S3 holds 30 whole
    assert _chosen([a, b], S3View(frozenset()), excluded=frozenset({("n1", 20, 1)})) is None  # 10 lacks rank 1
    assert _chosen([a, b], s3, excluded=frozenset({("n1", 20, 1)})) == (10, "w")
    assert _chosen([a, b], S3View(frozenset({10})), wanted=10) == (10, "")
    # a copy corrupt on one node and intact on another is still there
    d = _report("n0", [(20, 1, "x", 2)])
    assert _chosen([a, b, d], S3View(frozenset()), excluded=frozenset({("n1", 20, 1)})) == (20, "x")
    # S3 unreachable: the nodes' saves alone
    assert _chosen([a, b], None) == (20, "x")


def test_a_step_saved_twice_resumes_the_later_save_and_never_mixes_them():
    # run 1 saved 20 "x" at t=1 (node 0 holds rank 0's copy and, as a replica, rank 1's); run 2
    # went back and saved 20 "y" at t=5: each node holds its own rank's copy of y
    n0 = _report("n0", [(20, 0, "y", 2, 5.0), (20, 1, "x", 2, 1.0)])
    n1 = _report("n1", [(20, 1, "y", 2, 5.1), (20, 0, "x", 2, 1.1)])
    choice = choose_save([n0, n1], S3View(frozenset({10}), {10: "w"}))
    assert (choice.step, choice.save_id) == (20, "y")
    assert {(node, rank) for node, _, rank, _ in choice.ignored} == {("n0", 1), ("n1", 0)}  # x's, named
    # the later save incomplete (a rank killed before its commit): the earlier one of the same step is
    # from the line of training the run went back from: never taken, the step below is
    n0 = _report("n0", [(20, 0, "y", 2, 5.0), (20, 1, "x", 2, 1.0)])
    n1 = _report("n1", [(20, 0, "x", 2, 1.1)])  # rank 1 died before its copy of y
    assert _chosen([n0, n1], S3View(frozenset({10}), {10: "w"})) == (10, "w")
    # a step the run went back from, held in full, above a later save of an earlier step: not taken
    n0 = _report("n0", [(30, 0, "x", 1, 3.0), (15, 0, "y", 1, 6.0)])
    assert _chosen([n0], S3View(frozenset({10}), {10: "w"})) == (15, "y")
    # where S3 committed the step, S3's save is the truth: a node's copy of another save is stale
    n0 = _report("n0", [(20, 0, "x", 1, 9.0)])
    choice = choose_save([n0], S3View(frozenset({20}), {20: "z"}))
    assert (choice.step, choice.save_id, choice.in_s3) == (20, "z", True) and len(choice.ignored) == 1
    # a copy of a step that went to S3 and was deleted there since (s3dcp rm): not used ...
    n0 = _report("n0", [(30, 0, "x", 1, 9.0, True)])
    assert _chosen([n0], S3View(frozenset({10}), {10: "w"})) == (10, "w")
    # ... unless S3 cannot be asked
    assert _chosen([n0], None) == (30, "x")


def test_peers_are_on_the_next_node_and_none_on_one_node():
    assert peer_map(["a", "a", "b", "b"]) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert peer_map(["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}
    assert peer_map(["a", "a", "b"]) == {0: 2, 1: 2, 2: 0}  # unequal nodes: every rank still has a peer
    assert peer_map(["a", "a"]) == {}


def test_each_object_comes_from_the_node_then_a_peer_then_s3():
    sizes = {"o0": 10, "o1": 20, "o2": 30}
    needs = [{"o0", "o2"}, {"o1"}, {"o0"}]
    nodes = ["n0", "n0", "n1"]
    holders = {"o0": {0, 1}, "o1": {2}}  # o2 is nowhere but S3
    transfers, tiers = plan_sources(needs, sizes, nodes, holders)
    assert tiers == {"local": 10, "peer": 20 + 10, "s3": 30}
    assert transfers[1].receive == (("o1", 20, 2),) and transfers[2].send == (("o1", 20, 1),)
    assert transfers[2].receive == (("o0", 10, 0),) and transfers[0].send == (("o0", 10, 2),)


@pytest.mark.parametrize("doc, field", [
    ({"objects": {"../escape": 3}}, r"names object '\.\./escape'"),
    ({"objects": {"a": -1}}, r"names object 'a' of size -1"),
    ({"step": True}, "step"),
    ({"world_size": 0}, "world_size"),
    ({"world_size": 10**12}, "world_size"),  # before: every scan built a set of that many ranks
    ({"rank": 1 << 24}, "rank"),
    ({"version": 9}, "version 9"),
    ({"format": "other"}, "not an s3dcp local-copy marker"),
])
def test_a_marker_is_untrusted_input(doc, field):
    good = json.loads(LocalMarker(base="s3://bkt/run", step=1, save_id="abc", rank=0, world_size=2,
                                  objects={"__0_0.abc.distcp": 5}, in_s3=False).encode())
    bad = {**good, **doc}
    with pytest.raises(MetadataFormatError, match=field):
        LocalMarker.decode(json.dumps(bad).encode(), "m")
    with pytest.raises(MetadataFormatError, match="bytes"):
        LocalMarker.decode(b" " * (5 << 20), "m")


def _tier(tmp_path, **kw):
    return LocalTier(tmp_path, base=parse_s3_uri("s3://bkt/run"), name=lambda s: f"step-{s}",
                     step_of=lambda d: int(d[5:]) if d.startswith("step-") else None, **kw)


class _Loc:
    def __init__(self, name, length):
        self.object_name, self.offset, self.length = name, 0, length


def _complete(tmp_path, step, nbytes):
    copy = LocalCopy(tmp_path, f"step-{step}", "s3://bkt/run", step)
    copy.begin(0)
    copy.write("__0_0.abc.distcp", [bytes(nbytes)])
    copy.seal(copy.prepare(b"metadata", [_Loc("__0_0.abc.distcp", nbytes)], save_id="abc", world_size=1,
                           in_s3=False, saved_at=float(step)))


def test_the_budget_keeps_the_newest_copy_and_refuses_what_cannot_fit_beside_it(tmp_path):
    tier = _tier(tmp_path, keep_last=3, budget_bytes=1000)
    for step in (1, 2):
        _complete(tmp_path, step, 300)
    copy, _ = tier.begin_save(3, {})  # nothing to store: room is there
    assert copy.refusal is None
    tier._make_room(4, 500)  # 1 and 2 take 600: step 1 goes to make room, the newest (2) stays
    assert {s for s, _ in scan(tmp_path, "s3://bkt/run", tier.step_of)} == {2}
    with pytest.raises(LocalRoomError, match="beside the newest complete local copy"):
        tier._make_room(5, 800)
    with pytest.raises(LocalRoomError, match="cannot hold checkpoint step 6"):
        tier._make_room(6, 2000)
    assert {s for s, _ in scan(tmp_path, "s3://bkt/run", tier.step_of)} == {2}


def test_a_copy_without_its_marker_or_with_a_short_file_is_never_selected(tmp_path):
    _complete(tmp_path, 1, 100)
    partial = LocalCopy(tmp_path, "step-2", "s3://bkt/run", 2)
    partial.begin(0)
    partial.write("__0_0.abc.distcp", [bytes(100)])  # killed before its commit: no marker
    _complete(tmp_path, 3, 100)
    (tmp_path / "step-3" / "rank-0" / "__0_0.abc.distcp").write_bytes(bytes(50))  # cut short
    _complete(tmp_path, 4, 100)
    found = scan(tmp_path, "s3://bkt/run", lambda d: int(d[5:]))
    assert sorted(found) == [(1, 0), (4, 0)]
    assert scan(tmp_path, "s3://bkt/other-run", lambda d: int(d[5:])) == {}  # another run's copies: ignored


def test_a_huge_marker_file_is_refused_without_reading_it_whole(tmp_path, caplog):
    _complete(tmp_path, 1, 100)
    with open(tmp_path / "step-1" / "rank-0" / MARKER_NAME, "ab") as f:
        f.truncate(1 << 30)  # 1 GiB of (sparse) marker
    tracemalloc.start()
    try:
        assert scan(tmp_path, "s3://bkt/run", lambda d: int(d[5:])) == {}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_MARKER_BYTES + (1 << 20), peak
    assert "unreadable" in caplog.text


def test_a_scan_beside_copies_being_deleted_does_not_fail_nor_warn(tmp_path, caplog):
    """Another rank of the node (or this rank's async commit) retains copies away while a scan
    lists them: what vanishes is simply not found, and nothing is said of it (issue 39, row 4:
    before, data files went before the marker, and a scan between warned of a partial copy)."""
    stop = threading.Event()

    def churn():
        step = 0
        while not stop.is_set():
            step += 1
            _complete(tmp_path, step, 10)
            old = tmp_path / f"step-{step - 3}"
            remove_copy(old / "rank-0")  # as retention deletes: the copy, then its step's directory
            shutil.rmtree(old, ignore_errors=True)  # (left behind, empty roots pile up and every scan slows)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(100):
            found = scan(tmp_path, "s3://bkt/run", lambda d: int(d[5:]))
            assert all(size == {"__0_0.abc.distcp": 10} for size in (m.objects for m, _ in found.values()))
            _tier(tmp_path, keep_last=1)._usage()
    finally:
        stop.set()
        thread.join()
    assert "partial" not in caplog.text and "unreadable" not in caplog.text, caplog.text


class _Job:
    """Stands in for lifecycle.tier_sync.TierSync: one rank, owning every directory."""

    local_world = 1

    def __init__(self, replicas):
        self.replicas = replicas

    def owned(self, ranks):
        return ranks


class _Replicating:
    """Stands in for lifecycle.replicas.Replicas: transfers of these step roots are still going."""

    source_ranks: list = []
    active = True

    def __init__(self, roots):
        self.roots = roots

    def pending(self):
        return list(self.roots)


def test_retention_keeps_a_step_whose_replication_is_still_going(tmp_path):
    tier = _tier(tmp_path, keep_last=1)
    _complete(tmp_path, 1, 100)
    tier.sync = _Job(_Replicating([tmp_path / "step-1"]))  # step 1 still being sent to the peer
    _complete(tmp_path, 2, 100)
    tier._retain(keep={2})
    assert {s for s, _ in scan(tmp_path, "s3://bkt/run", tier.step_of)} == {1, 2}
    tier.replicas.roots = []  # sent: now it goes
    tier._retain(keep={2})
    assert {s for s, _ in scan(tmp_path, "s3://bkt/run", tier.step_of)} == {2}


def test_retention_on_a_commit_thread_never_deletes_the_copy_the_next_save_begins(tmp_path):
    """An async save's commit retains on an upload thread while the training thread begins the
    next save: the new step's copy must not be deleted by a retention that decided what to
    keep before the step began (a restart then resumed an older step)."""
    tier = _tier(tmp_path, keep_last=1)
    _complete(tmp_path, 1, 100)
    decided, go = threading.Event(), threading.Event()
    real_usage = tier._usage

    def usage_after_deciding():  # the first retention pauses right after choosing what it keeps
        if not decided.is_set():
            decided.set()
            go.wait(10)
        return real_usage()

    tier._usage = usage_after_deciding
    committing = threading.Thread(target=lambda: tier._retain(keep={1}))
    committing.start()
    assert decided.wait(10)

    def next_save():
        copy, _ = tier.begin_save(2, {})
        copy.begin(0)
        copy.write("__0_0.abc.distcp", [bytes(10)])

    beginning = threading.Thread(target=next_save)
    beginning.start()
    beginning.join(0.5)  # it may wait for the retention in progress, or be done already
    go.set()
    committing.join(10)
    beginning.join(10)
    assert (tmp_path / "step-2" / "rank-0" / "__0_0.abc.distcp").is_file()
