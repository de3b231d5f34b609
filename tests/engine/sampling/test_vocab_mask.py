"""The grammar hook reads xgrammar's bitmask layout exactly, sign bit included."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from engine.sampling.vocab_mask import apply_vocab_mask


def random_bitmask(
    batch_size: int, vocab_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed int32 bitmask and the bool `[B, V]` it encodes, packed here bit by bit."""
    allowed = (
        torch.rand(batch_size, vocab_size, generator=torch.Generator().manual_seed(seed)) < 0.3
    )
    words = (vocab_size + 31) // 32
    packed = [[0] * words for _ in range(batch_size)]
    for b, t in allowed.nonzero().tolist():
        packed[b][t // 32] |= 1 << (t % 32)
    as_int32 = [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in packed]
    return torch.tensor(as_int32, dtype=torch.int32), allowed


@pytest.mark.parametrize("vocab_size", [32, 70, 1000])
def test_forbids_exactly_the_zero_bits(vocab_size: int) -> None:
    bitmask, allowed = random_bitmask(5, vocab_size, seed=vocab_size)
    logits = torch.randn(5, vocab_size)
    masked = logits.clone()
    apply_vocab_mask(masked, bitmask)
    assert torch.equal(masked, torch.where(allowed, logits, float("-inf")))


def test_matches_xgrammar_on_cpu() -> None:
    bitmask, _ = random_bitmask(7, 1000, seed=0)
    ours = torch.randn(7, 1000)
    theirs = ours.clone()
    apply_vocab_mask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)


def test_all_ones_row_leaves_logits_alone() -> None:
    logits = torch.randn(2, 100)
    masked = logits.clone()
    bitmask = xgr.allocate_token_bitmask(2, 100)
    apply_vocab_mask(masked, bitmask)
    assert torch.equal(masked, logits)


def test_bitmask_narrower_than_the_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="covers 64 tokens, logits have 100"):
        apply_vocab_mask(torch.zeros(1, 100), torch.full((1, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_vocab_mask(torch.zeros(1, 100), torch.full((1, 4), -1, dtype=torch.int64))
