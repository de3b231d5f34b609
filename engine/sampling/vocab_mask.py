"""The grammar hook: an xgrammar-style packed bitmask applied to the logits."""

from __future__ import annotations

import torch


def apply_vocab_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit is 0.

    `bitmask` is int32 `[B, ceil(V / 32)]` in xgrammar's layout (token `t` is bit `t % 32`,
    least significant first, of word `t // 32`; 1 = allowed), so xgrammar's
    `fill_next_token_bitmask` output can be passed as is; a row without a grammar is all ones
    (-1). Unpacked in torch, so the same code runs on any device with no host round trip.
    A bitmask narrower than the logits is an error rather than "the rest is allowed":
    xgrammar leaves such a tail unmasked, which lets padded vocabulary ids be sampled.
    """
    batch_size, vocab_size = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != batch_size:
        raise ValueError(
            f"vocab mask must be int32 [{batch_size}, W], got {bitmask.dtype} {list(bitmask.shape)}"
        )
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"vocab mask covers {bitmask.shape[1] * 32} tokens, logits have {vocab_size}"
        )
    positions = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift copies the sign bit down, but `& 1` keeps only the bit asked for.
    allowed = (bitmask.unsqueeze(-1) >> positions) & 1
    forbidden = allowed.view(batch_size, -1)[:, :vocab_size] == 0
    logits.masked_fill_(forbidden, float("-inf"))
