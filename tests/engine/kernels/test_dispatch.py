"""Every layer module picks its kernels through `engine.kernels.custom_op` alone: a walk of
their source fails on any other way of asking which device or library runs a tensor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.kernels import custom_op
from engine.kernels.custom_op import CustomOp
from engine.model.layers.activation import SiluAndMul

REPO = Path(__file__).resolve().parents[3]
LAYER_DIRS = ("engine/model/layers", "engine/model/models", "engine/lora")
DEVICE_QUESTIONS = {"is_cuda", "is_cpu"}
"""Tensor attributes that name a device: asking them chooses a backend."""
LIBRARY_MODULES = ("engine.kernels.cpu.build", "engine.kernels.triton")
"""Modules whose import outside a `forward_cuda` means picking a library by hand, unless the
importing function asked `uses_triton` for it (a Triton kernel called from a plain function:
LoRA's term, the quantized matmul)."""
ALLOWED = {("engine/model/layers/linear.py", "mkldnn_packing_applies")}
"""Functions that may read a device: oneDNN's weight layout, chosen once at load."""


def layer_modules() -> list[Path]:
    return sorted(path for folder in LAYER_DIRS for path in (REPO / folder).glob("*.py"))


def backend_picks(path: Path, root: Path = REPO) -> list[str]:
    """`file:line what` for each backend question the module asks by hand."""
    tree = ast.parse(path.read_text())
    rel = str(path.relative_to(root))
    found: list[str] = []

    def visit(node: ast.AST, function: str, asks_triton: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
            asks_triton = any(
                isinstance(n, ast.Call) and ast.unparse(n.func).endswith("uses_triton")
                for n in ast.walk(node)
            )
        where = f"{rel}:{getattr(node, 'lineno', 0)} in {function}"
        if (rel, function) not in ALLOWED:
            if isinstance(node, ast.Attribute) and node.attr in DEVICE_QUESTIONS:
                found.append(f"{where}: .{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "type":
                if isinstance(node.value, ast.Attribute) and node.value.attr == "device":
                    found.append(f"{where}: .device.type")
                if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in (
                    "torch.device",
                ):
                    found.append(f"{where}: torch.device(...).type")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.is_available":
                found.append(f"{where}: torch.cuda.is_available()")
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            if function != "forward_cuda" and any(
                name.startswith(LIBRARY_MODULES) for name in (node.module, *names)
            ):
                if not (asks_triton and node.module.startswith("engine.kernels.triton")):
                    found.append(f"{where}: imports {node.module}")
        for child in ast.iter_child_nodes(node):
            visit(child, function, asks_triton)

    visit(tree, "<module>", False)
    return found


def test_layer_modules_ask_the_dispatch_base_which_backend_runs():
    picks = [pick for path in layer_modules() for pick in backend_picks(path)]
    assert layer_modules(), "the walk found no layer module"
    assert picks == [], "backend picked outside engine/kernels/custom_op.py:\n" + "\n".join(picks)


def test_the_walk_sees_a_backend_picked_by_hand(tmp_path):
    source = tmp_path / "engine" / "model" / "layers" / "bad.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "from engine.kernels.cpu import build\n"
        "def forward(x):\n"
        "    if x.is_cuda or x.device.type == 'cpu' and build.enabled():\n"
        "        return x\n"
        "def unasked(x):\n"
        "    from engine.kernels.triton import gguf_matmul\n"
        "def asked(x):\n"
        "    if custom_op.uses_triton(x):\n"
        "        from engine.kernels.triton import gguf_matmul\n"
    )
    picks = backend_picks(source, root=tmp_path)
    assert len(picks) == 4 and "in unasked" in picks[-1], picks


def test_every_class_with_a_device_forward_is_a_custom_op():
    for path in layer_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
            if methods & {"forward_cpu", "forward_cuda"}:
                bases = {ast.unparse(base) for base in node.bases}
                assert "CustomOp" in bases, f"{path}: {node.name} has device forwards"


@pytest.mark.parametrize(
    ("triton", "cpu_kernels", "dtype", "expected"),
    [
        (True, True, torch.bfloat16, "forward_cuda"),
        (False, True, torch.bfloat16, "forward_cpu"),
        (False, True, torch.float32, "forward_native"),  # the kernel takes 16-bit rows only
        (False, False, torch.bfloat16, "forward_native"),
    ],
)
def test_dispatch_takes_the_device_kernel_where_it_applies(
    triton, cpu_kernels, dtype, expected, monkeypatch
):
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: triton)
    monkeypatch.setattr(custom_op.cpu_build, "enabled", lambda: cpu_kernels)
    layer = SiluAndMul()
    chosen = layer.dispatch(torch.zeros(2, 8, dtype=dtype))
    assert isinstance(layer, CustomOp)
    assert chosen.__func__ is getattr(SiluAndMul, expected)
