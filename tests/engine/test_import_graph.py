"""No import cycles anywhere under engine/, counting imports inside functions and
`if TYPE_CHECKING:` blocks: each module can be read, and tested, after the ones it uses;
and engine/ never imports services/."""

from __future__ import annotations

from pathlib import Path

import engine
from testing.imports import cycles, import_graph, imported_modules

ENGINE_DIR = Path(engine.__file__).parent
REPO = ENGINE_DIR.parent


def test_engine_has_no_import_cycle():
    graph = import_graph(ENGINE_DIR, REPO)
    assert {"engine.sched.scheduler", "engine.cache.radix_cache"} <= set(graph)
    assert cycles(graph) == []


def test_engine_never_imports_services():
    offending = {
        str(path.relative_to(REPO)): sorted(
            m for m in imported_modules(path.read_text(), "engine") if m.split(".")[0] == "services"
        )
        for path in ENGINE_DIR.rglob("*.py")
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_walk_finds_a_cycle_through_a_type_checking_import(tmp_path: Path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (package / "c.py").write_text("def f():\n    from . import a\n")
    assert cycles(import_graph(package, tmp_path)) == [["pkg.a", "pkg.b"]]
