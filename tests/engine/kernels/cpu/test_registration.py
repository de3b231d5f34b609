"""The library's op schemas: each defined once, in `csrc/registration.cpp` alone, each with a
kernel there and a wrapper in `ops.py`; and the block layouts the kernels use are the
loader's (`engine/model/layers/quantization.py`)."""

from __future__ import annotations

import re

import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.quantization import BLOCK_LAYOUTS, WeightFormat, row_bytes

REGISTRATION = cpu_build.CSRC / "registration.cpp"


def defined_ops() -> list[str]:
    return re.findall(r'm\.def\(\s*"(\w+)\(', REGISTRATION.read_text())


def test_every_op_schema_is_defined_once_in_the_registration_file():
    names = defined_ops()
    assert names, "no schema found"
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for source in (*cpu_build.sources(), *cpu_build.headers()):
        if source != REGISTRATION:
            assert "TORCH_LIBRARY" not in source.read_text(), f"{source} registers ops"


def test_every_schema_has_a_kernel_and_a_wrapper():
    text = REGISTRATION.read_text()
    implemented = re.findall(r'm\.impl\("(\w+)"', text)
    assert sorted(implemented) == sorted(defined_ops())
    wrapped = set(re.findall(r"torch\.ops\.radixserve_cpu\.(\w+)", open(cpu_ops.__file__).read()))
    assert wrapped == set(defined_ops())
    assert cpu_build.available()
    for name in defined_ops():
        assert hasattr(torch.ops.radixserve_cpu, name), name


def test_the_kernels_block_layouts_are_the_loaders():
    assert cpu_build.available()
    flat = cpu_ops.quant_format_table()
    table = {flat[i]: tuple(flat[i + 1 : i + 4]) for i in range(0, len(flat), 4)}
    assert set(table) == {int(format) for format in WeightFormat}
    for format in WeightFormat:
        weights, block, extra = table[int(format)]
        if format in BLOCK_LAYOUTS:
            assert (weights, block) == BLOCK_LAYOUTS[format]
        for blocks in (1, 3):
            assert row_bytes(format, blocks * weights) == blocks * block + extra
