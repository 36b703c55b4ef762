"""torch-checkpointing's own test files, run with its local storage replaced by s3dcp's S3 backend.

    fetch the source (github:meta-pytorch/torch_checkpointing), then, outside this repository:
    git --git-dir=<its git dir> archive HEAD tests | tar -x -C /tmp/tc-upstream
    PYTHONPATH=$PWD python tests/interop/tc_upstream.py /tmp/tc-upstream/tests [--baseline local.xml]
        [--files test_x.py ...] [-- more pytest arguments]

The runner starts pytest on those files twice, with this module as a plugin (``-p tc_upstream``)
that replaces every ``LocalFileSystemStorageConfig`` (the tests' own and the library's
default). The baseline (``S3DCP_TC_UPSTREAM_MODE=local``; ``--baseline`` hands in an earlier
one's JUnit XML instead) keeps the local file system with ``use_direct_io=False``: O_DIRECT
writes fail with EINVAL on file systems that refuse unaligned direct I/O (overlayfs, tmpfs), and
that is the machine, not the library. The S3 run makes it an :class:`S3AsLocalStorageConfig`:
s3dcp's ``S3StorageConfig`` with root ``s3://tc-upstream/upstream`` on a SeaweedFS the plugin
starts (a local path ``/tmp/x`` becomes ``upstream/tmp/x``); after each test the plugin counts
and deletes what the test left there, so the report says which tests went through S3 at all.
The report gives each test's outcome in both runs, the counts, and why each failure on S3
failed as far as its report and its file say: failing alike on the local file system (these
files are a release behind the installed 0.1.1), or using the local disk itself (``os.path``,
``open``, ``safe_open``, fixtures written with ``torch.save`` to a path in ``setUp``); the rest
is marked "look" for a person to judge (a contract gap, or another reason).

Nothing downloaded is kept in this repository: the test files are read where they were unpacked.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

from s3dcp.interop.torch_checkpointing import S3StorageConfig

HERE = Path(__file__).resolve().parent
ROOT_ENV = "S3DCP_TC_UPSTREAM_ROOT"
USED_ENV = "S3DCP_TC_UPSTREAM_USED"
MODE_ENV = "S3DCP_TC_UPSTREAM_MODE"
BUCKET = "tc-upstream"


@dataclass
class S3AsLocalStorageConfig(S3StorageConfig):
    """``LocalFileSystemStorageConfig``'s signature (``use_direct_io``, not used), s3dcp's
    storage: the root comes from the environment the plugin set, the client's settings too
    (``AWS_ENDPOINT_URL`` and keys), in this process and in the ones torch-checkpointing spawns."""

    root: str | None = field(default_factory=lambda: os.environ[ROOT_ENV])
    use_direct_io: bool = True


@dataclass
class BufferedLocalStorageConfig(LocalFileSystemStorageConfig):
    """The local file system without O_DIRECT, whatever the test asks: the baseline."""

    def create_storage(self) -> LocalFileSystemStorage:
        return LocalFileSystemStorage(config=LocalFileSystemStorageConfig(use_direct_io=False))


# ---------------------------------------------------------------------- the pytest plugin
def pytest_configure(config):
    import torch_checkpointing  # noqa: F401 - every module that names the local config is loaded first
    import torch_checkpointing.hf.consolidation  # noqa: F401
    from torch_checkpointing.storage import filesystem

    from s3dcp.testing import SeaweedServer

    if os.environ.get(MODE_ENV) == "local":
        replacement = BufferedLocalStorageConfig
    else:
        server = SeaweedServer().start()
        server.create_bucket(BUCKET)
        config.stash[_SERVER] = server
        os.environ.update(server.env())
        os.environ[ROOT_ENV] = f"s3://{BUCKET}/upstream"
        replacement = S3AsLocalStorageConfig
    original = filesystem.LocalFileSystemStorageConfig
    for module in list(sys.modules.values()):
        if getattr(module, "LocalFileSystemStorageConfig", None) is original:
            module.LocalFileSystemStorageConfig = replacement


def pytest_unconfigure(config):
    server = config.stash.get(_SERVER, None)
    if server is not None:
        server.stop()


def pytest_runtest_teardown(item, nextitem):
    """Count and delete what the test left under the root: did it go through S3 at all?"""
    if os.environ.get(MODE_ENV) == "local":
        return
    from s3dcp.config import S3Config
    from s3dcp.s3.client import S3Client

    client = S3Client(S3Config())
    keys = [o.key for o in client.list(BUCKET, "upstream/").result()[0]]
    if keys:
        client.delete(BUCKET, keys).result()
    client.close()
    used = Path(os.environ[USED_ENV])
    found = json.loads(used.read_text()) if used.exists() else {}
    found[junit_id(item.nodeid)] = len(keys)
    used.write_text(json.dumps(found))


def junit_id(nodeid: str) -> str:
    """A pytest node id as the JUnit report names the test (``tests.test_x.Class::test_y[p]``)."""
    module, *rest = nodeid.split("::")
    classname = ".".join([module[:-3].replace("/", "."), *rest[:-1]])
    return f"{classname}::{rest[-1]}"


_SERVER = pytest.StashKey()


# ---------------------------------------------------------------------- the runner
def _run(tests: Path, junit: Path, extra: list[str], *, mode: str, used: Path) -> None:
    env = {**os.environ, USED_ENV: str(used), MODE_ENV: mode}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent.parent), env.get("PYTHONPATH", "")])
    targets = [a for a in extra if a.startswith(str(tests))] or [str(tests)]
    extra = [a for a in extra if not a.startswith(str(tests))]
    cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "-W", "ignore",
           "--continue-on-collection-errors", "--timeout", "300", f"--junitxml={junit}", "-p", "tc_upstream",
           *extra]
    with open(junit.with_suffix(".log"), "w") as log:  # pytest's own report, beside the XML
        subprocess.run(cmd, cwd=tests.parent, env=env, check=False, stdout=log, stderr=subprocess.STDOUT)


def outcomes(junit: Path) -> dict[str, tuple[str, str, str]]:
    """``{test id: (outcome, first line of its failure, its traceback)}`` from a JUnit XML report."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, why, text = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                why = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
                text = child.text or ""
        found[name] = (outcome, why, text)
    return found


_LOCAL_DISK = re.compile(r"os\.path\.(exists|isdir|isfile|getsize)\(|os\.listdir\(|\bsafe_open\(|\bopen\(|os\.makedirs\(")


def category(s3: tuple[str, str, str], local: tuple[str, str, str], setup: str = "") -> str:
    """Why a test ended as it did on S3, as far as its report and its ``setUp`` (``setup``)
    say; "look" where they say nothing (a person judges those)."""
    outcome, why, text = s3
    if outcome in ("passed", "skipped"):
        return outcome
    if local[0] in ("failed", "error") and local[1][:60] == why[:60]:
        return "fails alike on the local file system"
    if _LOCAL_DISK.search(text):
        return "the test itself uses the local disk"
    if re.search(r"torch\.save\(|os\.makedirs\(", setup):
        return "its setUp writes the fixture to the local disk"
    return "look"


def setup_source(tests: Path, name: str) -> str:
    """The source of the ``setUp`` of test ``name``'s class (``tests.test_x.Class::test_y``)."""
    module, _, _ = name.partition("::")
    parts = module.split(".")
    path = tests / f"{parts[1]}.py" if len(parts) > 2 else None
    if path is None or not path.exists():
        return ""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == parts[2]:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "setUp":
                    return ast.get_source_segment(source, item) or ""
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="the upstream tests directory (unpacked outside this repository)")
    parser.add_argument("--baseline", type=Path, help="JUnit XML of an earlier local run (skips that run)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tc-upstream")
    parser.add_argument("--files", nargs="+", default=[], help="only these files of the tests directory")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.pytest_args = [*(str(args.tests / f) for f in args.files), *extra]
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = args.baseline or args.out / "local.xml"
    used = args.out / "s3-used.json"
    if args.baseline is None:
        _run(args.tests, baseline, args.pytest_args, mode="local", used=args.out / "local-used.json")
    used.unlink(missing_ok=True)
    _run(args.tests, args.out / "s3.xml", args.pytest_args, mode="s3", used=used)
    local, s3 = outcomes(baseline), outcomes(args.out / "s3.xml")
    through = json.loads(used.read_text()) if used.exists() else {}
    rows, kinds = Counter(), Counter()
    for name, result in sorted(s3.items()):
        was = local.get(name, ("absent", "", ""))
        kind = category(result, was, setup_source(args.tests, name))
        kinds[kind] += 1
        rows[(was[0], result[0])] += 1
        if result[0] == "passed" and through.get(name):
            rows[("passed", "passed, through S3")] += 1
        if kind not in ("passed", "skipped"):
            print(f"{kind.upper()}: {name}: {result[1]}  [local: {was[0]}: {was[1][:80]}]")
    print("\nlocal file system (no O_DIRECT) -> S3 backend: count")
    for (was, now), n in sorted(rows.items()):
        print(f"  {was:>8} -> {now:<20} {n}")
    print("\non S3, by why:")
    for kind, n in kinds.most_common():
        print(f"  {kind:<40} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
