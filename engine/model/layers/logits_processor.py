"""From the last layer's hidden states to the logits the sampler sees."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.forward_batch import ForwardBatch
from engine.model.layers.embedding import VocabEmbedding
from engine.model.layers.linear import linear, pack_weight


class LogitsProcessor(nn.Module):
    """Projects only the positions that get sampled: the last new token of each extend
    request and every decode token. Logits come out in at least float32, whatever the
    model's dtype, because the sampler's softmax and penalties want the precision."""

    packed_lm_head: torch.Tensor | None = None

    def pack_lm_head(self, lm_head: VocabEmbedding) -> None:
        """Once the weights are loaded (see `pack_weight`): the vocabulary projection is the
        largest matmul of a decode step."""
        self.packed_lm_head = pack_weight(lm_head.weight)

    def forward(
        self, hidden_states: torch.Tensor, lm_head: VocabEmbedding, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        if not forward_batch.forward_mode.is_decode():
            hidden_states = hidden_states.index_select(
                0, torch.cumsum(forward_batch.extend_lens, 0) - 1
            )
        logits = linear(hidden_states, lm_head.weight, self.packed_lm_head)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
