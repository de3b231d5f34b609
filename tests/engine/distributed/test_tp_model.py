"""The sharded model at TP=2 (and the embedded model at TP=3) over gloo, against TP=1.

Each configuration runs in one module-scoped pool of real rank processes (`RankPool`) that
joins its group once and runs the tests' tasks on every rank; the TP=1 references run in
this process, where `get_tp_group()` is a group of one. Tiny models: 4 heads and 2 KV
heads (Llama, tied head, a 255-token vocabulary that splits unevenly), Qwen2 (q/k/v
biases, untied head), Qwen3 (q/k norms, 32-wide heads) and a 1-KV-head Llama whose KV head
both ranks hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.model.config import ModelConfig
from engine.model.loader import HFCheckpoint, SafetensorsSlice
from testing.models import save_tiny_model
from tests.engine.distributed.rank_pool import (
    RUNNER_OPTIONS,
    RankPool,
    graph_replays,
    greedy_steps,
    held_kv_heads,
    held_shards,
    load_refusal,
)

TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(vocab_size=255)),
    "qwen2": ("qwen2", dict(vocab_size=255)),
    "qwen3": ("qwen3", {}),
    "llama_one_kv_head": ("llama", dict(num_key_value_heads=1)),
}
"""name -> (testing.models arch, config overrides)."""
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [11, 200, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def tp2() -> Iterator[RankPool]:
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every TINY_MODELS checkpoint, saved in float32 as safetensors."""
    dirs = {}
    for name, (arch, overrides) in TINY_MODELS.items():
        path = tmp_path_factory.mktemp(name)
        save_tiny_model(path, arch, **overrides)
        dirs[name] = path
    return dirs


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def expected_shards(
    config: ModelConfig, full: dict[str, torch.Tensor], rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """Megatron's layout, spelled out independently of the layers: what rank `rank` of
    `tp` must hold of layer 0 and of the vocabulary."""
    hd, heads = config.head_dim, config.num_attention_heads
    q_heads = heads // tp
    q_rows = q_heads * hd
    kv_heads = max(1, config.num_key_value_heads // tp)
    # The KV head the rank's first q head attends with (grouped-query attention).
    kv_head0 = rank * q_heads // (heads // config.num_key_value_heads)
    kv = slice(kv_head0 * hd, (kv_head0 + kv_heads) * hd)
    inter = config.intermediate_size // tp
    layer = "model.layers.0."

    def qkv(kind: str) -> torch.Tensor:
        q = full[f"{layer}self_attn.q_proj.{kind}"][rank * q_rows : (rank + 1) * q_rows]
        k = full[f"{layer}self_attn.k_proj.{kind}"][kv]
        v = full[f"{layer}self_attn.v_proj.{kind}"][kv]
        return torch.cat([q, k, v])

    mlp = slice(rank * inter, (rank + 1) * inter)
    rows = -(-config.vocab_size // tp)

    def vocab_rows(name: str) -> torch.Tensor:
        """The rank's `ceil(vocab / tp)` rows, zero past the vocabulary."""
        held = torch.zeros(rows, config.hidden_size)
        real = full[name][rank * rows : (rank + 1) * rows]
        held[: len(real)] = real
        return held

    expected = {
        f"{layer}self_attn.qkv_proj.weight": qkv("weight"),
        f"{layer}self_attn.o_proj.weight": full[f"{layer}self_attn.o_proj.weight"][
            :, rank * q_rows : (rank + 1) * q_rows
        ],
        f"{layer}mlp.gate_up_proj.weight": torch.cat(
            [full[f"{layer}mlp.gate_proj.weight"][mlp], full[f"{layer}mlp.up_proj.weight"][mlp]]
        ),
        f"{layer}mlp.down_proj.weight": full[f"{layer}mlp.down_proj.weight"][:, mlp],
        "model.embed_tokens.weight": vocab_rows("model.embed_tokens.weight"),
    }
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = vocab_rows("lm_head.weight")
    if config.qkv_bias:
        expected[f"{layer}self_attn.qkv_proj.bias"] = qkv("bias")
    return expected


def test_safetensors_tensors_are_read_one_slice_at_a_time(tiny_dirs: dict[str, Path]):
    full = checkpoint_tensors(tiny_dirs["qwen2"])
    lazy = dict(HFCheckpoint(tiny_dirs["qwen2"]).lazy_weights())
    assert lazy.keys() == full.keys()
    for name, tensor in lazy.items():
        assert isinstance(tensor, SafetensorsSlice) and tensor.shape == full[name].shape
        assert torch.equal(tensor.narrow(0, 1, 2), full[name][1:3])
        if tensor.shape[1:]:
            assert torch.equal(tensor.narrow(1, 3, 4), full[name][:, 3:7])


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_each_rank_holds_its_share_of_every_split_tensor_and_of_the_kv_heads(
    tp2: RankPool, tiny_dirs: dict[str, Path], name: str
):
    path = tiny_dirs[name]
    config = ModelConfig.from_hf(path)
    full = checkpoint_tensors(path)
    kv_heads = max(1, config.num_key_value_heads // 2)
    for rank, held in enumerate(tp2.run(held_shards, str(path))):
        for param, expected in expected_shards(config, full, rank, 2).items():
            torch.testing.assert_close(held["params"][param], expected, atol=0, rtol=0)
        assert held["kv_buffers"] == {
            (RUNNER_OPTIONS["max_total_tokens"] + 1, kv_heads, config.head_dim)
        }
        assert held["attn_heads"] == (config.num_attention_heads // 2, kv_heads)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tp2_logits_equal_tp1_in_float32_with_two_all_reduces_per_layer(
    tp2: RankPool, tiny_dirs: dict[str, Path], name: str
):
    path = str(tiny_dirs[name])
    expected, tp1_calls = greedy_steps(path, "float32", PROMPTS, steps=4)
    (logits0, calls), (logits1, _) = tp2.run(greedy_steps, path, "float32", PROMPTS, 4)
    for step, want in enumerate(expected):
        assert (logits0[step] - want).abs().max() <= 1e-5
        assert torch.equal(logits0[step], logits1[step]), "the ranks disagree"
    layers = ModelConfig.from_hf(path).num_hidden_layers
    # Every step: o_proj and down_proj of each layer, plus the embedding's one.
    assert calls == [2 * layers + 1] * 4 and tp1_calls == [0] * 4


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tp2_greedy_tokens_equal_tp1_in_float64(
    tp2: RankPool, tiny_dirs: dict[str, Path], name: str
):
    path = str(tiny_dirs[name])
    expected, _ = greedy_steps(path, "float64", PROMPTS, steps=6)
    (logits, _), _ = tp2.run(greedy_steps, path, "float64", PROMPTS, 6)
    assert [step.argmax(-1).tolist() for step in logits] == [
        step.argmax(-1).tolist() for step in expected
    ]


def test_tp2_decode_graphs_capture_the_all_reduces(tp2: RankPool, tiny_dirs: dict[str, Path]):
    path = str(tiny_dirs["qwen2"])
    expected, _ = greedy_steps(path, "float32", PROMPTS, steps=4)
    (logits, _), _ = tp2.run(greedy_steps, path, "float32", PROMPTS, 4, True)
    graphs = tp2.run(graph_replays, path)
    assert graphs[0] == graphs[1] and graphs[0] == [4] * 3  # three decode steps of bucket 4
    for step, want in enumerate(expected):
        assert (
            logits[step] - want
        ).abs().max() <= 2e-5  # two ranks sum the all-reduce in another order


def test_a_tp_size_that_does_not_divide_the_kv_heads_is_refused_at_load(
    tp2: RankPool, tmp_path: Path
):
    path = save_tiny_model(
        tmp_path, "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    messages = tp2.run(load_refusal, str(path))
    assert messages[0] == messages[1]
    assert "--tp-size 2" in messages[0] and "3 KV heads" in messages[0]


@pytest.mark.parametrize(
    ("shape", "tp_size", "refusal"),
    [
        (dict(num_attention_heads=6, num_key_value_heads=2), 4, "the 6 attention heads"),
        (dict(num_attention_heads=12, num_key_value_heads=4), 6, "the 4 KV heads"),
        (dict(intermediate_size=100), 8, "the MLP's intermediate size 100"),
        (dict(num_attention_heads=8, num_key_value_heads=2), 4, None),  # KV heads split
        (dict(num_attention_heads=8, num_key_value_heads=2), 8, None),  # replicated 4 times
        (dict(vocab_size=1001), 8, None),  # the vocabulary is padded
    ],
)
def test_verify_tp_size_names_what_does_not_divide(
    shape: dict[str, int], tp_size: int, refusal: str | None
):
    hf = dict(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=1,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=256,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
    )
    config = ModelConfig.from_hf({**hf, **shape})
    if refusal is None:
        config.verify_tp_size(tp_size)
        return
    with pytest.raises(ValueError, match=f"--tp-size {tp_size} does not divide {refusal}"):
        config.verify_tp_size(tp_size)


def test_the_embedded_model_at_tp3_gives_the_greedy_tokens_of_tp1():
    prompts = [[1, 504, 3458, 314, 2696], [28, 7654, 30], [1, 2, 3, 4, 5, 6, 7, 8]]
    expected, _ = greedy_steps("embedded", "float32", prompts, steps=5)
    pool = RankPool(3)
    try:
        answers = pool.run(greedy_steps, "embedded", "float32", prompts, 5)
        held = pool.run(held_kv_heads, "embedded")
    finally:
        pool.close()
    want = [step.argmax(-1).tolist() for step in expected]
    for logits, _ in answers:
        assert [step.argmax(-1).tolist() for step in logits] == want
    assert held == [1, 1, 1]  # 3 KV heads over 3 ranks
