"""The local tier on one node, against the real server: whose the copies are (issue 38, rows 3-5),
what a broken local disk costs (issue 39, row 3: never the S3 checkpoint), and what the settings
say (row 11).

Another local user is played by ``nobody``: a forked child of this process that changed its uid
(root runs the suite here; without root those cases are skipped, the rest run)."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from s3dcp import CheckpointManager
from s3dcp.errors import ConfigError, LocalCopyError
from s3dcp._private_dir import private_dir
from s3dcp.saving import local_copy

from forged_copy import forge

MiB = 1 << 20
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")


def _manager(s3_config, bucket, local_dir, **kw):
    kw.setdefault("s3_every", 2)
    return CheckpointManager(f"s3://{bucket}/run", config=s3_config, local_dir=local_dir, async_mode=False, **kw)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(MiB // 4, generator=g), "b": torch.randn(100, generator=g)}


def _as_nobody(call) -> str:
    """``call()``'s outcome in a child of this process running as ``nobody``: "ok" or the error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no new imports (nobody cannot read the interpreter's own directory)
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            call()
            said = "ok"
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's subject
            said = f"{type(e).__name__}: {e}"
        os.write(write, said.encode()[:60000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


def open_local_dir(path):
    return Path(private_dir(path, what="local_dir", tighten=True))  # what the manager makes of it


def test_a_new_local_dir_is_private_and_an_open_one_is_made_private(tmp_path, caplog):
    made = open_local_dir(tmp_path / "a" / "run")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    os.chmod(readable, 0o755)
    with caplog.at_level(logging.INFO, logger="s3dcp"):
        open_local_dir(readable)
    assert stat.S_IMODE(readable.stat().st_mode) == 0o700 and "made private" in caplog.text


@pytest.mark.parametrize("mode, says", [(0o777, "others"), (0o770, "its group"), (0o702, "others")])
def test_a_local_dir_others_may_write_is_refused(tmp_path, mode, says):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(ConfigError, match=f"local_dir .* may be written by {says} .*chmod go-w"):
        _manager_of(d)


def test_a_local_dir_that_is_a_file_or_under_one_says_so(tmp_path):
    """Issue 39, row 3: before, a raw FileExistsError or NotADirectoryError at the first save,
    which did not name local_dir."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="local_dir .* is not a directory .* remove it or choose another"):
        _manager_of(tmp_path / "f")
    with pytest.raises(ConfigError, match="local_dir .* a part of its path is a file"):
        _manager_of(tmp_path / "f" / "run")


def _manager_of(local_dir):
    return CheckpointManager("s3://bkt/run", local_dir=local_dir, client=_NoS3())


class _NoS3:
    """A client never used: making a manager asks nothing of S3."""

    config = None


@as_root
def test_a_local_dir_of_another_user_or_their_link_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}"):
        _manager_of(theirs)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"symbolic link of uid {NOBODY}"):
        _manager_of(link)


@pytest.fixture
def shm():
    """A directory every user may write in, as /dev/shm is (1777), where nobody can reach it."""
    path = Path(tempfile.mkdtemp(prefix="s3dcp-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@as_root
def test_another_user_can_neither_plant_nor_read_a_copy(s3_config, bucket, shm):
    """Issue 38, rows 3 and 4: before, a local_dir pre-created 0777 by another user was taken,
    and the copy that user wrote there was restored; peer replicas and markers were 0644."""
    tmp_path = shm
    planted = tmp_path / "planted"
    assert _as_nobody(lambda: (planted.mkdir(), os.chmod(planted, 0o777))) == "ok"
    with pytest.raises(ConfigError, match="belongs to uid"):
        _manager(s3_config, bucket, planted)

    local_dir = tmp_path / "local"
    m = _manager(s3_config, bucket, local_dir)
    m.save(10, _state(10))
    m.save(20, _state(20))  # kept on the node only
    m.close()
    copy = local_dir / "step-00000020" / "rank-0"
    marker = copy / ".local-commit"
    said = _as_nobody(lambda: marker.read_bytes())
    assert "PermissionError" in said, said
    said = _as_nobody(lambda: (copy / "forged").write_bytes(b"x"))
    assert "PermissionError" in said, said
    for path in [local_dir, *local_dir.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) in (0o700, 0o600), (path, oct(path.stat().st_mode))


def _forge(copy: Path, seed: int) -> None:
    forge(copy, "w", _state(seed)["w"])


def test_a_forged_copy_of_a_step_in_s3_is_caught_by_s3_s_own_metadata(s3_config, bucket, tmp_path):
    """Where S3 committed the step, its .metadata is the truth, not the node's: a forged copy
    (another state, checksums to match) fails them and is read from S3 instead."""
    local_dir = tmp_path / "local"
    m = _manager(s3_config, bucket, local_dir)
    m.save(10, _state(10))
    m.close()
    _forge(local_dir / "step-00000010" / "rank-0", seed=99)
    out = {k: torch.zeros_like(v) for k, v in _state(10).items()}
    m = _manager(s3_config, bucket, local_dir)
    assert m.load(out) == 10
    assert all(torch.equal(out[k], v) for k, v in _state(10).items())
    assert m.last_load_stats["corrupt_copies"] == [[10, 0]] and m.last_load_stats["s3_bytes"] > 0


class _App:
    """DCP's AppState pattern: the tensors are inside a Stateful."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])


def test_the_budget_counts_the_tensors_inside_a_stateful(s3_config, bucket, tmp_path):
    """Issue 38, row 5: before, a 6 MiB budget held 8.4 MiB of a Stateful's tensors."""
    torch.manual_seed(0)
    app = _App(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)))  # 8 MiB
    local_dir = tmp_path / "local"
    m = _manager(s3_config, bucket, local_dir, local_budget_bytes=6 * MiB)
    m.save(1, {"app": app})  # to S3: the copy that cannot fit is left out, and said so
    stats = m.last_save_stats
    assert stats.stored_in == ("s3",) and "local_budget_bytes" in stats.local_error, stats
    assert sum(f.stat().st_size for f in local_dir.rglob("*") if f.is_file()) == 0
    with pytest.raises(LocalCopyError, match="local_budget_bytes=6291456 cannot hold checkpoint step 2"):
        m.save(2, {"app": app})  # on the node only: nothing could hold it
    m.close()


class _FullDisk:
    """``os`` as saving/local_copy.py sees it on a full disk: every write fails with ENOSPC."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_broken_local_disk_never_costs_the_s3_checkpoint(s3_config, bucket, tmp_path, monkeypatch, caplog):
    """Issue 39, row 3: before, an unwritable local_dir (or a full disk) failed the S3 upload too."""
    local_dir = tmp_path / "local"
    m = _manager(s3_config, bucket, local_dir, s3_every=3)
    monkeypatch.setattr(local_copy, "os", _FullDisk())  # the local copy's writes only
    with caplog.at_level(logging.WARNING, logger="s3dcp"):
        m.save(10, _state(10))  # to S3: committed there, the copy failed
    assert m.last_save_stats.stored_in == ("s3",) and "No space" in m.last_save_stats.local_error
    assert "the step still goes to S3" in caplog.text
    with pytest.raises(LocalCopyError, match="No space left on device"):
        m.save(20, _state(20))  # on the node only: it fails, on every rank
    monkeypatch.undo()
    m.save(30, _state(30))  # after a failed one: to S3, whatever s3_every says (3: not yet)
    assert m.last_save_stats.stored_in == ("s3", "local")
    local_dir.rename(tmp_path / "gone")  # the directory gone mid-run: made again
    m.save(40, _state(40))
    assert m.last_save_stats.stored_in == ("local",)
    m.close()
    out = {k: torch.zeros_like(v) for k, v in _state(40).items()}
    m = _manager(s3_config, bucket, local_dir)
    assert m.load(out) == 40 and all(torch.equal(out[k], v) for k, v in _state(40).items())
    assert m.load(out, step=10) == 10 and m.last_load_stats["tier"] == "s3"


def test_settings_say_what_is_possible(s3_config, bucket, tmp_path, caplog):
    with pytest.raises(ConfigError, match="s3_every=0 must be an int >= 1: every s3_every-th checkpoint also goes "
                                          "to S3 .* a run that never writes it is not offered"):
        _manager(s3_config, bucket, tmp_path / "a", s3_every=0)
    m = _manager(s3_config, bucket, tmp_path / "b", local_replicas=1)
    with caplog.at_level(logging.WARNING, logger="s3dcp"):
        m.save(1, _state(1))
    assert "local_replicas=1 in a process without torch.distributed" in caplog.text
    with pytest.raises(Exception, match=r"no checkpoint at step 999 .* S3 holds step\(s\) 1; the nodes hold copies "
                                        r"of step\(s\) 1"):
        m.load(_state(0), step=999)
    m.close()


def test_each_save_and_each_restore_says_in_one_info_line_where_it_went(s3_config, bucket, tmp_path, caplog):
    """Issue 39, row 6 (before: nothing on a restore or a local-only save, and a step kept on the
    nodes only was not told apart from one in S3); a manager without the local tier too."""
    m = _manager(s3_config, bucket, tmp_path / "local")
    plain = CheckpointManager(f"s3://{bucket}/plain", config=s3_config, async_mode=False)
    said = {}
    for name, call in [("1", lambda: m.save(1, _state(1))), ("2", lambda: m.save(2, _state(2))),
                       ("restore", lambda: m.load(_state(0))), ("plain 1", lambda: plain.save(1, _state(1))),
                       ("plain restore", lambda: plain.load(_state(0)))]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="s3dcp"):
            call()
        said[name] = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    m.close()
    local = str(tmp_path / "local")
    assert said["1"] == [f"checkpoint step 1 committed to s3://{bucket}/run/step-00000001 and kept on the nodes "
                         f"({local})"], said
    assert said["2"] == [f"checkpoint step 2 kept on the nodes only ({local}), not in S3 (s3_every=2: one checkpoint "
                         f"in 2 goes there)"], said
    assert len(said["restore"]) == 1 and re.fullmatch(
        r"restored step 2 \(save \w+\) from local: \d+ bytes from the node's copies, 0 from peers, 0 from S3 on "
        r"this rank \(job: .*\) in [\d.]+ s", said["restore"][0]), said
    assert len(said["plain 1"]) == 1 and said["plain 1"][0].startswith(f"committed s3://{bucket}/plain/step-00000001: "
                                                                         "1048976 bytes from 1 rank(s)"), said
    assert len(said["plain restore"]) == 1 and re.fullmatch(
        rf"restored step 1 from s3://{bucket}/plain/step-00000001: 1048976 bytes from S3 on this rank in [\d.]+ s",
        said["plain restore"][0]), said


def test_the_same_manager_rolls_back_over_steps_kept_on_the_nodes_only(s3_config, bucket, tmp_path):
    """docs/restart.md's rollback with one manager: steps 1 (S3) and 2 (the nodes only) saved, back
    to 1, step 2 saved again (before: CheckpointExistsError for step 2, as if S3 held it); without
    a load first, an older step is still refused, and S3's newest always is."""
    from s3dcp.errors import CheckpointExistsError

    m = _manager(s3_config, bucket, tmp_path / "local")
    m.save(1, _state(1))
    m.save(2, _state(2))
    with pytest.raises(CheckpointExistsError, match="at step 2"):
        m.save(2, _state(20))  # no load first: not a rollback
    assert m.load(_state(0), step=1) == 1
    with pytest.raises(CheckpointExistsError, match="at step 1"):
        m.save(1, _state(10))  # S3's newest
    m.save(2, _state(20))
    out = _state(0)
    assert m.load(out) == 2 and all(torch.equal(out[k], v) for k, v in _state(20).items())
    m.close()


@pytest.mark.parametrize("fails", ["the data upload", "the commit"])
def test_a_step_s3_cannot_take_is_kept_on_the_node_and_said_so(s3_server, s3_config, bucket, tmp_path, fails,
                                                              caplog):
    """Issue 39, row 1: S3 answers 503 SlowDown to every PUT of the objects (or of the commit),
    past the retries: the step meant for S3 is kept on the node, its stats and log say why it is
    not in S3, and the next checkpoint tries S3 again (before: the save failed, and its local copy
    went with it)."""
    from urllib.parse import urlsplit

    from fault_proxy import FaultProxy, Rule

    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port, seed=1) as proxy:
        cfg = s3_config.replace(endpoint_url=proxy.endpoint_url, max_retries=1, retry_backoff_base_ms=10)
        m = _manager(cfg, bucket, tmp_path / "local", s3_every=3)
        path = r"\.distcp" if fails == "the data upload" else r"/\.metadata$"
        proxy.add_rule(Rule("error", method="PUT", path_regex=path))
        with caplog.at_level(logging.INFO, logger="s3dcp"):
            m.save(10, _state(10))
        assert "checkpoint step 10 could not be committed to s3://" in caplog.text
        stats = m.last_save_stats
        assert stats.stored_in == ("local",) and stats.s3_error.startswith("ThrottlingError: "), stats
        proxy.clear_rules()
        m.save(20, _state(20))  # S3 again at once (s3_every=3 would keep it on the node)
        assert m.last_save_stats.stored_in == ("s3", "local")
        m.close()
    out = {k: torch.zeros_like(v) for k, v in _state(10).items()}
    m = _manager(s3_config, bucket, tmp_path / "local")
    assert [i.step for i in m.list() if i.committed] == [20]
    assert m.load(out, step=10) == 10 and all(torch.equal(out[k], v) for k, v in _state(10).items())
    assert m.last_load_stats["tier"] == "local"


def test_an_outage_with_nothing_complete_on_the_nodes_is_s3_s_error_not_a_fresh_start(s3_config, bucket, tmp_path):
    """S3 holds step 5000 but cannot be reached, and the nodes hold no complete save: before, a
    CheckpointNotFoundError, which the documented resume (``except CheckpointNotFoundError:
    start = 0``) turned into a silent fresh start."""
    from s3dcp.errors import CheckpointNotFoundError, S3ConnectionError

    m = _manager(s3_config, bucket, tmp_path / "other")
    m.save(5000, _state(1))
    m.close()
    dead = s3_config.replace(endpoint_url="http://127.0.0.1:9", max_retries=0, connect_timeout_s=1)
    m = CheckpointManager(f"s3://{bucket}/run", config=dead, local_dir=tmp_path / "local", async_mode=False)
    with pytest.raises(S3ConnectionError, match="the nodes hold no complete save .* S3 could not be consulted") as e:
        m.load(_state(0))
    assert not isinstance(e.value, CheckpointNotFoundError)


def test_a_save_after_an_outage_checks_s3_s_newest_step_once_s3_answers(s3_config, bucket, tmp_path, monkeypatch):
    """The first save ran while S3 could not be listed: before, the check was marked done for
    good, so a later save below S3's newest step (another run's 5000) went ahead beside it."""
    from s3dcp.errors import CheckpointExistsError, S3ConnectionError

    other = _manager(s3_config, bucket, tmp_path / "other")
    other.save(5000, _state(1))
    other.close()
    m = _manager(s3_config, bucket, tmp_path / "local")
    listing = m._latest_local

    def unreachable():
        raise S3ConnectionError("connection refused")

    monkeypatch.setattr(m, "_latest_local", unreachable)
    m.save(11, _state(11))  # S3 could not be listed: saved without the check
    monkeypatch.setattr(m, "_latest_local", listing)
    with pytest.raises(CheckpointExistsError, match="step 5000"):
        m.save(12, _state(12))
    m.close()


def test_a_save_whose_metadata_no_node_can_read_gives_way_to_an_older_one(s3_config, bucket, tmp_path, caplog):
    """Step 20 is on the node only and its .metadata came back empty (copies are not fsynced: a
    power loss): before, the restore ended with CheckpointNotFoundError though S3 holds step 10."""
    local_dir = tmp_path / "local"
    m = _manager(s3_config, bucket, local_dir)
    m.save(10, _state(10))
    m.save(20, _state(20))
    m.close()
    assert m.last_save_stats.stored_in == ("local",)
    (local_dir / "step-00000020" / "rank-0" / ".metadata").write_bytes(b"")
    out = {k: torch.zeros_like(v) for k, v in _state(10).items()}
    m = _manager(s3_config, bucket, local_dir)
    with caplog.at_level(logging.WARNING, logger="s3dcp"):
        assert m.load(out) == 10
    assert all(torch.equal(out[k], v) for k, v in _state(10).items())
    assert "no node holds a readable .metadata" in caplog.text
