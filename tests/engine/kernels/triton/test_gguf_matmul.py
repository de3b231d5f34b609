"""The GGUF block matmul and row lookup on CUDA (engine/kernels/triton/gguf_matmul.py)
against gguf-py's dequantizer on the same bytes, for every format the CPU kernels serve,
and the layers that reach them. Without CUDA they run under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports Triton), on small
shapes; the interpreter's bf16 tl.dot is wrong, so bf16 runs on CUDA only."""

from __future__ import annotations

import gguf
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels import custom_op
from engine.kernels.triton import gguf_matmul
from engine.model.layers.embedding import VocabParallelEmbedding
from engine.model.layers.linear import Linear
from engine.model.layers.quantization import WeightFormat, hold_blocks
from testing.quant import cases, quantized, random_blocks, random_weight

INTERPRETED = isinstance(gguf_matmul._gguf_matmul_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not (INTERPRETED or torch.cuda.is_available()), reason="Triton needs CUDA or the interpreter"
)
GGUF_FORMATS = [f for f in WeightFormat if f is not WeightFormat.INT8]
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers take their Triton branch, here on CPU tensors under the interpreter."""
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: True)


def format_name(value: object) -> str | None:
    """Test ids that name the format (pytest's own for the other values)."""
    return value.name if isinstance(value, WeightFormat) else None


def gguf_cases(shapes: list[tuple[int, int]]) -> list[tuple[WeightFormat, int, int]]:
    return [case for case in cases(shapes) if case[0] is not WeightFormat.INT8]


def dequantized(format: WeightFormat, rows: torch.Tensor) -> torch.Tensor:
    """gguf-py's float32 weights of `rows`, the reference."""
    kind = gguf.GGMLQuantizationType(int(format))
    return torch.from_numpy(gguf.quants.dequantize(rows.numpy(), kind))


def assert_product(
    out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """`out` is `x @ weights^T + bias` in x's dtype: the weights rounded to it as the
    kernel's tiles are, float32 sums of k products (each within k roundings of the largest
    partial sum), then one rounding to the dtype."""
    w = weights.to(x.dtype).double()
    expected = x.double() @ w.T + (0 if bias is None else bias.double())
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.abs().T)
    bound += expected.abs() * torch.finfo(x.dtype).eps + 1e-30
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert ((out.double().cpu() - expected).abs() <= bound).all()


# (m, n, k): a decode row over several (super-)blocks and a row tile with a tail; x's
# 64-row tiles over two of W's; a few rows over 3 blocks of 32, tiles of 32 along k
@pytest.mark.parametrize(
    ("m", "format", "n", "k"),
    [
        (m, format, n, k)
        for m, n, k in [(1, 33, 512), (20, 70, 256), (3, 5, 96)]
        for format, _, _ in gguf_cases([(n, k)])
    ],
    ids=format_name,
)
def test_matmul_is_x_times_the_weights_gguf_dequantizes(m, format, n, k):
    rows, _ = quantized(format, random_weight(n, k, seed=n + k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = gguf_matmul.gguf_linear(x.to(DEVICE), rows.to(DEVICE), int(format))
    assert_product(out, x, dequantized(format, rows))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("format", GGUF_FORMATS, ids=format_name)
def test_matmul_rounds_the_weights_to_16_bit_activations_and_adds_the_bias(format, dtype):
    rows, _ = quantized(format, random_weight(40, 256, seed=int(format)))
    x = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = gguf_matmul.gguf_linear(x.to(DEVICE), rows.to(DEVICE), int(format), bias.to(DEVICE))
    assert out.shape == (2, 4, 40)
    assert_product(out.view(8, 40), x.view(8, 256), dequantized(format, rows), bias)


@pytest.mark.parametrize("format", GGUF_FORMATS, ids=format_name)
def test_every_bit_field_decodes_as_gguf_decodes_it(format):
    rows = random_blocks(format, 9, 512, seed=int(format))
    weights = dequantized(format, rows)
    ids = torch.tensor([8, 0, 3, 3, 7, 1, 2, 4, 5, 6])
    looked_up = gguf_matmul.gguf_embedding(
        rows.to(DEVICE), ids.to(DEVICE), int(format), 512, torch.float32
    )
    assert torch.equal(looked_up.cpu(), weights[ids])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    assert_product(gguf_matmul.gguf_linear(x.to(DEVICE), rows.to(DEVICE), int(format)), x, weights)


@pytest.mark.parametrize(("format", "n", "k"), gguf_cases([(4, 640)]), ids=format_name)
def test_lookup_returns_the_rows_of_the_ids_in_their_shape(format, n, k):
    rows, _ = quantized(format, random_weight(n, k, seed=k))
    ids = torch.tensor([[n - 1, 0, 1], [1, 1, n - 1]])
    out = gguf_matmul.gguf_embedding(rows.to(DEVICE), ids.to(DEVICE), int(format), k, torch.half)
    assert out.shape == (2, 3, k) and out.dtype == torch.half
    assert torch.equal(out.cpu(), dequantized(format, rows)[ids].half())


@pytest.mark.parametrize("format", [WeightFormat.Q5_0, WeightFormat.Q6_K], ids=format_name)
def test_a_linear_layer_and_embedding_holding_blocks_take_the_triton_kernels(format, triton_path):
    weight = random_weight(24, 256, seed=5)
    rows, _ = quantized(format, weight)
    linear = Linear(256, 24).to(DEVICE)
    embedding = VocabParallelEmbedding(24, 256).to(DEVICE)
    for module in (linear, embedding):
        hold_blocks(module, format, 32)
        module.weight.data.copy_(rows)
    weights = dequantized(format, rows)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    assert_product(linear(x.to(DEVICE)), x, weights)
    ids = torch.tensor([23, 0, 5])
    assert torch.equal(embedding(ids.to(DEVICE)).float().cpu(), weights[ids])
