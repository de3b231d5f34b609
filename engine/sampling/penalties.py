"""Repetition, frequency and presence penalties as whole-batch tensor ops."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch


def count_tokens(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Occurrences of each token in each row, `[B, V]` float32, by one flat scatter_add.

    Float32 counts are exact below 2**24 and multiply the float32 penalties without a cast.
    """
    index = _flat_index(token_ids, vocab_size, device)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(len(token_ids), vocab_size)


def token_mask(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Whether each token occurs in each row, `[B, V]` bool: a quarter of the memory of counts."""
    mask = torch.zeros(len(token_ids) * vocab_size, dtype=torch.bool, device=device)
    mask[_flat_index(token_ids, vocab_size, device)] = True
    return mask.view(len(token_ids), vocab_size)


def _flat_index(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """`row * V + token` for every token of every row, built on the host and copied once, so
    the device sees one copy and one scatter however many tokens each request holds."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), dtype=torch.int64), lengths)
    return (rows * vocab_size + flat).to(device, non_blocking=True)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor
) -> None:
    """CTRL / Hugging Face semantics, in place: for every token already in the prompt or the
    output, divide a positive logit by the penalty and multiply a negative one, so a penalty
    above 1 always makes the token less likely.

    `seen` is `[B, V]` bool, `penalties` `[B, 1]`; a row with penalty 1 is unchanged.
    """
    scaled = torch.where(logits > 0, logits / penalties, logits * penalties)
    logits.copy_(torch.where(seen, scaled, logits))


def apply_frequency_presence_penalties(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> None:
    """OpenAI semantics, in place: `logit -= frequency * count + presence * (count > 0)`,
    where `count` counts the token in the output so far (not the prompt).

    `counts` is `[B, V]` float32, `frequency` and `presence` `[B, 1]`.
    """
    logits.sub_(counts * frequency + (counts > 0) * presence)
