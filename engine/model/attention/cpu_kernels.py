"""The CPU decode-attention kernel (`csrc/decode_attention.cpp`), built on first use.

Why C++: the torch ops of the portable path gather every key of the batch into a new
tensor before two batched matmuls, and dispatch half a dozen ops per layer; at decode sizes
both cost more than the arithmetic. The kernel reads keys and values in place through each
request's slots, one task per request (or per KV head of it, when requests are few).

It is compiled with `torch.utils.cpp_extension` the first time a CPU attention backend is
made (about 10 s on two cores) into `<cache dir>/cpu_kernels/<key>`, keyed by the source,
the torch version and this CPU's instruction-set flags (it is built for the CPU at hand),
and loaded from there afterwards. Never at `pip install` time: pip's isolated build
environment would pull a CUDA torch. Without a compiler, or with
`RADIXSERVE_CPU_KERNELS=0`, attention stays on the torch ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from engine.model.tokenizer_cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
NAME = "radixserve_cpu_kernels"
DISABLE_ENV = "RADIXSERVE_CPU_KERNELS"
"""Set to 0 to keep CPU decode attention on torch ops."""


@functools.cache
def decode_attention_available() -> bool:
    """Load the kernel once per process, building it first if this machine has no build of
    it yet; False (logged once) if it cannot be had."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    library = cache_root() / "cpu_kernels" / _build_key() / f"{NAME}.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(library)
    except Exception as e:  # no compiler, no headers, an unwritable cache: keep torch ops
        logger.warning("CPU decode-attention kernel unavailable, using torch ops: %s", e)
        return False
    return True


def _build(library: Path) -> None:
    """Compile into a directory of this process's own and load it from there, then move the
    library into place: processes that build at once never share a lock (torch's build
    lock would outlive a process killed while holding it, and hang every later start)."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build_dir:
        cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            build_directory=build_dir,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        os.replace(Path(build_dir) / f"{NAME}.so", library)


def _build_key() -> str:
    """Source, torch version and the CPU's flags: a cache shared by different machines
    never hands one a kernel built for another's instructions."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next(
            (line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), ""
        )
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), flags.encode()):
        digest.update(part)
    return f"{platform.machine()}-{digest.hexdigest()[:16]}"


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`[n, heads, dim]` attention of one-token queries over the first `seq_lens[r]` slots
    of row r of `slots` (`[n, max_len]` int64), the pool buffers `[slots, kv_heads, dim]`."""
    out: torch.Tensor = torch.ops.radixserve_cpu.decode_attention(
        q, k_buffer, v_buffer, slots, seq_lens, scaling
    )
    return out
