"""Where torch-checkpointing's paths go in S3 (pure, no server): the root, ``s3://`` paths as
``pathlib`` folds them, staging views, and the names a path may not use."""

from __future__ import annotations

from pathlib import Path

import pytest

from s3dcp.errors import ConfigError
from s3dcp.interop.torch_checkpointing_paths import PathMap


def test_paths_under_the_root_and_s3_urls_as_pathlib_folds_them():
    paths = PathMap("s3://bkt/runs/exp", "tmp_")
    for given in ("step_5/model_0.pt", "/step_5/model_0.pt", Path("step_5/model_0.pt")):
        where = paths.where(given, file=True)
        assert (where.bucket, where.key, where.staged, where.guards) == ("bkt", "runs/exp/step_5/model_0.pt", None,
                                                                        ("runs/exp/step_5",))
    folded = paths.where(Path("s3://other/a/b.pt"), file=True)  # PosixPath('s3:/other/a/b.pt')
    assert (folded.bucket, folded.key, folded.guards) == ("other", "a/b.pt", ("a",))
    assert paths.where("s3://bkt/runs/exp/x", file=False).guards == ("runs/exp/x",)  # the root is taken as written
    assert paths.where("/", file=False).key == "runs/exp" and paths.where("/", file=False).guards == ()
    assert paths.where("s3://bkt", file=False).key == ""


def test_a_staging_directory_is_the_view_of_the_one_without_the_prefix():
    paths = PathMap("s3://bkt/run", "tmp_")
    view = paths.where(Path("tmp_step_5"), file=False)
    assert (view.key, view.staged, view.is_staging_view, view.guards) == ("run/step_5", "run/step_5", True, ())
    inside = paths.where("tmp_step_5/sub/model_0.pt", file=True)
    assert (inside.key, inside.staged, inside.is_staging_view) == ("run/step_5/sub/model_0.pt", "run/step_5", False)
    assert inside.guards == ("run/step_5/sub",)
    assert inside.url == "s3://bkt/run/step_5/sub/model_0.pt"
    final = paths.where("step_5", file=False)
    assert (final.key, final.staged, final.guards) == ("run/step_5", None, ("run/step_5",))
    assert final.parents().guards == ()


def test_a_file_may_carry_the_prefix_a_directory_of_the_root_too():
    paths = PathMap("s3://bkt/tmp_scratch", "tmp_")
    f = paths.where("step_1/tmp_buffer_0.pt", file=True)
    assert (f.key, f.staged) == ("tmp_scratch/step_1/tmp_buffer_0.pt", None)
    as_dir = paths.where("step_1/tmp_buffer_0.pt", file=False)  # the same name, asked as a directory
    assert (as_dir.key, as_dir.staged) == ("tmp_scratch/step_1/buffer_0.pt", "tmp_scratch/step_1/buffer_0.pt")
    assert paths.where("tmp_", file=False).staged is None  # the prefix alone names nothing staged


def test_names_that_cannot_be_placed_are_refused_with_what_to_do():
    paths = PathMap("s3://bkt/run", "tmp_")
    with pytest.raises(ConfigError, match="two directories carry the staging prefix 'tmp_'.*temp_dir_prefix"):
        paths.where("tmp_a/tmp_b/x.pt", file=True)
    with pytest.raises(ConfigError, match="s3dcp keeps for its own markers"):
        paths.where("step_1/.s3dcp-commit", file=True)
    with pytest.raises(ConfigError, match="'.' or '..'"):
        paths.where("step_1/../x", file=True)
    with pytest.raises(ConfigError, match="no root to place it under"):
        PathMap(None, "tmp_").where("step_1", file=False)
    with pytest.raises(ConfigError, match="not a valid bucket name"):
        paths.where("s3://B_/x", file=True)
    for bad in ("", "a/b"):
        with pytest.raises(ConfigError, match="staging_prefix"):
            PathMap("s3://bkt", bad)


def test_a_listing_names_a_staged_child_by_its_staging_view():
    paths = PathMap("s3://bkt", "ckpt-staging-")
    assert paths.listed_name("step_3", staged=True) == "ckpt-staging-step_3"
    assert paths.listed_name("step_3", staged=False) == "step_3"
