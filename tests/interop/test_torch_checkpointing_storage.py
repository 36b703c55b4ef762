"""torch-checkpointing's ``Storage`` contract on S3 (s3dcp.interop.torch_checkpointing), one suite
run against both servers (SeaweedFS and moto): files and directories, every row of the rename
table, staging views and their commit, reads into the caller's buffer (sizes checked, timeouts),
writes that keep the caller's tensors, errors in the contract's terms.

CheckpointManager on two ranks is in test_torch_checkpointing_manager.py."""

from __future__ import annotations

import errno
import gc
import io
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from torch_checkpointing.storage.base_storage import ReadArgs
from torch_checkpointing.storage.torch_serialization import load_torch_serialized_from_storage

from s3dcp.config import MiB
from s3dcp.errors import IntegrityError, NoSuchKeyError
from s3dcp.interop.torch_checkpointing import S3Storage, S3StorageConfig, keep_last
from s3dcp.interop.torch_checkpointing_streams import WriteStream

from fault_proxy import FaultProxy, Rule
from moto_server import MotoServer

PART = 5 * MiB


@pytest.fixture(scope="module")
def moto():
    with MotoServer() as server:
        yield server


@pytest.fixture(params=["seaweedfs", "moto"])
def server(request, s3_server):
    return s3_server if request.param == "seaweedfs" else request.getfixturevalue("moto")


@pytest.fixture
def storage(server) -> S3Storage:
    name = f"tc-{uuid.uuid4().hex[:12]}"
    server.create_bucket(name)
    s3 = server.s3_config(part_size_bytes=PART, download_part_size_bytes=PART)
    return S3StorageConfig(root=f"s3://{name}/run", s3=s3, read_block_bytes=64 << 10).create_storage()


def keys(storage: S3Storage) -> list[str]:
    bucket = storage.config.root.split("/")[2]
    return sorted(o.key for o in storage.client.list(bucket, "").result()[0])


def test_files_and_directories(storage):
    storage.mkdir(Path("a/b"))
    assert storage.exists(Path("a/b")) and storage.isdir(Path("a/b")) and storage.ls(Path("a/b")) == []
    assert storage.ls(Path("a")) == ["b"] and storage.ls(Path("/")) == ["a"]
    storage.write(Path("a/b/x.bin"), b"hello")
    storage.write(Path("a/b/tmp_buffer_0.pt"), bytearray(b"a file may carry the staging prefix"))
    assert storage.read(Path("a/b/x.bin")) == b"hello" and storage.getsize(Path("a/b/x.bin")) == 5
    assert storage.read(Path("a/b/tmp_buffer_0.pt")).startswith(b"a file")
    assert storage.ls(Path("a/b")) == ["tmp_buffer_0.pt", "x.bin"]  # the directory's marker is not listed
    assert storage.exists(Path("a/b/x.bin")) and not storage.isdir(Path("a/b/x.bin"))
    assert sorted(storage.glob("a/b/*.bin")) == ["a/b/x.bin"]
    assert storage.remap_path(Path("a/b/x.bin")) == f"{storage.config.root}/a/b/x.bin"
    storage.delete(Path("a/b/x.bin"))
    assert not storage.exists(Path("a/b/x.bin"))
    with pytest.raises(FileNotFoundError) as missing:
        storage.delete(Path("a/b/x.bin"))
    assert isinstance(missing.value, NoSuchKeyError) and "a/b/x.bin" in str(missing.value)  # s3dcp's message
    with pytest.raises(FileNotFoundError):
        storage.getsize(Path("nope"))
    with pytest.raises(FileNotFoundError):
        storage.mkdir(Path("c/d"), recursive=False)
    with pytest.raises(FileNotFoundError, match="mkdir it first") as no_dir:  # as on a file system
        storage.write(Path("c/d/x.bin"), b"x")
    assert isinstance(no_dir.value, RuntimeError)  # what torch-checkpointing's local backend raises there
    with pytest.raises(NotADirectoryError):
        storage.ls(Path("a/b/tmp_buffer_0.pt"))
    storage.rmdir(Path("a"))
    assert not storage.exists(Path("a")) and keys(storage) == []
    with pytest.raises(FileNotFoundError):
        storage.ls(Path("a"))


def test_a_staged_directory_is_hidden_until_its_rename_commits_it_without_a_copy(storage, server):
    storage.mkdir(Path("tmp_step_1"))
    storage.write(Path("tmp_step_1/model_0.pt"), os.urandom(1000))
    storage.write(Path("tmp_step_1/metadata.pkl"), b"m")
    assert storage.exists(Path("tmp_step_1")) and storage.ls(Path("tmp_step_1")) == ["metadata.pkl", "model_0.pt"]
    for hidden in ("step_1", "step_1/model_0.pt", "step_1/metadata.pkl"):  # a reader's names
        assert not storage.exists(Path(hidden)), hidden
    with pytest.raises(FileNotFoundError, match="has not committed"):
        storage.read(Path("step_1/metadata.pkl"))
    with pytest.raises(FileNotFoundError, match="has not committed"):
        storage.write(Path("step_1/extra"), b"x")
    assert storage.ls(Path("/")) == ["tmp_step_1"]
    written = {k for k in keys(storage) if not k.endswith(".s3dcp-staging")}
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert storage.ls(Path("/")) == ["step_1"] and not storage.exists(Path("tmp_step_1"))
    assert storage.read(Path("step_1/metadata.pkl")) == b"m"
    assert set(keys(storage)) == written | {"run/step_1/.s3dcp-commit"}  # in place: nothing copied, one marker
    # committed, never written over: staging the same name again is refused before any byte goes
    with pytest.raises(FileExistsError, match="holds a committed checkpoint"):
        storage.mkdir(Path("tmp_step_1"))
    assert set(keys(storage)) == written | {"run/step_1/.s3dcp-commit"}
    storage.mkdir(Path("plain/empty_sub"))  # not staged, and not empty: its subdirectory's marker is no marker of it
    with pytest.raises(FileExistsError, match="not written as a staged checkpoint"):
        storage.mkdir(Path("tmp_plain"))


def test_a_second_commit_onto_a_committed_name_raises_and_changes_nothing(storage):
    storage.mkdir(Path("tmp_s"))
    storage.write(Path("tmp_s/f"), b"first")
    storage.rename(Path("tmp_s"), Path("s"), is_directory=True)
    with pytest.raises(FileNotFoundError):  # nothing staged any more
        storage.rename(Path("tmp_s"), Path("s"), is_directory=True)
    # a second save of the name that staged before the first one committed: its staging marker
    # is back, but the commit marker wins; its writes and its commit (create-only) are refused
    bucket = storage.config.root.split("/")[2]
    storage.client.put(bucket, "run/s/.s3dcp-staging", b"").result()
    assert storage.exists(Path("s")) and not storage.exists(Path("tmp_s"))
    with pytest.raises(FileNotFoundError, match="not a save in progress"):
        storage.write(Path("tmp_s/f"), b"second")
    view, final = storage._paths.where("tmp_s", file=False), storage._paths.where("s", file=False)
    with pytest.raises(FileExistsError, match="committed already"):
        storage._dirs.commit(view, final)  # what its rename does once past the staging check
    assert storage.read(Path("s/f")) == b"first"


def test_every_row_of_the_rename_table(storage):
    def tree(root: str, files: dict) -> None:
        storage.mkdir(Path(root))
        for name, data in files.items():
            storage.mkdir(Path(f"{root}/{name}").parent)
            storage.write(Path(f"{root}/{name}"), data)

    tree("d1", {"x": b"1", "sub/y": b"2"})
    storage.rename(Path("d1"), Path("moved"), is_directory=True)  # directory -> absent: lands AT dst
    assert storage.ls(Path("moved")) == ["sub", "x"] and storage.read(Path("moved/sub/y")) == b"2"
    assert not storage.exists(Path("d1"))
    storage.mkdir(Path("empty"))
    storage.rename(Path("moved"), Path("empty"), is_directory=True)  # -> empty directory: replaced
    assert storage.ls(Path("empty")) == ["sub", "x"]
    tree("d2", {"z": b"3"})
    with pytest.raises(FileExistsError):  # -> populated directory: raise, never merge
        storage.rename(Path("d2"), Path("empty"), is_directory=True)
    assert storage.ls(Path("empty")) == ["sub", "x"] and storage.ls(Path("d2")) == ["z"]
    storage.write(Path("file"), b"f")
    with pytest.raises(FileExistsError):  # directory -> file
        storage.rename(Path("d2"), Path("file"), is_directory=True)
    storage.rename(Path("file"), Path("file2"))  # file -> absent
    assert storage.read(Path("file2")) == b"f" and not storage.exists(Path("file"))
    storage.write(Path("file3"), b"old")
    storage.rename(Path("file2"), Path("file3"))  # file -> file: replaced
    assert storage.read(Path("file3")) == b"f"
    with pytest.raises(FileExistsError):  # file -> directory (empty or not)
        storage.rename(Path("file3"), Path("d2"))
    storage.mkdir(Path("e2"))
    with pytest.raises(FileExistsError):
        storage.rename(Path("file3"), Path("e2"))
    with pytest.raises(FileNotFoundError):
        storage.rename(Path("nothing"), Path("x"))
    tree("tmp_c", {"w": b"4"})  # a committed checkpoint renamed by copy stays committed
    storage.rename(Path("tmp_c"), Path("c"), is_directory=True)
    storage.rename(Path("c"), Path("c2"), is_directory=True, background_cleanup=True)
    assert "c2" in storage.committed(Path("/")) and storage.read(Path("c2/w")) == b"4"


def test_reads_land_in_the_callers_buffer_and_check_the_objects_size(storage):
    data = os.urandom(3 * PART + 777)
    storage.write(Path("big"), data)
    with storage.stream_read(Path("big"), ReadArgs(pre_read_full_file=False)) as f:
        assert f.seek(PART - 5) == PART - 5
        into = bytearray(2 * PART)  # one ranged GET of two parts, straight into `into`
        assert f.readinto(into) == 2 * PART and into == data[PART - 5:3 * PART - 5]
        assert f.read(10) == data[3 * PART - 5:3 * PART + 5]  # small: through one block
        f.seek(-3, io.SEEK_END)
        assert f.read() == data[-3:] and f.read(5) == b""
        with pytest.raises(OSError, match=r"negative seek position -1 in s3://.*/big"):
            f.seek(-1 - len(data), io.SEEK_END)
    with storage.stream_read(Path("big")) as whole:  # pre_read_full_file (the default)
        assert whole.seek(PART, io.SEEK_CUR) == PART and whole.read(3) == data[PART:PART + 3]
        whole.seek(0)
        assert whole.read() == data
        with pytest.raises(OSError, match="negative seek position -1"):
            whole.seek(-1)
    assert storage.read(Path("big"), ReadArgs(pre_read_full_file=False)) == data
    told = bytearray(b"\x01" * PART)
    with storage.stream_read(Path("big"), ReadArgs(pre_read_full_file=False, known_size_bytes=len(data) - 1)) as f:
        with pytest.raises(OSError) as wrong:
            f.readinto(told)
    assert isinstance(wrong.value.__cause__, IntegrityError) and "not the" in str(wrong.value)
    assert told == b"\x01" * PART  # refused before a byte was copied


def test_torch_checkpointings_parallel_mmap_fill_reads_through_the_streams(storage):
    tensors = {"w": torch.randn(3 * PART // 4 + 5), "i": torch.arange(100)}
    with storage.get_write_stream(Path("f.pt"), tensors) as f:
        torch.save(tensors, f)
    assert storage.mmap_fill_chunk_bytes == PART and storage.mmap_fill_workers >= 2
    back = load_torch_serialized_from_storage(Path("f.pt"), storage, map_location="cpu")
    assert torch.equal(back["w"], tensors["w"]) and torch.equal(back["i"], tensors["i"])


def test_a_write_stream_keeps_the_callers_tensors_and_lets_go_of_them(storage):
    tensors = {"a": torch.randn(PART // 2), "b": [torch.randn(300, 300), torch.tensor(3)]}
    stream = storage.get_write_stream(Path("t.pt"), tensors)
    ref = weakref.ref(tensors["a"].untyped_storage())
    with stream:
        torch.save(tensors, stream)
        kept = sum(p.nbytes for p in stream._pieces if isinstance(p, memoryview) and not isinstance(p.obj, bytearray))
        copied = stream._copied
    assert kept >= tensors["a"].nbytes + tensors["b"][0].nbytes and copied < 64 << 10  # headers, pickle
    back = torch.load(io.BytesIO(storage.read(Path("t.pt"))))
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"][0], tensors["b"][0])
    del tensors, back
    gc.collect()
    assert ref() is None  # nothing held after close


def test_copied_bytes_past_the_memory_bound_spool_and_a_failed_write_uploads_nothing(storage, tmp_path):
    small = S3Storage(replace(storage.config, write_memory_bytes=1 * MiB, spool_dir=str(tmp_path)),
                      client=storage.client)
    data = os.urandom(2 * PART + 3)
    with small.stream_write(Path("spooled")) as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i:i + (1 << 20)])
        assert f._spool is not None and f._copied <= 1 * MiB
    assert small.read(Path("spooled")) == data and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with small.stream_write(Path("failed")) as f:
            f.write(b"half of it")
            raise RuntimeError("torch.save failed midway")
    assert not small.exists(Path("failed"))
    leaked = small.stream_write(Path("dropped"))
    leaked.write(b"never closed")
    del leaked
    gc.collect()
    assert not small.exists(Path("dropped"))


def test_keep_last_deletes_only_older_committed_checkpoints(storage):
    for step in (2, 10, 9):
        storage.mkdir(Path(f"tmp_step_{step}"))
        storage.write(Path(f"tmp_step_{step}/m"), b"x")
        storage.rename(Path(f"tmp_step_{step}"), Path(f"step_{step}"), is_directory=True)
    storage.mkdir(Path("tmp_step_11"))  # in progress: not committed, neither counted nor touched
    storage.write(Path("tmp_step_11/m"), b"x")
    assert storage.committed(Path("/")) == ["step_2", "step_9", "step_10"]
    assert keep_last(storage, "/", 2) == ["step_2"]
    assert storage.ls(Path("/")) == ["step_10", "step_9", "tmp_step_11"]


def test_a_read_past_its_timeout_is_stopped(s3_server, bucket):
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        s3 = replace(s3_server.s3_config(), endpoint_url=proxy.endpoint_url)
        storage = S3StorageConfig(root=f"s3://{bucket}/run", s3=s3).create_storage()
        storage.write(Path("slow"), os.urandom(PART))
        proxy.add_rule(Rule("stall", method="GET", path_regex="/run/slow"))
        started = time.monotonic()
        into = bytearray(PART)
        with storage.stream_read(Path("slow"), ReadArgs(pre_read_full_file=False, timeout_us=1_000_000,
                                                        known_size_bytes=PART)) as f:
            with pytest.raises(TimeoutError, match="timeout_us"):
                f.readinto(into)
        assert time.monotonic() - started < 10


def test_a_rename_into_itself_is_refused_and_loses_nothing(storage):
    storage.mkdir(Path("a"))
    storage.write(Path("a/f"), b"1")
    storage.mkdir(Path("tmp_x/sub"))
    storage.write(Path("tmp_x/sub/g"), b"2")
    storage.write(Path("tmp_x/h"), b"3")
    before = keys(storage)
    for src, dst in (("a", "a/b"), ("a", "a"), ("tmp_x/sub", "x/sub"), ("tmp_x", "tmp_x"),
                     ("tmp_x/sub", "tmp_x"), ("tmp_x/h", "x/h")):
        with pytest.raises(OSError) as refused:
            storage.rename(Path(src), Path(dst), is_directory=not src.endswith("/h"))
        assert refused.value.errno == errno.EINVAL, (src, dst, refused.value)
        assert keys(storage) == before, (src, dst)
    assert storage.read(Path("a/f")) == b"1" and storage.read(Path("tmp_x/sub/g")) == b"2"


def test_a_rename_onto_a_save_in_progress_is_refused_and_merges_nothing(storage):
    storage.mkdir(Path("tmp_y"))
    storage.write(Path("tmp_y/part_0.pt"), b"half a save")
    storage.mkdir(Path("d"))
    storage.write(Path("d/other.pt"), b"someone else's")
    storage.write(Path("file"), b"f")
    before = keys(storage)
    with pytest.raises(FileExistsError, match="save in progress"):  # directory onto it
        storage.rename(Path("d"), Path("y"), is_directory=True)
    with pytest.raises(FileExistsError):  # file onto it
        storage.rename(Path("file"), Path("y"))
    with pytest.raises(FileNotFoundError, match="has not committed"):  # into it, under its final name
        storage.rename(Path("d"), Path("y/sub"), is_directory=True)
    assert keys(storage) == before
    assert not storage.exists(Path("y")) and storage.ls(Path("tmp_y")) == ["part_0.pt"]
    assert storage.committed(Path("/")) == []


def _forward(source: Future, into: Future) -> None:
    source.add_done_callback(lambda f: into.set_exception(f.exception()) if f.exception() is not None
                             else into.set_result(f.result()))


def test_a_checkpoint_being_deleted_is_hidden_and_a_new_save_of_its_name_is_refused(storage, monkeypatch):
    storage.mkdir(Path("tmp_x"))
    storage.write(Path("tmp_x/f"), b"old")
    storage.rename(Path("tmp_x"), Path("x"), is_directory=True)
    storage.write(Path("other"), b"o")
    real_list, reached, gate = storage.client.list, threading.Event(), threading.Event()

    def held_list(bucket, prefix, **kwargs):  # the removal's listing waits for the gate
        if prefix == "run/x/" and not kwargs and not reached.is_set():
            reached.set()
            held: Future = Future()
            threading.Thread(target=lambda: (gate.wait(30), _forward(real_list(bucket, prefix), held)),
                             daemon=True).start()
            return held
        return real_list(bucket, prefix, **kwargs)

    monkeypatch.setattr(storage.client, "list", held_list)
    deleting = threading.Thread(target=storage.rmdir, args=(Path("x"),))
    deleting.start()
    try:
        assert reached.wait(30)
        assert not storage.exists(Path("x")) and not storage.exists(Path("tmp_x")) and storage.ls(Path("/")) == ["other"]
        with pytest.raises(FileNotFoundError, match="being deleted"):
            storage.read(Path("x/f"))
        with pytest.raises(FileExistsError, match="being deleted"):  # before: joined it, its files then deleted
            storage.mkdir(Path("tmp_x"))
    finally:
        gate.set()
        deleting.join(30)
    assert keys(storage) == ["run/other"]
    storage.mkdir(Path("tmp_x"))  # once deleted, the name is free again
    storage.write(Path("tmp_x/f"), b"new")
    storage.rename(Path("tmp_x"), Path("x"), is_directory=True)
    assert storage.read(Path("x/f")) == b"new"


@pytest.mark.parametrize("spooled", [False, True])
def test_a_write_stream_whose_directory_was_committed_meanwhile_uploads_nothing(storage, spooled):
    if spooled:  # every byte copied past the memory bound: the spool file's upload
        storage = S3StorageConfig(root=storage.config.root, s3=storage.config.s3, write_memory_bytes=4).create_storage()
    storage.mkdir(Path("tmp_z"))
    storage.write(Path("tmp_z/a"), b"first save")
    late = storage.get_write_stream(Path("tmp_z/b"), None)  # open: the save is in progress
    late.write(b"the other save's file")
    storage.rename(Path("tmp_z"), Path("z"), is_directory=True)  # another job commits the name
    with pytest.raises(FileNotFoundError, match="not a save in progress"):
        late.close()
    assert storage.ls(Path("z")) == ["a"] and not storage.exists(Path("z/b"))


def _read_x_f(storage, how):
    if how == "exists":
        return storage.exists(Path("x/f"))
    if how == "read":
        return storage.read(Path("x/f"))
    if how == "ls":
        return storage.ls(Path("x"))
    args = ReadArgs(known_size_bytes=7, pre_read_full_file=how == "pre-read")
    with storage.stream_read(Path("x/f"), args) as f:
        return f.read()


@pytest.mark.parametrize("how, method, key", [("exists", "head", "run/x/f"), ("read", "head", "run/x/f"),
                                              ("pre-read", "get_range_into", "run/x/f"),
                                              ("stream", "get_range_into", "run/x/f"), ("ls", "list", "run/x/")])
def test_a_save_staged_between_the_marker_checks_and_the_data_request_is_not_seen(storage, monkeypatch, how,
                                                                                  method, key):
    """Every request goes through a recorder; the data request waits for all sent before it,
    then another job stages x and writes x/f, then it is sent: its answer shows the file, and a
    marker check sent before it would have found no staging marker yet."""
    writer = S3StorageConfig(root=storage.config.root, s3=storage.config.s3).create_storage()
    client, sent, done = storage.client, [], []

    def recorded(name):
        real = getattr(client, name)

        def call(bucket, target, *args, **kwargs):
            if name == method and target == key and not done:
                done.append(True)
                for f in sent:  # what was asked before the data request is answered
                    f.exception()
                writer.mkdir(Path("tmp_x"))
                writer.write(Path("tmp_x/f"), b"partial")
            future = real(bucket, target, *args, **kwargs)
            sent.append(future)
            return future

        return call

    for name in ("head", "list", "get_range_into"):
        monkeypatch.setattr(client, name, recorded(name))
    if how == "exists":
        assert _read_x_f(storage, how) is False
    else:
        with pytest.raises(FileNotFoundError, match="has not committed"):
            _read_x_f(storage, how)
    assert done
