"""The CPU layer kernels (`engine/kernels/cpu/csrc/`) against float64 and against the torch ops
they replace: the AMX and few-rows bf16 matmuls, the fused residual add + RMSNorm, the
rotary embedding and the gated activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.linear import Linear, linear

BF16_ROUNDING = 2.0**-8
"""bf16 keeps 8 significant bits: a correctly rounded result is within 2^-9 of the value."""


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    assert cpu_build.available(), "the suite's machines have a compiler"


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (1, 960, 576),  # a fused qkv projection of the embedded model
        (4, 577, 100),  # bands of output rows that are not multiples of 4; a K tail
        (3, 5, 33),  # fewer outputs than one tile
        (2, 130, 1536),
        (7, 64, 64),  # past one block of four rows
    ],
)
def test_linear_few_rows_matches_float64(rows: int, out_features: int, in_features: int):
    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    expected = x.double() @ weight.double().T
    out = cpu_ops.linear_few_rows(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected, rtol=BF16_ROUNDING, atol=1e-3)


amx = pytest.mark.skipif(
    not cpu_ops.amx_available(), reason="this CPU (or kernel build) has no AMX"
)


@amx
# Whole and partial 16-row tiles; from 64 rows pairs of them, then a single one (50: a pair
# whose second tile is the partial one).
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 50, 64, 70, 100])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [
        (960, 576),  # a fused qkv projection of the embedded model
        (64, 32),  # one band, one tile step
        (128, 1536),
        (40, 576),  # a LoRA A: N padded to one band
        (576, 40),  # a LoRA B: K padded to a tile step
        (100, 33),  # both, past whole tiles
    ],
)
def test_linear_amx_matches_float64(rows: int, out_features: int, in_features: int):
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    packed = cpu_ops.amx_pack(weight)
    assert packed is not None and cpu_ops.is_amx_packed(packed)
    out = cpu_ops.linear_amx(x, packed, out_features)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(
        out.double(), x.double() @ weight.double().T, rtol=BF16_ROUNDING, atol=1e-3
    )


@amx
def test_amx_pads_to_whole_tiles_and_packs_only_bf16():
    packed = cpu_ops.amx_pack(torch.randn(96, 48).bfloat16())
    assert packed is not None and packed.shape == (2, 2, 4, 16, 16, 2)  # 128 x 64 of zeros
    assert cpu_ops.amx_pack(torch.randn(64, 64)) is None  # float32


@amx
@pytest.mark.parametrize("rows", [3, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_layer_runs_on_its_amx_copy(rows: int, bias: bool, monkeypatch):
    layer = Linear(64, 100, bias=bias)  # 100 outputs: the bias of a partial band too
    gen = torch.Generator().manual_seed(rows)
    layer.weight.data = torch.randn(100, 64, generator=gen).bfloat16()
    if bias:
        layer.bias.data = torch.randn(100, generator=gen).bfloat16()
    layer.pack_weight()
    assert layer.packed_weight is not None and cpu_ops.is_amx_packed(layer.packed_weight)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    calls: list[int] = []
    kernel = cpu_ops.linear_amx
    monkeypatch.setattr(
        cpu_ops, "linear_amx", lambda x, p, n, b: calls.append(len(x)) or kernel(x, p, n, b)
    )
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [rows]


def test_linear_takes_the_kernel_for_few_bf16_rows_only(monkeypatch):
    """A decode batch of up to FEW_ROWS rows goes through the kernel; larger batches, a
    bias and other dtypes do not."""
    calls: list[int] = []
    kernel = cpu_ops.linear_few_rows
    monkeypatch.setattr(
        cpu_ops, "linear_few_rows", lambda x, w: calls.append(len(x)) or kernel(x, w)
    )
    weight = torch.randn(48, 32).bfloat16()
    for rows in (1, cpu_ops.FEW_ROWS, cpu_ops.FEW_ROWS + 1):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(
            linear(x, weight, None), F.linear(x, weight), rtol=BF16_ROUNDING, atol=1e-3
        )
    linear(torch.randn(1, 32).bfloat16(), weight, None, torch.zeros(48).bfloat16())
    linear(torch.randn(1, 32), weight.float(), None)
    assert calls == [1, cpu_ops.FEW_ROWS]


def torch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if residual is not None:
        x = residual.add_(x)
    return F.rms_norm(x, weight.shape, eps=eps).mul_(weight)


# float32's unit in the last place, bf16's and half's
UNIT = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: more rows than one thread's share
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_the_torch_ops(dtype: torch.dtype, rows: int, with_residual: bool):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(576, generator=gen).to(dtype)
    theirs_residual = None if residual is None else residual.clone()
    expected = torch_rms_norm(x.clone(), theirs_residual, weight, 1e-5)
    out = cpu_ops.rms_norm(x, residual, weight, 1e-5)
    if residual is not None:  # the sum is written in place, rounded as torch's add rounds
        assert torch.equal(residual, theirs_residual)
    # Only the order of the float sum of squares differs: the normalised value may round one
    # unit apart, and its product with the weight another. In float32 nothing rounds the
    # inverse root's last bits away: four units.
    units = expected.float().abs() * UNIT[dtype] * (4 if dtype == torch.float32 else 2)
    assert ((out.float() - expected.float()).abs() <= units).all()
    if dtype != torch.float32:  # float32 keeps the sums' different last bits
        assert (out == expected).float().mean() > 0.99


def torch_rotary(qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """`RotaryEmbedding.forward`'s torch ops."""
    cos, sin = cos_sin.unbind(1)
    rotated = torch.roll(qk, qk.shape[-1] // 2, dims=-1).mul_(sin)
    qk.mul_(cos).add_(rotated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 16: a half of 8 lanes; 48: one whole 16-lane step and a partial one
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
@pytest.mark.parametrize("tokens", [1, 5, 70])  # 70: more tokens than one thread's share
def test_rotary_equals_the_torch_ops_bit_for_bit(dtype: torch.dtype, head_dim: int, tokens: int):
    from engine.model.layers.rotary_embedding import RotaryEmbedding

    gen = torch.Generator().manual_seed(head_dim + tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    cos_sin = rope.cos_sin(torch.randint(4096, (tokens,), generator=gen), dtype)
    # q's 6 heads and k's 2 in the fused qkv row, v's 2 after them (left alone)
    qkv = (torch.randn(tokens, 10, head_dim, generator=gen) * 4).to(dtype)
    expected = qkv.clone()
    torch_rotary(expected[:, :8], cos_sin)
    cpu_ops.rotary(qkv[:, :8], cos_sin)
    assert torch.equal(qkv, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 24, 80: partial vectors of 8 and 16 lanes
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (5, 24), (40, 80)])
def test_silu_and_mul_matches_the_torch_ops(dtype: torch.dtype, rows: int, width: int):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, 2 * width, generator=gen) * 6).to(dtype)
    # exp(-x) overflowing (torch: -0), saturating, signed zeros, infinities and NaN
    inf, nan = float("inf"), float("nan")
    x[0, :9] = torch.tensor([-100.0, -88.0, 30.0, 0.0, -0.0, inf, -inf, 1.0, nan])
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    out = cpu_ops.silu_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    # The sigmoid's exp and reciprocal are within two float units of torch's: a value may
    # round one unit apart. Below -87 the kernel gives -0 where torch's value is under 1e-35.
    # In float32 nothing rounds that away, and the exp's range reduction (x log2 e, rounded)
    # loses up to about 8 units where x is near -12: 16 units are allowed.
    unit = UNIT[dtype] * (16 if dtype == torch.float32 else 1)
    close = (out.float() - expected.float()).abs() <= expected.float().abs() * unit + 1e-35
    same = (out == expected) | (out.isnan() & expected.isnan())
    assert (close | same).all()
    if dtype != torch.float32:
        assert same.float().mean() > 0.99
    assert torch.equal(out[0, :6].float().signbit(), expected[0, :6].float().signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 2048), (5, 24), (40, 80)])
def test_gelu_tanh_and_mul_matches_the_torch_ops(dtype: torch.dtype, rows: int, width: int):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    inf, nan = float("inf"), float("nan")
    x[0, :9] = torch.tensor([-100.0, -9.0, 30.0, 0.0, -0.0, inf, -inf, 1.0, nan])
    gate, up = x.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh").mul_(up)
    g64 = gate.double()  # the same function as x * sigmoid(2y), in float64 without cancelling
    exact = g64 * torch.sigmoid(2 * 0.7978845608028654 * (g64 + 0.044715 * g64**3)) * up.double()
    out = cpu_ops.gelu_tanh_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    same = (out == expected) | (out.isnan() & expected.isnan())
    # The kernel takes x * sigmoid(2y) where torch adds 1 + tanh(y), which cancels for
    # negative x: the kernel is never further from the exact value than torch's own error
    # and a few float32 units (the exp, the reciprocal), or in 16 bits its two roundings
    # (subnormal ones in float16).
    ours, torchs = (out.double() - exact).abs(), (expected.double() - exact).abs()
    units = 16 * UNIT[torch.float32] if dtype == torch.float32 else 2 * UNIT[dtype]
    subnormal = 2 * UNIT[dtype] * torch.finfo(dtype).smallest_normal
    assert ((ours <= torchs + exact.abs() * units + subnormal) | same).all()


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_each_task_runs_once_whatever_the_thread_count(restore_threads):
    """The kernels hand their tasks out in claimed chunks (`csrc/parallel.h`): with one
    thread, two, or more threads than cores, every output element is computed, once, the
    same way (outputs start as uninitialised memory, so a chunk left out shows)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=gen).bfloat16()
    # 203 bands of 64 outputs, 13 few-rows blocks of 64 (neither a multiple of the chunk)
    weight = torch.randn(203 * 64 - 5, 64, generator=gen).bfloat16()
    few_weight = weight[: 13 * 64 - 7]
    packed = cpu_ops.amx_pack(weight) if cpu_ops.amx_available() else None
    k_buffer, v_buffer = (torch.randn(400, 2, 64, generator=gen).bfloat16() for _ in range(2))
    slots = torch.randperm(400, generator=gen)[: 5 * 70].view(5, 70)
    seq_lens = torch.tensor([70, 1, 33, 64, 17])
    q = torch.randn(5, 6, 64, generator=gen).bfloat16()

    def run() -> list[torch.Tensor]:
        outs = [
            cpu_ops.linear_few_rows(x[:2], few_weight),
            cpu_ops.decode_attention(q, k_buffer, v_buffer, slots, seq_lens, 0.125),
        ]
        if packed is not None:
            outs.append(cpu_ops.linear_amx(x, packed, weight.shape[0]))
        return outs

    torch.set_num_threads(1)
    expected = run()
    torch.testing.assert_close(
        expected[0].double(), x[:2].double() @ few_weight.double().T, rtol=BF16_ROUNDING, atol=1e-3
    )
    for threads in (2, 3):
        torch.set_num_threads(threads)
        for out, reference in zip(run(), expected, strict=True):
            assert torch.equal(out, reference), f"{threads} threads"
