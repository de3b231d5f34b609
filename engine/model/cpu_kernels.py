"""The CPU kernels of the decode step (`csrc/`), built on first use.

Why C++: at decode sizes a step's cost on CPU is per-op dispatch and memory traffic, not
arithmetic.
- `decode_attention` (`csrc/decode_attention.cpp`): the torch ops of the portable path
  gather every key of the batch into a new tensor before two batched matmuls; the kernel
  reads keys and values in place through each request's slots, one task per request (or
  per KV head of it, when requests are few).
- `extend_attention` (`csrc/extend_attention.cpp`): the prefill attention of a bf16 batch's
  multi-token requests in one call, the products on AMX tiles, where SDPA takes them at float
  speed, one call per request over keys gathered first.
- `rms_norm` (`csrc/norm.cpp`): the residual add and RMSNorm of 16-bit activations in one
  op, where torch dispatches about eight.
- `rotary` (`csrc/rotary.cpp`) and `silu_and_mul` (`csrc/activation.cpp`): a layer's
  rotary embedding and gated activation in one op each, where torch dispatches three or
  four.
- `linear_amx` and `linear_few_rows` (`csrc/linear.cpp`): bf16 matmuls on AMX tiles over a
  weight packed once for them (`amx_pack`), and by dot products over the plain weight for
  the one or two rows (`FEW_ROWS`) of the smallest decode batches. oneDNN's packed kernels
  pay a fixed cost per call and read small weights well below the bandwidth
  (docs/benchmarks/model.md).
- `quant_linear` (`csrc/quant_linear.cpp`): matmuls over weights kept quantized (GGUF's
  Q4_0/Q4_1/Q8_0 blocks, int8 rows), widened in registers for decode rows and per band
  for a prefill's GEMM: a decode step reads 4.5-8.5 bits a weight instead of 16.
- `linear_rows` (`csrc/linear_rows.cpp`): the matmul of plain weights under
  `--enable-deterministic-inference`, each row summed in one order at any row count (with
  `quant_linear`'s `batch_invariant` for quantized ones, and `decode_attention` over every
  token of a prefill): a library GEMM's order changes with the number of rows.
- `decode_layer` (`csrc/decode_layer.cpp`): a whole Llama layer of a decode batch, the
  kernels above called from C++ in the modules' order: one Python dispatch per layer where
  the modules make about fifteen, whose Python and dispatch were a large share of a small
  batch's step on two cores (docs/benchmarks/model.md, "One op per decode layer").

They are compiled with `torch.utils.cpp_extension` the first time one is needed (a CPU
attention backend, a bf16 layer), the one long step of a first start (docs/benchmarks/model.md,
"What a first start pays once"), into `<cache dir>/cpu_kernels/<machine>-<path>-<digest>`
(`engine/paths.py`), for the kernel path `cpu_isa` chose (the machine's highest, or a lower
one forced by RADIXSERVE_CPU_ISA) with that path's compiler flags only (an avx2 build holds
no AVX-512 instruction, whichever CPU builds it), keyed by the path, its flags, the sources,
the torch version and this CPU's instruction-set flags, and loaded from there afterwards.
Never at `pip install` time: pip's isolated build environment would pull a CUDA torch.
Without a compiler, or with `RADIXSERVE_CPU_KERNELS=0`, every one of these steps stays on
torch ops.
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

from engine.model import cpu_isa
from engine.paths import cpu_kernels_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / name
    for name in (
        "decode_attention.cpp",
        "extend_attention.cpp",
        "norm.cpp",
        "linear.cpp",
        "rotary.cpp",
        "activation.cpp",
        "decode_layer.cpp",
        "quant_linear.cpp",
        "linear_rows.cpp",
    )
]
HEADERS = [CSRC / "vec16.h", CSRC / "simd.h", CSRC / "amx.h", CSRC / "parallel.h"]
NAME = "radixserve_cpu_kernels"
DISABLE_ENV = "RADIXSERVE_CPU_KERNELS"
"""Set to 0 to keep the CPU decode step on torch ops."""

FEW_ROWS = 2
"""Up to this many rows `linear_few_rows` beats both oneDNN's packed bf16 matmul and the AMX
kernel on the CPUs measured (docs/benchmarks/model.md)."""


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
    Built for `cpu_isa`'s path: its `csrc/` code paths are chosen by the macros those flags
    define (`__AVX2__`, `RADIXSERVE_AVX512`, `RADIXSERVE_AMX`)."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as build_dir:
        cpp_extension.load(
            name=NAME,
            sources=[str(source) for source in SOURCES],
            build_directory=build_dir,
            # No fused multiply-adds where the source has a product and a sum: the kernels
            # that mirror torch's ops round as those ops do (explicit FMA intrinsics stay).
            extra_cflags=[
                "-O3",
                *cpu_isa.compile_flags(cpu_isa.cpu_isa().path),
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
    path = cpu_isa.cpu_isa().path
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next(
            (line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), ""
        )
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        torch.__version__.encode(),
        " ".join(cpu_isa.compile_flags(path)).encode(),
        flags.encode(),
    ):
        digest.update(part)
    return f"{platform.machine()}-{path}-{digest.hexdigest()[:16]}"


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    slot_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[n, heads, dim]` attention of one-token queries over the first `seq_lens[r]` slots
    of row r of `slots` (`[n, max_len]` int64), the pool buffers `[slots, kv_heads, dim]`;
    with `slot_index` (`[n]` int64), query r reads row `slot_index[r]` of `slots` instead,
    so that the tokens of one request share its row."""
    out: torch.Tensor = torch.ops.radixserve_cpu.decode_attention(
        q, k_buffer, v_buffer, slots, seq_lens, scaling, slot_index
    )
    return out


@functools.cache
def extend_attention_available() -> bool:
    """The kernels are loaded and `extend_attention` may use AMX here."""
    return available() and bool(torch.ops.radixserve_cpu.extend_attention_supported())


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of bf16 multi-token requests `[T, heads, head_dim]` (head_dim a
    multiple of 64): request r's `extend_lens[r]` queries start at row `q_starts[r]` of `q`
    and see the first `prefix_lens[r] + i + 1` of its `slots[r]` (int64 `[n, max_len]`: its
    prefix, then its new tokens). Rows of `q` outside every request come back zero."""
    out: torch.Tensor = torch.ops.radixserve_cpu.extend_attention(
        q, k_buffer, v_buffer, slots, prefix_lens, extend_lens, q_starts, scaling
    )
    return out


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`RMSNorm` of bf16/half `[T, hidden]` rows, `residual += x` first (in place) when given:
    float32 inside, rounded where transformers rounds (normalised, then times the weight)."""
    out: torch.Tensor = torch.ops.radixserve_cpu.rms_norm(x, residual, weight, eps)
    return out


def rotary(qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate `qk` `[T, heads, head_dim]` (float32, bf16 or half; whole heads side by side in
    each row) in place by `cos_sin` `[T, 2, 1, head_dim]` (`RotaryEmbedding.cos_sin`),
    bit for bit as the torch ops of `RotaryEmbedding.forward`."""
    torch.ops.radixserve_cpu.rotary(qk, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of bf16/half `x` `[T, 2 * d]` (gate, then up), rounded where torch's
    `F.silu(gate).mul_(up)` rounds."""
    out: torch.Tensor = torch.ops.radixserve_cpu.silu_and_mul(x)
    return out


@functools.cache
def amx_available() -> bool:
    """The kernels are loaded, were built with AMX, and the kernel may use it here."""
    return available() and bool(torch.ops.radixserve_cpu.amx_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` `[N, K]` bf16 as `linear_amx` reads it (N padded to a multiple of 64 and K to
    one of 32), where that applies (else None)."""
    if not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and amx_available()):
        return None
    packed: torch.Tensor = torch.ops.radixserve_cpu.amx_pack(weight.detach())
    return packed


def is_amx_packed(packed: torch.Tensor) -> bool:
    """Whether `packed` came from `amx_pack` (6-D) rather than from oneDNN (2-D)."""
    return packed.dim() == 6


def linear_amx(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias` for bf16 `x` `[rows, K]` over `amx_pack(weight)` (`weight`
    `[out_features, K]`): float32 sums, the bias added before the one rounding."""
    out: torch.Tensor = torch.ops.radixserve_cpu.linear_amx(x, packed, out_features, bias)
    return out


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for bf16 `x` `[rows, in]` (rows up to `FEW_ROWS`), float32 sums."""
    out: torch.Tensor = torch.ops.radixserve_cpu.linear_few_rows(x, weight)
    return out


def decode_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weights: list[torch.Tensor],
    cos_sin: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_index: torch.Tensor | None,
    batch_invariant: bool,
    num_heads: int,
    num_kv_heads: int,
    scaling: float,
    eps: float,
    formats: list[int],
    activation_bits: int,
) -> torch.Tensor:
    """One Llama layer of a decode batch (`LlamaDecoderLayer.decode_weights` lists its
    weights and the projections' `formats`), bf16 or, over quantized projections, float32:
    the MLP output; the attention output is added to the residual stream in place (to
    `hidden` itself when `residual` is None), the new K/V written at `out_cache_loc`."""
    out: torch.Tensor = torch.ops.radixserve_cpu.decode_layer(
        hidden,
        residual,
        weights,
        cos_sin,
        k_buffer,
        v_buffer,
        out_cache_loc,
        slots,
        seq_lens,
        slot_index,
        num_heads,
        num_kv_heads,
        scaling,
        eps,
        formats,
        activation_bits,
        FEW_ROWS,
        batch_invariant,
    )
    return out


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    format: int,
    bias: torch.Tensor | None = None,
    activation_bits: int = 32,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """`x @ W^T + bias` for float/bf16/half `x` `[rows, K]` over `weight` held quantized
    (`engine/model/layers/quantization.py`: uint8 rows of `format`), in `x`'s dtype; decode
    rows rounded to `activation_bits` (16 or 8) per block of 32 first, or kept float (32).
    `batch_invariant` (float activations only): every row summed in one order at any row
    count."""
    out: torch.Tensor = torch.ops.radixserve_cpu.quant_linear(
        x, weight, format, bias, activation_bits, batch_invariant
    )
    return out


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[rows, K]` over a plain float/bf16/half `weight`, in `x`'s
    dtype, each row summed in one order at any row count (`csrc/linear_rows.cpp`)."""
    out: torch.Tensor = torch.ops.radixserve_cpu.linear_rows(x, weight, bias)
    return out


def quant_dequantize(weight: torch.Tensor, format: int, in_features: int) -> torch.Tensor:
    """The float32 `[N, in_features]` weights of quantized rows `weight`."""
    out: torch.Tensor = torch.ops.radixserve_cpu.quant_dequantize(weight, format, in_features)
    return out
