"""What a module imports, read from its source: every import statement, including those
inside functions and `if TYPE_CHECKING:` blocks, so that layering tests see what a
runtime import graph would miss."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(source: str, package: str) -> set[str]:
    """Every module that `source`, a module of `package`, names in an import statement
    anywhere (inside functions and `if TYPE_CHECKING:` blocks too), relative ones resolved;
    `from m import x` counts as `m` and as `m.x` (x may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def module_name(path: Path, root: Path) -> str:
    """`engine/sched/req.py` -> `engine.sched.req`; a package's `__init__.py` -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path, root: Path) -> dict[str, set[str]]:
    """For each module under `package_dir`: the modules of the same tree it imports (a
    `from m import x` naming a submodule counts as that submodule, else as `m`)."""
    modules = {module_name(p, root): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {m for m in imported_modules(path.read_text(), package) if m in modules}
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module of `graph` that importing `start` runs, directly or through others, the
    packages around each included (importing `a.b.c` runs `a/__init__.py` and
    `a/b/__init__.py` first)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for module in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            if module in graph and module not in seen:
                seen.add(module)
                todo.extend(graph[module])
    return seen
