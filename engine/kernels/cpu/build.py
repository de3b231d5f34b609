"""Build and load the CPU kernel library (`csrc/`), once per machine and kernel path.

The library is compiled with `torch.utils.cpp_extension` the first time a kernel is needed
(a CPU attention backend, a bf16 layer), the one long step of a first start
(docs/benchmarks/model.md, "What a first start pays once"), into
`<cache dir>/cpu_kernels/<machine>-<path>-<digest>` (`engine/paths.py`), for the kernel path
`isa` chose (the machine's highest, or a lower one forced by RADIXSERVE_CPU_ISA) with that
path's compiler flags only (an avx2 build holds no AVX-512 instruction, whichever CPU builds
it), keyed by the path, its flags, the sources, the torch version and this CPU's
instruction-set flags, and loaded from there afterwards. The sources are every `.cpp` under
`csrc/` (none is listed by hand). Never at `pip install` time: pip's isolated build
environment would pull a CUDA torch. Without a compiler, or with `RADIXSERVE_CPU_KERNELS=0`,
every layer stays on torch ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from engine.kernels.cpu import isa
from engine.paths import cpu_kernels_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
NAME = "radixserve_cpu_kernels"
DISABLE_ENV = "RADIXSERVE_CPU_KERNELS"
"""Set to 0 to keep the CPU layers on torch ops."""


def sources() -> list[Path]:
    """Every translation unit of the library, generic and per-architecture, in a fixed order."""
    return sorted(CSRC.rglob("*.cpp"))


def headers() -> list[Path]:
    """Every header the sources may include (part of the build key)."""
    return sorted(CSRC.rglob("*.h"))


@functools.cache
def available() -> bool:
    """Load the kernels once per process, building them first if this machine has no build
    of them yet; False (logged once) if they cannot be had."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    library = cpu_kernels_dir() / _build_key() / f"{NAME}.so"
    started = time.perf_counter()
    try:
        if library.exists():
            torch.ops.load_library(str(library))
            done = "loaded (built for this CPU before)"
        else:
            # The one long silent step of a first start: say so before it begins.
            logger.info(
                "CPU kernels: compiling for this CPU (first start on this CPU, about a minute; "
                "kept in %s)",
                library.parent,
            )
            _build(library)
            done = "compiled"
    except Exception as e:  # no compiler, no headers, an unwritable cache: keep torch ops
        logger.warning("CPU kernels unavailable, using torch ops: %s", e)
        return False
    logger.info("CPU kernels: %s in %.1f s", done, time.perf_counter() - started)
    return True


def enabled() -> bool:
    """The kernels are loaded and the caller runs eagerly: under `torch.compile` the layer
    steps stay torch ops, which inductor fuses itself."""
    return not torch.compiler.is_compiling() and available()  # dynamo never traces available


def _build(library: Path) -> None:
    """Compile into a directory of this process's own and load it from there, then move the
    library into place: processes that build at once never share a lock (torch's build
    lock would outlive a process killed while holding it, and hang every later start).
    Built for `isa`'s path: its `csrc/` code paths are chosen by the macros those flags
    define (`__AVX2__`, `RADIXSERVE_AVX512`, `RADIXSERVE_AMX`)."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build_dir:
        cpp_extension.load(
            name=NAME,
            sources=[str(source) for source in sources()],
            build_directory=build_dir,
            extra_include_paths=[str(CSRC)],
            # No fused multiply-adds where the source has a product and a sum: the kernels
            # that mirror torch's ops round as those ops do (explicit FMA intrinsics stay).
            extra_cflags=[
                "-O3",
                *isa.compile_flags(isa.cpu_isa().path),
                "-fopenmp",
                "-ffp-contract=off",
            ],
            is_python_module=False,
            verbose=False,
        )
        os.replace(Path(build_dir) / f"{NAME}.so", library)


def _build_key() -> str:
    """The kernel path, then a digest of its compiler flags, the sources, headers, torch version
    and the CPU's flags: each path's build is kept apart, and a cache shared by different
    machines never hands one a kernel built for another's instructions."""
    path = isa.cpu_isa().path
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next(
            (line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), ""
        )
    digest = hashlib.sha256()
    for source in (*sources(), *headers()):
        digest.update(str(source.relative_to(CSRC)).encode())
        digest.update(source.read_bytes())
    for part in (
        torch.__version__.encode(),
        " ".join(isa.compile_flags(path)).encode(),
        flags.encode(),
    ):
        digest.update(part)
    return f"{platform.machine()}-{path}-{digest.hexdigest()[:16]}"
