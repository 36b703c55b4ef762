"""Retention's choice of steps to delete (pure: no server)."""

from s3dcp.lifecycle.retention import Doomed, steps_to_delete


def test_keep_last_and_keep_every():
    committed = [0, 10, 20, 30, 40, 50]
    assert steps_to_delete(committed, just_saved=50, keep_last=2, keep_every=None) == [0, 10, 20, 30]
    assert steps_to_delete(committed, just_saved=50, keep_last=2, keep_every=20) == [10, 30]
    assert steps_to_delete(committed, just_saved=50, keep_last=None, keep_every=None) == []
    assert steps_to_delete([], just_saved=5, keep_last=1, keep_every=None) == []


def test_never_the_newest_the_just_saved_nor_a_base_in_use():
    committed = [1, 2, 3, 4]
    # a step saved again after newer ones (a resumed run): it stays, and so does the newest
    assert steps_to_delete(committed, just_saved=2, keep_last=1, keep_every=None) == [1, 3]
    assert steps_to_delete(committed, just_saved=4, keep_last=1, keep_every=None, in_use=[1, 3]) == [2]
    assert steps_to_delete(committed, just_saved=4, keep_last=0, keep_every=None) == [1, 2, 3]


def test_doomed_forgets_a_step_once_no_listing_could_still_see_it():
    doomed = Doomed()
    doomed.add([1, 2])
    listing = doomed.listing_started()  # a LIST that began before step 1's deletion finished
    doomed.deleted(1)
    assert 1 in doomed and 2 in doomed  # the LIST in flight may still show step 1 committed
    doomed.listing_ended(listing)
    assert 1 not in doomed and 2 in doomed  # step 2's deletion is still running
    doomed.spare(2)  # saved again: a base again
    assert len(doomed) == 0
