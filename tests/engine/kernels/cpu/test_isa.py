"""The CPU kernel path: instruction sets read from a /proc/cpuinfo flags line, the highest
path they allow, RADIXSERVE_CPU_ISA lowering it (never raising it), and a lower path's build
and torch's own kernels holding none of the higher path's instructions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu.isa import (
    ISA_FLAGS,
    CpuIsa,
    choose,
    compile_flags,
    machine_path,
    parse_flags,
)
from testing.launcher import REPO_ROOT

ZEN3 = "flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 sha_ni"
"""An AMD EPYC of the AVX2 class: no AVX-512, no AMX."""
ZEN4 = ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx_vnni"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 avx512_fp16 amx_tile amx_int8"
OLD = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx"


def test_parse_flags_keeps_the_kernel_isas_in_their_order():
    assert parse_flags(ZEN3) == ("avx2", "fma", "f16c", "bmi2")
    assert parse_flags(SAPPHIRE_RAPIDS) == ISA_FLAGS  # every flag the paths look at
    assert parse_flags(OLD) == ()
    assert parse_flags("") == ()


@pytest.mark.parametrize(
    ("flags_line", "path"),
    [(OLD, "none"), (ZEN3, "avx2"), (ZEN4, "avx512"), (SAPPHIRE_RAPIDS, "amx")],
)
def test_each_cpu_runs_the_highest_path_it_has(flags_line: str, path: str):
    flags = parse_flags(flags_line)
    assert machine_path(flags) == path
    assert choose(flags, None) == CpuIsa(flags, path, forced=False)
    assert choose(flags, "") == CpuIsa(flags, path, forced=False)  # an empty variable: unset


def test_a_path_needs_every_lower_path_too():
    assert machine_path(("avx2", "fma", "bmi2")) == "none"  # no F16C: no AVX2 path
    # AMX tiles without the AVX-512 four are no AMX path (nor an AVX-512 one).
    assert machine_path(parse_flags(ZEN3 + " amx_tile amx_bf16")) == "avx2"
    assert machine_path(parse_flags(ZEN3 + " avx512f avx512bw avx512vl")) == "avx2"  # no DQ


@pytest.mark.parametrize("forced", ["avx2", "avx512", "amx"])
def test_forcing_a_path_at_or_below_the_machines_runs_it(forced: str):
    isa = choose(parse_flags(SAPPHIRE_RAPIDS), forced)
    assert isa.path == forced and isa.forced
    assert isa.describe().endswith(f"; kernel path {forced} (forced by RADIXSERVE_CPU_ISA)")


@pytest.mark.parametrize(
    ("flags_line", "forced", "has"),
    [
        (ZEN3, "avx512", "avx2"),
        (ZEN3, "amx", "avx2"),
        (ZEN4, "amx", "avx512"),
        (OLD, "avx2", "none"),
    ],
)
def test_forcing_a_path_above_the_machines_names_the_variable_and_what_the_cpu_has(
    flags_line: str, forced: str, has: str
):
    with pytest.raises(ValueError, match=f"RADIXSERVE_CPU_ISA={forced} .* path is {has} "):
        choose(parse_flags(flags_line), forced)


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_ISA='avx512bf16': expected one of"):
        choose(parse_flags(SAPPHIRE_RAPIDS), "avx512bf16")


def test_an_avx2_build_names_no_avx512_instruction_and_no_path_builds_native():
    flags = parse_flags(SAPPHIRE_RAPIDS)
    avx2 = compile_flags("avx2", flags)
    assert avx2 == ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
    assert not any("512" in flag or "native" in flag or "vnni" in flag for flag in avx2)
    avx512 = compile_flags("avx512", flags)
    assert avx512[:4] == avx2 and "-march=native" not in avx512
    assert {"-mavx512bw", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mavxvnni"} <= set(avx512)
    assert not any("amx" in flag for flag in avx512)
    # The optional sets only where the CPU has them.
    plain_avx512 = parse_flags(ZEN3 + " avx512f avx512bw avx512vl avx512dq")
    assert compile_flags("avx512", plain_avx512) == [
        *avx2,
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
    ]
    assert compile_flags("amx", flags) == [*avx512, "-mamx-tile", "-mamx-bf16", "-mamx-int8"]
    assert compile_flags("none", flags) == []
    with pytest.raises(ValueError, match="unknown kernel path"):
        compile_flags("sse", flags)


def test_forcing_lower_caps_onednn_below_what_the_cpu_has():
    flags = parse_flags(SAPPHIRE_RAPIDS)
    assert cpu_isa.onednn_max_isa(choose(flags, "avx2")) == "AVX2"
    assert cpu_isa.onednn_max_isa(choose(flags, "avx512")) == "AVX512_CORE_BF16"  # no AMX
    plain = parse_flags(ZEN3 + " avx512f avx512bw avx512vl avx512dq")
    assert cpu_isa.onednn_max_isa(choose(plain, "avx512")) == "AVX512_CORE"
    assert cpu_isa.onednn_max_isa(choose(flags, "amx")) is None
    assert cpu_isa.onednn_max_isa(choose(flags, None)) is None  # unforced: nothing capped


def _in_fresh_process(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RADIXSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(cpu_isa.cpu_isa().path == "none", reason="this CPU has no AVX2 path")
def test_forcing_avx2_lowers_torchs_own_kernels_when_applied_before_torch_runs():
    result = _in_fresh_process(
        "from engine.kernels.cpu.isa import apply_forced_isa\n"
        "print(apply_forced_isa().describe())\n"
        "import torch\n"
        "print(torch.backends.cpu.get_cpu_capability())\n",
        RADIXSERVE_CPU_ISA="avx2",
    )
    assert result.returncode == 0, result.stderr
    described, capability = result.stdout.splitlines()
    assert described.endswith("kernel path avx2 (forced by RADIXSERVE_CPU_ISA)")
    assert capability == "AVX2"


def test_serve_refuses_a_path_above_the_machines_before_starting_anything():
    machine = cpu_isa.machine_path(cpu_isa.read_flags())  # not a forced path: the CPU's
    above = {"none": "avx2", "avx2": "avx512", "avx512": "amx"}.get(machine)
    if above is None:
        pytest.skip("this CPU has the highest path")
    result = _in_fresh_process(
        "from services.launch import main; main(['serve'])", RADIXSERVE_CPU_ISA=above
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"radixserve serve: error: RADIXSERVE_CPU_ISA={above} asks")
