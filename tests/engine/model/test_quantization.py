"""Weights served quantized (`--quantization`): a GGUF file's blocks held as stored and
multiplied as such, int8 rows quantized at load; which layers are held so, and the choices
of `auto` for the quantization and the dtype."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.kernels.cpu.isa import CpuIsa
from engine.model.dtype import resolve_dtype, resolve_kv_cache_dtype
from engine.model.embedded import embedded_model_path
from engine.model.layers.linear import Linear
from engine.model.layers.quantization import WeightFormat, quantize_int8_rows
from engine.model.loader import GGUFCheckpoint, HFCheckpoint, open_checkpoint, resolve_quantization
from tests.engine.model.conftest import run_greedy
from tests.engine.model.test_loader import write_gguf

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def embedded_runners():
    """The embedded model at float32: dequantized at load ("none"), and from its blocks with
    each mode of decode activations."""
    from engine.model.runner import ModelRunner

    def runner(quantization: str, activations: str) -> ModelRunner:
        return ModelRunner(
            "embedded",
            dtype="float32",
            max_total_tokens=2048,
            max_running_requests=8,
            quantization=quantization,
            quantized_activations=activations,
        )

    return {"none": runner("none", "float")} | {
        activations: runner("gguf", activations) for activations in ("float", "int16", "int8")
    }


def test_embedded_model_holds_the_files_blocks_byte_for_byte(embedded_runners):
    blocks = embedded_runners["int16"]
    assert blocks.weights_format == "gguf:Q4_1,Q8_0"
    down = blocks.model.model.layers[3].mlp.down_proj
    assert down.quant_format == WeightFormat.Q4_1 and down.weight.dtype == torch.uint8
    stored = next(
        t
        for t in gguf.GGUFReader(embedded_model_path()).tensors
        if t.name == "blk.3.ffn_down.weight"
    )
    assert np.array_equal(down.weight.numpy(), np.asarray(stored.data).reshape(down.weight.shape))
    embed = blocks.model.model.embed_tokens
    assert embed.quant_format == WeightFormat.Q8_0 and blocks.model.lm_head is embed
    held = sum(p.numel() * p.element_size() for p in blocks.model.parameters())
    assert held < 100 << 20  # the bf16 copy is 257 MiB


# float: the same products summed in another order; int16 (the default): x rounded to 15
# bits of each block's largest value, logits within about 1e-2
@pytest.mark.parametrize(("activations", "atol"), [("float", 2e-3), ("int16", 2e-2)])
def test_blocks_with_float_or_int16_activations_give_the_dequantized_models_tokens(
    embedded_runners, greedy, embedded_tokenizer, activations, atol
):
    prompts = [embedded_tokenizer.encode(text) for text in REFERENCE_TEXTS]
    want = greedy(embedded_runners["none"], prompts, 6)
    got = greedy(embedded_runners[activations], prompts, 6)
    assert got.tokens == want.tokens
    for want_steps, got_steps in zip(want.logits, got.logits):
        for a, b in zip(want_steps, got_steps):
            torch.testing.assert_close(b, a, rtol=0, atol=atol)


def test_int8_activations_keep_the_next_token_distribution(embedded_runners, embedded_tokenizer):
    """Rounding activations to int8 per block moves logprobs a little (the accuracy table in
    docs/benchmarks/quantization.md measures it): the first step's top token is the same and
    the log-probabilities stay close."""
    prompts = [embedded_tokenizer.encode(text) for text in REFERENCE_TEXTS]
    want = run_greedy(embedded_runners["none"], prompts, 1)
    got = run_greedy(embedded_runners["int8"], prompts, 1)
    assert got.tokens == want.tokens
    for (a,), (b,) in zip(want.logits, got.logits):
        delta = (torch.log_softmax(a.double(), -1) - torch.log_softmax(b.double(), -1)).abs()
        assert delta[a.argmax()] < 0.1 and delta.mean() < 0.2


REFERENCE_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


@pytest.mark.parametrize("activations", ["float", "int16", "int8"])
def test_fused_layers_of_one_format_hold_blocks_and_mixed_ones_stay_float(
    tmp_path, hf_model_factory, hf_logits, runner_factory, prompts_factory, activations
):
    hf_model = hf_model_factory("llama")
    path = tmp_path / "mixed.gguf"
    kinds = {
        ".q_proj.": Q.Q4_0,
        ".k_proj.": Q.Q4_0,
        ".v_proj.": Q.Q4_0,
        ".o_proj.": Q.Q8_0,
        ".gate_proj.": Q.Q4_1,
        ".down_proj.": Q.Q4_1,
    }  # up_proj stays F32
    write_gguf(hf_model, path, quantize=kinds)
    runner = runner_factory(
        path, dtype="float32", quantization="gguf", quantized_activations=activations
    )
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_format == WeightFormat.Q4_0
    assert layer.self_attn.o_proj.quant_format == WeightFormat.Q8_0
    assert layer.mlp.down_proj.quant_format == WeightFormat.Q4_1
    assert layer.mlp.gate_up_proj.quant_format is None  # Q4_1 gate beside an F32 up
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float32
    assert runner.weights_format == "gguf:Q4_0,Q4_1,Q8_0+float32"
    hf_model = hf_model.float()
    for prompt in prompts_factory([9, 30]):
        (logits,) = run_greedy(runner, [prompt], 1).logits[0]
        expected = hf_logits(hf_model, prompt)
        largest = expected.abs().max().item()
        tolerance = {"float": 1e-3, "int16": 1e-3 * largest}.get(activations, 0.05 * largest)
        assert (logits - expected).abs().max() <= tolerance


PREFILL_ROWS = 17
"""A prompt long enough that its rows multiply floats over every format (integer activations
take up to 16 rows of x over the K-quants)."""


def assert_prefill_and_decode_logits(runner, hf_model, hf_logits, prompts) -> None:
    """Logits as transformers' over the weights the blocks hold: the prefill's (float rows)
    within float roundings, the decode step's (x rounded to int16 per block) within 1e-3 of
    the largest."""
    for prompt in prompts:
        greedy = run_greedy(runner, [prompt], 2)
        expected = hf_logits(hf_model, prompt)
        assert (greedy.logits[0][0] - expected).abs().max() <= 1e-3
        assert greedy.tokens[0][0] == int(expected.argmax())
        decoded = hf_logits(hf_model, [*prompt, greedy.tokens[0][0]])
        largest = decoded.abs().max().item()
        assert (greedy.logits[0][1] - decoded).abs().max() <= 1e-3 * largest


MIXED_PARTS = {
    ".q_proj.": Q.Q5_0,
    ".k_proj.": Q.Q5_0,
    ".v_proj.": Q.Q8_0,
    ".o_proj.": Q.Q8_0,
    ".gate_proj.": Q.Q4_0,
    ".up_proj.": Q.Q8_0,
    ".down_proj.": Q.Q4_1,
}
"""Fused layers whose parts differ in block format: q and k in Q5_0 beside a Q8_0 v, as in
Gemma 3 270M's file, and a Q4_0 gate beside a Q8_0 up."""


def test_fused_layers_of_mixed_formats_hold_each_parts_blocks(
    tmp_path, hf_model_factory, hf_logits, runner_factory, prompts_factory
):
    """Each run of parts in one format is one part held in its blocks (q and k together);
    logits as transformers' over the weights those blocks hold."""
    hf_model = hf_model_factory("qwen3")
    path = tmp_path / "mixed_parts.gguf"
    write_gguf(hf_model, path, quantize=MIXED_PARTS)
    runner = runner_factory(path, dtype="float32", quantization="gguf")
    attn, mlp = runner.model.model.layers[0].self_attn, runner.model.model.layers[0].mlp
    q_rows, kv_rows, inter = attn.qkv_proj.q_size, attn.qkv_proj.kv_size, 96
    assert [(p.start, len(p.weight), p.format) for p in attn.qkv_proj.block_parts] == [
        (0, q_rows + kv_rows, WeightFormat.Q5_0),
        (q_rows + kv_rows, kv_rows, WeightFormat.Q8_0),
    ]
    assert [(p.start, len(p.weight), p.format) for p in mlp.gate_up_proj.block_parts] == [
        (0, inter, WeightFormat.Q4_0),
        (inter, inter, WeightFormat.Q8_0),
    ]
    assert attn.qkv_proj.quant_format is None and attn.qkv_proj.weight.dtype == torch.uint8
    assert runner.weights_format == "gguf:Q4_0,Q4_1,Q5_0,Q8_0"
    assert_prefill_and_decode_logits(runner, hf_model.float(), hf_logits, prompts_factory([9, 30]))


def test_k_quant_layers_are_served_from_their_super_blocks(
    tmp_path, hf_model_factory, hf_logits, runner_factory, prompts_factory
):
    """A file mixed as llama.cpp's Q4_K_M mixes its tensors: Q4_K projections and a Q6_K
    down projection, each layer held in its super-blocks; logits as transformers' over the
    weights those blocks hold."""
    hf_model = hf_model_factory("llama", hidden_size=256, intermediate_size=256)
    path = tmp_path / "k_quants.gguf"
    kinds = {
        ".q_proj.": Q.Q4_K,
        ".k_proj.": Q.Q4_K,
        ".v_proj.": Q.Q4_K,
        ".o_proj.": Q.Q4_K,
        ".gate_proj.": Q.Q4_K,
        ".up_proj.": Q.Q4_K,
        ".down_proj.": Q.Q6_K,
    }
    write_gguf(hf_model, path, quantize=kinds)
    runner = runner_factory(path, dtype="float32", quantization="gguf")
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_format == WeightFormat.Q4_K
    assert layer.mlp.gate_up_proj.quant_format == WeightFormat.Q4_K
    assert layer.mlp.down_proj.quant_format == WeightFormat.Q6_K
    assert layer.mlp.down_proj.weight.shape == (256, 256 // 256 * 210)
    assert runner.weights_format == "gguf:Q8_0,Q4_K,Q6_K"  # by GGML type id
    hf_model = hf_model.float()
    for prompt in prompts_factory([PREFILL_ROWS, 30]):
        greedy = run_greedy(runner, [prompt], 2)
        expected = hf_logits(hf_model, prompt)
        assert (greedy.logits[0][0] - expected).abs().max() <= 1e-3
        assert greedy.tokens[0][0] == int(expected.argmax())


@pytest.mark.parametrize(
    ("sizes", "kinds", "formats"),
    [
        # (write_gguf takes a name's first key: down_proj before the other projections)
        # 64 wide: Q5_0 and Q5_1 blocks of 32, the tied embedding and LM head in Q5_0
        (
            {},
            {".down_proj.": Q.Q5_1, "_proj.": Q.Q5_0, "embed_tokens": Q.Q5_0},
            "gguf:Q5_0,Q5_1",
        ),
        # 256 wide: Q5_K super-blocks beside Q5_0 (as in Gemma 3's Q4_K_M), a Q5_K embedding
        (
            {"hidden_size": 256, "intermediate_size": 256},
            {".down_proj.": Q.Q5_0, "_proj.": Q.Q5_K, "embed_tokens": Q.Q5_K},
            "gguf:Q5_0,Q5_K",
        ),
    ],
)
def test_q5_layers_and_embedding_are_served_from_their_blocks(
    tmp_path, hf_model_factory, hf_logits, runner_factory, prompts_factory, sizes, kinds, formats
):
    """Q5 tensors load as any format `gguf_format` serves: each layer and the tied embedding
    held in the file's blocks (the lookup and the LM head both read them); logits as
    transformers' over the weights those blocks hold, the prefill's (float rows) within
    float roundings, the decode step's (x rounded to int16 per block) within 1e-3 of the
    largest."""
    hf_model = hf_model_factory("llama", **sizes)
    path = tmp_path / "q5.gguf"
    write_gguf(hf_model, path, quantize=kinds)
    runner = runner_factory(path, dtype="float32", quantization="gguf")
    layer = runner.model.model.layers[0]
    projection, down = kinds["_proj."], kinds[".down_proj."]
    assert layer.self_attn.qkv_proj.quant_format == WeightFormat(int(projection))
    assert layer.mlp.gate_up_proj.quant_format == WeightFormat(int(projection))
    assert layer.mlp.down_proj.quant_format == WeightFormat(int(down))
    embed = runner.model.model.embed_tokens
    assert embed.quant_format == WeightFormat(int(kinds["embed_tokens"]))
    assert runner.model.lm_head is embed and embed.weight.dtype == torch.uint8
    assert runner.weights_format == formats
    assert_prefill_and_decode_logits(
        runner, hf_model.float(), hf_logits, prompts_factory([PREFILL_ROWS, 30])
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gguf_blocks_on_cuda_give_the_logits_of_the_weights_they_hold(
    tmp_path, hf_model_factory, hf_logits, runner_factory, prompts_factory
):
    """`--quantization gguf` on CUDA: the projections and the tied embedding (its lookup
    and the LM head) held on the GPU in the file's blocks and read by the Triton kernels;
    the prefill's and the graph-replayed decode's logits as transformers' over the weights
    those blocks hold."""
    hf_model = hf_model_factory("llama", hidden_size=256, intermediate_size=256)
    path = tmp_path / "mixed.gguf"
    kinds = {".down_proj.": Q.Q6_K, ".o_proj.": Q.Q8_0, "_proj.": Q.Q4_K, "embed_tokens": Q.Q5_0}
    write_gguf(hf_model, path, quantize=kinds)
    runner = runner_factory(path, device="cuda", dtype="float32", quantization="gguf")
    layer = runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == torch.uint8 and layer.mlp.down_proj.weight.is_cuda
    assert runner.weights_format == "gguf:Q5_0,Q8_0,Q4_K,Q6_K"
    hf_model = hf_model.float()
    for prompt in prompts_factory([9, 30]):
        greedy = run_greedy(runner, [prompt], 2)
        expected = hf_logits(hf_model, prompt)
        assert (greedy.logits[0][0].cpu() - expected).abs().max() <= 1e-3
        assert greedy.tokens[0][0] == int(expected.argmax())
        decoded = hf_logits(hf_model, [*prompt, greedy.tokens[0][0]])
        assert (greedy.logits[0][1].cpu() - decoded).abs().max() <= 1e-3


def test_int8_rows_quantized_at_load_give_the_logits_of_those_weights(
    tmp_path, hf_model_factory, hf_logits, runner_factory, prompts_factory
):
    """The oracle is transformers with each projection's weight replaced by what its int8
    rows hold (`q * s`); the biases of qwen2's q/k/v added after the int8 product."""
    hf_model = hf_model_factory("qwen2").float()
    hf_model.save_pretrained(tmp_path)
    runner = runner_factory(
        tmp_path, dtype="float32", quantization="int8", quantized_activations="float"
    )
    projections = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert projections and all(m.quant_format == WeightFormat.INT8 for m in projections)
    assert runner.weights_format == "int8+float32"  # the embedding stays float
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                rows = quantize_int8_rows(module.weight)
                k = module.weight.shape[1]
                scale = rows[:, k:].contiguous().view(torch.float32)
                module.weight.copy_(rows[:, :k].view(torch.int8).float() * scale)
    for prompt in prompts_factory([12, 40]):
        (logits,) = run_greedy(runner, [prompt], 1).logits[0]
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), rtol=0, atol=1e-4)


def test_auto_quantization_serves_gguf_blocks_on_one_cpu_rank_and_gguf_on_cuda_too(
    tmp_path, hf_model_factory
):
    hf_model = hf_model_factory("llama")
    gguf_path, hf_dir = tmp_path / "m.gguf", tmp_path / "hf"
    write_gguf(hf_model, gguf_path)
    hf_model.save_pretrained(hf_dir)
    from_gguf, from_hf = open_checkpoint(gguf_path), open_checkpoint(hf_dir)
    assert isinstance(from_gguf, GGUFCheckpoint) and isinstance(from_hf, HFCheckpoint)
    assert resolve_quantization("auto", from_gguf, CPU, 1) == "gguf"
    assert resolve_quantization("auto", from_hf, CPU, 1) == "none"
    assert resolve_quantization("auto", from_gguf, torch.device("cuda"), 1) == "none"
    assert resolve_quantization("auto", from_gguf, CPU, 2) == "none"
    assert resolve_quantization("int8", from_hf, CPU, 1) == "int8"
    assert resolve_quantization("gguf", from_gguf, torch.device("cuda"), 1) == "gguf"
    with pytest.raises(
        ValueError, match="--quantization gguf runs on cpu or cuda with --tp-size 1"
    ):
        resolve_quantization("gguf", from_gguf, torch.device("cuda"), 2)
    with pytest.raises(ValueError, match="--quantization int8 runs on cpu with --tp-size 1"):
        resolve_quantization("int8", from_hf, torch.device("cuda"), 1)
    with pytest.raises(ValueError, match="--quantization must be one of"):
        resolve_quantization("awq", from_gguf, CPU, 1)


def test_gguf_quantization_of_a_safetensors_model_is_refused(
    tmp_path, hf_model_factory, runner_factory
):
    hf_model_factory("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="serves a GGUF file's blocks"):
        runner_factory(tmp_path, quantization="gguf")


@pytest.mark.parametrize(
    ("flags", "path", "expected"),
    [
        (("avx2", "fma", "f16c", "bmi2"), "avx2", "float32"),
        (("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx512", "float32"),
        (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"), "avx512", "bfloat16"),
        (("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "amx", "bfloat16"),
        (("avx512f", "avx512_bf16"), "avx2", "float32"),  # a forced lower path
        ((), "none", "float32"),
    ],
)
def test_auto_dtype_follows_the_kernel_path(flags, path, expected):
    isa = CpuIsa(flags=flags, path=path)
    assert resolve_dtype("auto", CPU, isa) == expected
    assert resolve_dtype("auto", torch.device("cuda"), isa) == "bfloat16"
    assert resolve_dtype("float16", CPU, isa) == "float16"


def test_auto_kv_cache_dtype_is_float16_only_under_the_float32_auto_chose_on_cpu():
    cuda = torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", "auto", "float32", CPU) == "float16"
    assert resolve_kv_cache_dtype("auto", "float32", "float32", CPU) == "float32"  # as asked
    assert resolve_kv_cache_dtype("auto", "auto", "bfloat16", CPU) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "auto", "bfloat16", cuda) == "bfloat16"
    assert resolve_kv_cache_dtype("float32", "auto", "float32", CPU) == "float32"


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("bfloat16", "float16"), ("bfloat16", "float32"), ("float64", "float16")],
)
def test_a_kv_cache_dtype_no_kernel_reads_is_refused(
    dtype, kv_cache_dtype, hf_model_factory, runner_factory, tmp_path
):
    hf_model_factory("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"kv_cache_dtype {kv_cache_dtype} is not supported"):
        runner_factory(tmp_path, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
