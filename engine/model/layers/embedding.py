"""Token embedding and the LM head (which may share its weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import default_weight_loader, set_weight_loader


class VocabEmbedding(nn.Module):
    """Token id -> hidden vector."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Hidden vector -> vocabulary logits; the LogitsProcessor applies it. With
    `tie_word_embeddings` the model uses its VocabEmbedding here instead."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LMHead is applied by LogitsProcessor, not called")
