"""`benchmarks/llama_accuracy.py` without llama.cpp: the float32 GGUF it writes is the source
dequantized with its metadata kept, its reader recovers log-probabilities from a file laid out
as llama-perplexity writes one, and its parser finds the summary lines."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from benchmarks.llama_accuracy import (
    SavedLogprobs,
    compare,
    read_logprobs,
    statistics,
    write_f32_gguf,
)


def write_quantized_gguf(path: Path) -> np.ndarray:
    """A two-tensor GGUF, one Q8_0 and one F32, with a few keys; the Q8_0 tensor's source."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_uint32(gguf.Keys.General.FILE_TYPE, int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("norm.weight", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weight


def test_the_f32_gguf_is_the_source_dequantized_with_its_keys(tmp_path: Path) -> None:
    source = tmp_path / "q8.gguf"
    weight = write_quantized_gguf(source)
    target = write_f32_gguf(source, tmp_path / "f32.gguf")

    reader, original = gguf.GGUFReader(target), gguf.GGUFReader(source)
    tensors = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in tensors.values()} == {gguf.GGMLQuantizationType.F32}
    dequantized = gguf.quants.dequantize(original.tensors[0].data, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(tensors["w.weight"].data, dequantized)
    np.testing.assert_allclose(tensors["w.weight"].data, weight, atol=0.05)
    np.testing.assert_array_equal(tensors["norm.weight"].data, np.arange(64))
    keys = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    assert keys.pop(gguf.Keys.General.FILE_TYPE) == int(gguf.LlamaFileType.ALL_F32)
    assert keys == {
        f.name: f.contents()
        for f in original.fields.values()
        if not f.name.startswith("GGUF.") and f.name != gguf.Keys.General.FILE_TYPE
    }
    assert list(tmp_path.glob("*.partial")) == []


def write_logprob_file(path: Path, tokens: np.ndarray, logits: np.ndarray) -> None:
    """llama-perplexity's layout and 16-bit steps (its `log_softmax` with a file): `logits`
    are the [chunk, scored position, vocab] rows of each chunk's last n_ctx - 1 - n_ctx/2."""
    n_chunk, n_ctx = tokens.shape
    n_vocab = logits.shape[-1]
    with path.open("wb") as f:
        f.write(b"_logits_")
        np.array([n_ctx, n_vocab, n_chunk], dtype=np.int32).tofile(f)
        tokens.astype(np.int32).tofile(f)
        for row in logits.reshape(-1, n_vocab).astype(np.float32):
            top = row.max()
            floor = max(row.min(), top - 16)
            lse = np.log(np.exp(row - top).sum())
            scale = np.float32((top - floor) / 65535)
            steps = np.where(row > floor, np.rint((row - floor) / scale), 0).astype(np.uint16)
            np.array([scale, floor - top - lse], dtype=np.float32).tofile(f)
            np.pad(steps, (0, n_vocab % 2)).tofile(f)


def test_read_logprobs_gives_the_scored_tokens_log_probabilities(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n_chunk, n_ctx, n_vocab = 2, 8, 5
    scored = n_ctx - 1 - n_ctx // 2
    tokens = rng.integers(0, n_vocab, (n_chunk, n_ctx))
    logits = rng.standard_normal((n_chunk, scored, n_vocab)) * 3
    logits[0, 0, tokens[0, n_ctx // 2 + 1]] = -40.0  # below the 16-nat floor
    write_logprob_file(tmp_path / "base.kld", tokens, logits)

    saved = read_logprobs(tmp_path / "base.kld")

    targets = tokens[:, n_ctx // 2 + 1 :].reshape(-1)
    rows = logits.reshape(-1, n_vocab)
    logprobs = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
    expected = logprobs[np.arange(len(targets)), targets]
    np.testing.assert_array_equal(saved.targets, targets)
    np.testing.assert_array_equal(saved.top1, rows.argmax(axis=1))
    assert saved.clamped.tolist() == [True] + [False] * (len(targets) - 1)
    np.testing.assert_allclose(saved.target_logprobs[1:], expected[1:], atol=1e-3)
    floor = -16 - np.log(np.exp(rows[0] - rows[0].max()).sum())
    assert saved.target_logprobs[0] == pytest.approx(floor, abs=1e-4)


def test_read_logprobs_refuses_another_file(tmp_path: Path) -> None:
    (tmp_path / "x.kld").write_bytes(b"not a logits file")
    with pytest.raises(ValueError, match="not a llama-perplexity"):
        read_logprobs(tmp_path / "x.kld")


def saved(targets: list[int], logprobs: list[float], top1: list[int]) -> SavedLogprobs:
    return SavedLogprobs(
        targets=np.array(targets),
        target_logprobs=np.array(logprobs),
        top1=np.array(top1),
        clamped=np.zeros(len(targets), dtype=bool),
    )


def test_compare_gives_mean_abs_delta_and_top1_agreement() -> None:
    served = saved([1, 2, 3, 4], [-1.0, -2.0, -0.5, -3.0], [7, 8, 9, 9])
    reference = saved([1, 2, 3, 4], [-1.5, -1.0, -0.5, -3.0], [7, 8, 9, 1])
    delta, agree = compare(served, reference)
    assert delta == pytest.approx(0.375)
    assert agree == 0.75
    with pytest.raises(ValueError, match="different tokens"):
        compare(saved([1], [0.0], [0]), saved([2], [0.0], [0]))


SUMMARY = """====== Perplexity statistics ======
Mean PPL(Q)                   :  21.693432 ±   1.771234
Mean PPL(base)                :  20.998321 ±   1.711025
Cor(ln(PPL(Q)), ln(PPL(base))):  99.12%
Mean ln(PPL(Q)/PPL(base))     :   0.032568 ±   0.010857
Mean PPL(Q)/PPL(base)         :   1.033104 ±   0.011216

====== KL divergence statistics ======
Mean    KLD:   0.044172 ±   0.003411
Maximum KLD:   0.581313
Median  KLD:   0.023020

====== Token probability statistics ======
Mean    Δp: -0.541 ± 0.224 %
RMS Δp    :  3.588 ± 0.315 %
Same top p: 93.548 ± 1.564 %
"""


def test_statistics_reads_the_summary_lines() -> None:
    found = statistics(SUMMARY)
    assert found == {
        "Mean    KLD": "0.044172 ±   0.003411",
        "RMS Δp": "3.588 ± 0.315 %",
        "Same top p": "93.548 ± 1.564 %",
    }


def test_statistics_refuses_an_output_without_them() -> None:
    with pytest.raises(ValueError, match="Same top p"):
        statistics(SUMMARY.replace("Same top p", "Other"))
