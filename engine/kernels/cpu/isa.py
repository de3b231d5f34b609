"""Which CPU kernel path this machine runs: its instruction sets, and the path chosen.

The C++ kernels (`build`, `csrc/`) have one code path per instruction-set class, lowest
first: "none" (plain C++ loops; torch ops where there is no kernel), "avx2" (AVX2 + FMA +
F16C, and BMI2, which every AVX2 CPU has), "avx512" (those and AVX-512 F/BW/VL/DQ, with
AVX512-BF16 and the VNNI sets where present) and "amx" (those and AMX tiles with bf16). A
machine runs the highest path its CPU has, read from /proc/cpuinfo (x86 Linux; elsewhere no
flags and the "none" path).

`RADIXSERVE_CPU_ISA=avx2|avx512|amx` forces a path no higher than the machine's, so that a
developer on an AMX machine measures what AVX2 users get. Forcing lowers the kernels' build
(`compile_flags`: an avx2 build holds no AVX-512 instruction) and, through
`apply_forced_isa`, PyTorch's and oneDNN's own kernels (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`). Both libraries read those variables once, at their first dispatch: a
process that has already imported and used torch cannot lower ATen's ISA, so the
`radixserve` command applies them first thing, and its child processes inherit them.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

FORCE_ENV = "RADIXSERVE_CPU_ISA"
"""avx2, avx512 or amx: run that kernel path, which must be no higher than the machine's."""

ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
"""The /proc/cpuinfo flags the kernel paths depend on, in the order they are reported."""

PATHS = ("none", "avx2", "avx512", "amx")
"""Kernel paths, lowest first; each needs its own flags and all of the paths below it."""
PATH_FLAGS = {
    "none": (),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "amx": ("amx_tile", "amx_bf16"),
}
FORCEABLE = PATHS[1:]

AVX2_CFLAGS = ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
AVX512_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
AMX_CFLAGS = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
OPTIONAL_AVX512_CFLAGS = {"avx512_bf16": "-mavx512bf16", "avx512_vnni": "-mavx512vnni"}
"""Added to an avx512 build where the CPU has them (and `-mavxvnni` with avx_vnni)."""

ATEN_CAPABILITY = {"avx2": "avx2", "avx512": "avx512"}
"""ATen's kernel set for a forced path (amx: ATen's highest, avx512, stays as detected)."""


@dataclass(frozen=True)
class CpuIsa:
    """The instruction sets found (names as /proc/cpuinfo spells them, `ISA_FLAGS` order) and
    the kernel path run."""

    flags: tuple[str, ...]
    path: str
    forced: bool = False
    """The path was set by RADIXSERVE_CPU_ISA rather than taken as the machine's highest."""

    def describe(self) -> str:
        """One line for the start-up log: `avx2 fma ...; kernel path avx2 (forced by ...)`."""
        forced = f" (forced by {FORCE_ENV})" if self.forced else ""
        return f"{' '.join(self.flags) or 'none'}; kernel path {self.path}{forced}"


def parse_flags(flags_line: str) -> tuple[str, ...]:
    """The `ISA_FLAGS` present in a /proc/cpuinfo `flags` line (or any whitespace-separated
    list of flag names)."""
    present = set(flags_line.removeprefix("flags").lstrip(" \t:").split())
    return tuple(name for name in ISA_FLAGS if name in present)


def machine_path(flags: Iterable[str]) -> str:
    """The highest kernel path whose flags, and those of every path below it, are all in
    `flags`."""
    present = set(flags)
    best = "none"
    for path in PATHS[1:]:
        if not present.issuperset(PATH_FLAGS[path]):
            break
        best = path
    return best


def choose(flags: tuple[str, ...], forced: str | None) -> CpuIsa:
    """The machine's highest path, or `forced` (RADIXSERVE_CPU_ISA's value) where set; a
    ValueError for an unknown path or one above what the machine has."""
    highest = machine_path(flags)
    if not forced:
        return CpuIsa(flags, highest)
    if forced not in FORCEABLE:
        raise ValueError(f"{FORCE_ENV}={forced!r}: expected one of {', '.join(FORCEABLE)}")
    if PATHS.index(forced) > PATHS.index(highest):
        fix = f"set it to {highest} or lower" if highest != "none" else "unset it"
        raise ValueError(
            f"{FORCE_ENV}={forced} asks for more than this CPU has: its highest kernel path is "
            f"{highest} (flags: {' '.join(flags) or 'none'}); {fix}"
        )
    return CpuIsa(flags, forced, forced=True)


def read_flags() -> tuple[str, ...]:
    """This CPU's `ISA_FLAGS` from /proc/cpuinfo; none off x86 Linux."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpuinfo.exists():
        return ()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return parse_flags(line)
    return ()


@functools.cache
def cpu_isa() -> CpuIsa:
    """This machine's flags and kernel path (RADIXSERVE_CPU_ISA applied), read once."""
    return choose(read_flags(), os.environ.get(FORCE_ENV))


def compile_flags(path: str, flags: Iterable[str] | None = None) -> list[str]:
    """The gcc flags of the kernels' build for `path` on a CPU with `flags` (this one's when
    None). Every path's instruction sets are named one by one, never -march=native: an avx2
    build must hold no AVX-512 instruction, whatever CPU builds it, and a build's arithmetic
    must not follow the building CPU's tuning: two CPUs of one path build the same code
    (what --enable-deterministic-inference's "same build, same path" rests on), and the
    one-op layer stays within float32 rounding of the modules (-march=native's -mtune moved
    their float32 logits apart by 1e-4 on a Sapphire Rapids-class Xeon; the tuning was worth
    3-6% of a decode step there, docs/benchmarks/cpu-paths.md)."""
    present = set(cpu_isa().flags if flags is None else flags)
    if path in ("amx", "avx512"):
        optional = [cflag for flag, cflag in OPTIONAL_AVX512_CFLAGS.items() if flag in present]
        vnni = ["-mavxvnni"] if "avx_vnni" in present else []
        amx = AMX_CFLAGS if path == "amx" else []
        return [*AVX2_CFLAGS, *AVX512_CFLAGS, *optional, *vnni, *amx]
    if path == "avx2":
        return list(AVX2_CFLAGS)
    if path == "none":
        return []
    raise ValueError(f"unknown kernel path {path!r}: expected one of {', '.join(PATHS)}")


def onednn_max_isa(isa: CpuIsa) -> str | None:
    """oneDNN's ISA cap (`ONEDNN_MAX_CPU_ISA`) for a forced path: the highest oneDNN ISA the
    path's instructions cover on this CPU; None where nothing is capped (amx, or unforced)."""
    if not isa.forced or isa.path == "amx":
        return None
    if isa.path == "avx2":
        return "AVX2"
    if "avx512_bf16" in isa.flags:
        return "AVX512_CORE_BF16"
    if "avx512_vnni" in isa.flags:
        return "AVX512_CORE_VNNI"
    return "AVX512_CORE"


def apply_forced_isa() -> CpuIsa:
    """Check RADIXSERVE_CPU_ISA (a ValueError if it asks for too much) and, for a forced lower
    path, cap PyTorch's and oneDNN's kernels to it in this process's environment (a variable
    already set is left as it is). Call before torch's first dispatch: ATen and oneDNN fix
    their ISA then, so in a process that has already used torch only the radixserve kernels
    are lowered. Processes started afterwards inherit the caps."""
    isa = cpu_isa()
    if isa.forced and isa.path in ATEN_CAPABILITY:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN_CAPABILITY[isa.path])
    onednn = onednn_max_isa(isa)
    if onednn is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
    return isa
