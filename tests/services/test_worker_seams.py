"""The worker reads the engine only through the scheduler's own methods
(engine/sched/status.py): no module of services/worker/ follows the scheduler or the engine
core to an attribute of one of their parts (`scheduler.cache_manager.tree_cache`), where
the managers behind the scheduler would become the service's business."""

from __future__ import annotations

import ast
from pathlib import Path

import services.worker

ENGINE_OBJECTS = {"scheduler", "sched", "core"}
WORKER_DIR = Path(services.worker.__file__).parent


def _names(node: ast.Attribute) -> list[str]:
    """`a.b.c` → ["a", "b", "c"]; a chain through a call starts after it."""
    names = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        names.append(value.attr)
        value = value.value
    if isinstance(value, ast.Name):
        names.append(value.id)
    return names[::-1]


def reaches_past(tree: ast.AST) -> list[str]:
    """The attribute chains that go two attributes or more past an engine object."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names = _names(node)
            for i, name in enumerate(names):
                if name in ENGINE_OBJECTS and len(names) - i - 1 >= 2:
                    found.append(".".join(names))
                    break
    return found


def test_the_check_sees_a_reach_into_the_schedulers_parts():
    assert reaches_past(ast.parse("self.scheduler.output_processor.outputs"))
    assert reaches_past(ast.parse("sched.lora.adapters()"))
    assert reaches_past(ast.parse("self.core.model_runner.deterministic"))
    assert not reaches_past(ast.parse("self.scheduler.info().max_total_tokens"))
    assert not reaches_past(ast.parse("self.scheduler.lora_adapters()"))


def test_the_worker_reads_the_scheduler_through_its_methods_only():
    modules = sorted(WORKER_DIR.glob("*.py"))
    assert len(modules) >= 4
    reaches = {
        path.name: found
        for path in modules
        if (found := reaches_past(ast.parse(path.read_text(), str(path))))
    }
    assert reaches == {}
