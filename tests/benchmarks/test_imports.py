"""Benchmarks share their helpers with the tests through `testing/`, never by importing a
test module (a benchmark run from a tree without tests/ would fail, and a test's edits
would change what a benchmark measures)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.append(node.module)
    return names


def test_no_benchmark_imports_a_test_module():
    sources = sorted(BENCHMARKS.rglob("*.py"))
    assert sources, "no benchmark found"
    offenders = [
        f"{path.relative_to(BENCHMARKS.parent)}: {name}"
        for path in sources
        for name in imported_modules(path)
        if name == "tests" or name.startswith("tests.")
    ]
    assert offenders == []


def test_the_walk_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "bench.py"
    source.write_text("def main():\n    from tests.engine.model.test_loader import x\n")
    assert imported_modules(source) == ["tests.engine.model.test_loader"]
