"""The rules of the house, checked on the source: imports run down the stages of the data flow
and never in a circle (late imports inside functions included), no module over the size that
holds one idea, and every module says what it owns (docs/architecture.md draws the same)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "s3dcp"
MAX_LINES = 450

# Stages, lowest first: a module may import its own stage or a lower one, never a higher one,
# and never a peer stage at the same height (s3/ and format/ do not know each other).
STAGES = [
    ("base", 0, ("s3dcp.errors", "s3dcp._version", "s3dcp._dcp_warning", "s3dcp._private_dir",
                "s3dcp._partial_file")),
    ("settings", 1, ("s3dcp.config", "s3dcp.uri")),
    ("s3", 2, ("s3dcp.s3",)),
    ("format", 2, ("s3dcp.format",)),
    ("memory", 2, ("s3dcp.memory",)),
    ("tools", 2, ("s3dcp.testing", "s3dcp.localserver", "s3dcp._seaweed_process", "s3dcp._seaweed_security")),
    ("loading", 3, ("s3dcp.loading",)),
    ("saving", 4, ("s3dcp.saving",)),
    ("lifecycle", 5, ("s3dcp.lifecycle",)),
    ("api", 5, ("s3dcp.api",)),
    ("interop", 6, ("s3dcp.interop",)),  # trainer integrations keep checkpoints through lifecycle/
    ("cli", 7, ("s3dcp.cli",)),
    ("root", 8, ("s3dcp",)),
]


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every s3dcp module ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "s3dcp":
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "s3dcp")
    return {m for m in out if m in modules and m != name}


def _stage(module: str) -> tuple[str, int]:
    best = max((p for _, _, prefixes in STAGES for p in prefixes if module == p or module.startswith(p + ".")),
               key=len)
    return next((s, h) for s, h, prefixes in STAGES if best in prefixes)


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        stage, height = _stage(module)
        for target in targets:
            t_stage, t_height = _stage(target)
            if t_stage != stage and t_height >= height:
                wrong.append(f"{module} ({stage}) imports {target} ({t_stage})")
    return wrong


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    done: set[str] = set()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_imports_run_down_the_stages():
    assert _upward(_graph()) == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_every_module_is_small_and_says_what_it_owns():
    too_long, undocumented = [], []
    for name, path in sorted(_modules().items()):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long.append(f"{name}: {lines} lines")
        if not ast.get_docstring(ast.parse(path.read_text())):
            undocumented.append(name)
    assert too_long == [] and undocumented == []


def test_the_checker_sees_an_upward_and_a_circular_late_import(tmp_path):
    """The rules above would pass vacuously if the parser found no edges."""
    fake = tmp_path / "s3dcp"
    for folder, text in {
        "": "",
        "format": "",
        "saving": "",
    }.items():
        (fake / folder).mkdir(parents=True, exist_ok=True)
        (fake / folder / "__init__.py").write_text(text)
    (fake / "format" / "names.py").write_text("def f():\n    from ..saving import writer\n")
    (fake / "saving" / "writer.py").write_text("from ..format.names import f\n")
    graph = _graph(fake)
    assert graph["s3dcp.format.names"] == {"s3dcp.saving.writer"}
    assert _upward(graph) == ["s3dcp.format.names (format) imports s3dcp.saving.writer (saving)"]
    assert _cycles(graph) == ["s3dcp.format.names -> s3dcp.saving.writer -> s3dcp.format.names"]
