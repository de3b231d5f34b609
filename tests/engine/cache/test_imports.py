"""The prefix cache knows keys and slots only: nothing under engine/cache imports the
scheduler, not even for type checking."""

from __future__ import annotations

from pathlib import Path

import engine.cache
from testing.imports import imported_modules

CACHE_DIR = Path(engine.cache.__file__).parent


def package_of(path: Path) -> str:
    return ".".join(["engine", "cache", *path.relative_to(CACHE_DIR).parts[:-1]])


def names_the_scheduler(module: str) -> bool:
    return module.split(".")[:2] == ["engine", "sched"]


def test_no_module_under_engine_cache_imports_the_scheduler():
    paths = sorted(CACHE_DIR.rglob("*.py"))
    assert {"radix_cache.py", "base_prefix_cache.py", "chunk_cache.py"} <= {p.name for p in paths}
    offending = {
        str(path.relative_to(CACHE_DIR)): sorted(
            filter(names_the_scheduler, imported_modules(path.read_text(), package_of(path)))
        )
        for path in paths
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_walk_sees_type_checking_blocks_plain_and_relative_imports():
    source = (
        "import engine.sched.policy\n"
        "if TYPE_CHECKING:\n"
        "    from engine.sched.req import Req\n"
        "def f():\n"
        "    from ..sched import batch\n"
    )
    found = set(filter(names_the_scheduler, imported_modules(source, "engine.cache")))
    assert found == {
        "engine.sched.policy",
        "engine.sched.req",
        "engine.sched.req.Req",
        "engine.sched",
        "engine.sched.batch",
    }
    assert not any(
        map(names_the_scheduler, imported_modules("from . import radix_key", "engine.cache"))
    )


def test_outside_engine_cache_only_the_constructor_names_a_cache_class_and_none_a_node():
    """Callers hold `BasePrefixCache` and its opaque `CacheHandle`; the one place that builds
    the cache from the arguments names the two classes, nobody names `TreeNode`."""
    repo = CACHE_DIR.parent.parent
    internals = {
        "engine.cache.tree_node",
        "engine.cache.radix_cache.RadixCache",
        "engine.cache.chunk_cache.ChunkCache",
    }
    named = {
        str(path.relative_to(repo)): sorted(
            internals
            & imported_modules(path.read_text(), ".".join(path.relative_to(repo).parts[:-1]))
        )
        for top in ("engine", "services")
        for path in (repo / top).rglob("*.py")
        if CACHE_DIR not in path.parents
    }
    assert {path: names for path, names in named.items() if names} == {
        "engine/sched/cache_manager.py": [
            "engine.cache.chunk_cache.ChunkCache",
            "engine.cache.radix_cache.RadixCache",
        ]
    }
