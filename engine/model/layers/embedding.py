"""Token embedding and the LM head (which may share its weight), split by vocabulary rows
across the ranks of the tensor-parallel group.

Each rank holds `ceil(vocab / N)` rows: the last rank's tail past the vocabulary is zero
padding, so any vocabulary splits. The embedding looks up the ids in its range and one
all-reduce adds the ranks' rows; the LM head gives each rank's slice of the logits, which
`LogitsProcessor` gathers and cuts back to the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_group
from engine.kernels import custom_op
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.linear import CheckpointTensor, copy_shard, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Token id -> hidden vector, from this rank's rows `[vocab_start, vocab_end)`."""

    quant_format: int | None = None
    """Set when `weight` holds quantized rows (`quantization.hold_blocks`)."""
    activation_bits = 32

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        group = get_tp_group()
        self.num_embeddings = num_embeddings
        self.tp_size = group.size
        rows_per_rank = -(-num_embeddings // group.size)
        self.vocab_start = min(group.rank * rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + rows_per_rank, num_embeddings)
        self.embedding_dim = embedding_dim
        self.dtype = torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(rows_per_rank, embedding_dim))
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None
    ) -> int:
        """This rank's rows of the checkpoint's `[vocab, hidden]`; the padding rows zero."""
        rows = self.vocab_end - self.vocab_start
        copy_shard(param.data[:rows], loaded, 0, self.vocab_start, self.num_embeddings)
        param.data[rows:].zero_()
        return param.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_format is not None:  # one rank (quantization.py): widen the rows looked up
            if custom_op.uses_triton(input_ids):
                from engine.kernels.triton.gguf_matmul import gguf_embedding  # imports Triton

                dim = self.embedding_dim
                return gguf_embedding(self.weight, input_ids, self.quant_format, dim, self.dtype)
            rows = self.weight.index_select(0, input_ids.reshape(-1))
            out = cpu_ops.quant_dequantize(rows, self.quant_format, self.embedding_dim)
            return out.to(self.dtype).view(*input_ids.shape, self.embedding_dim)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(embeddings)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden vector -> vocabulary logits; the LogitsProcessor applies it. With
    `tie_word_embeddings` the model uses its VocabParallelEmbedding here instead."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")
