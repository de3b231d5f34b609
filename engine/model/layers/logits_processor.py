"""From the last layer's hidden states to the logits the sampler sees, and the prompt
logprobs some requests ask for."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from engine.distributed import get_tp_group
from engine.model.forward_batch import ForwardBatch, PromptLogprobsInput
from engine.model.layers.embedding import VocabParallelEmbedding
from engine.model.layers.linear import linear, pack_weight

PROMPT_LOGPROBS_STEP_ELEMENTS = 1 << 26
"""Prompt logprobs are computed this many logits at a time (256 MiB of float32): a long
prompt times a large vocabulary would otherwise need gigabytes at once."""


class LogitsProcessorOutput(NamedTuple):
    """What the model's forward returns (SGLang's name)."""

    next_token_logits: torch.Tensor
    """[batch, vocab]: one row per request, for the position it samples next (TARGET_VERIFY:
    one row per draft-tree node)."""
    input_token_logprobs: torch.Tensor | None = None
    """[N], in the logits' dtype: the logprob of the prompt token after each row of
    `forward_batch.prompt_logprobs` (None when it is None)."""
    input_top_logprobs_val: torch.Tensor | None = None
    """[N, top_k]: the likeliest logprobs at each of those rows (None when top_k is 0)."""
    input_top_logprobs_idx: torch.Tensor | None = None
    """[N, top_k] int64: their token ids."""


class LogitsProcessor(nn.Module):
    """Projects only the positions that get sampled: the last new token of each extend
    request, every decode token and every draft-tree node, plus the rows
    `forward_batch.prompt_logprobs` asks for. Logits come out in at least float32, whatever
    the model's dtype, because the sampler's softmax and penalties want the precision."""

    packed_lm_head: torch.Tensor | None = None
    batch_invariant = False
    """Set by --enable-deterministic-inference (`engine/model/batch_invariant.py`)."""

    def pack_lm_head(self, lm_head: VocabParallelEmbedding) -> None:
        """Once the weights are loaded (see `pack_weight`): the vocabulary projection is the
        largest matmul of a decode step."""
        if lm_head.quant_format is None:
            self.packed_lm_head = pack_weight(lm_head.weight)

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: VocabParallelEmbedding,
        forward_batch: ForwardBatch,
    ) -> LogitsProcessorOutput:
        last = hidden_states
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_verify()):
            last = hidden_states.index_select(0, torch.cumsum(forward_batch.extend_lens, 0) - 1)
        logits = self._project(last, lm_head)
        spec = forward_batch.prompt_logprobs
        if spec is None:
            return LogitsProcessorOutput(logits)
        prompt_hidden = hidden_states.index_select(0, spec.token_rows)
        return LogitsProcessorOutput(logits, *self._prompt_logprobs(prompt_hidden, lm_head, spec))

    def _project(
        self, hidden_states: torch.Tensor, lm_head: VocabParallelEmbedding
    ) -> torch.Tensor:
        """Every rank's slice of the logits, gathered along the vocabulary, without the
        padding rows of a vocabulary that does not split evenly. A quantized head sums in
        float32 whatever its rows' dtype: float32 rows keep its logits as they are summed,
        not rounded to the model's dtype and widened again."""
        if lm_head.quant_format is not None:
            hidden_states = hidden_states.float()
        logits = linear(
            hidden_states,
            lm_head.weight,
            self.packed_lm_head,
            quant_format=lm_head.quant_format,
            activation_bits=lm_head.activation_bits,
            batch_invariant=self.batch_invariant,
        )
        logits = get_tp_group().all_gather(logits, dim=-1)[:, : lm_head.num_embeddings]
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _prompt_logprobs(
        self,
        hidden_states: torch.Tensor,
        lm_head: VocabParallelEmbedding,
        spec: PromptLogprobsInput,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The raw model's log-softmax at each row (no penalty, bias or temperature: these
        are the prompt's, not a sampled token's), gathered at the next prompt token and its
        top-k, a bounded number of rows at a time. -inf is clamped to the float32 minimum,
        as the sampler clamps, so that the values can go out as JSON."""
        step = max(1, PROMPT_LOGPROBS_STEP_ELEMENTS // lm_head.num_embeddings)
        chosen, top_val, top_idx = [], [], []
        for start in range(0, hidden_states.shape[0], step):
            logprobs = torch.log_softmax(
                self._project(hidden_states[start : start + step], lm_head), dim=-1
            ).clamp_(min=torch.finfo(torch.float32).min)
            next_ids = spec.next_token_ids[start : start + step].unsqueeze(1)
            chosen.append(logprobs.gather(1, next_ids).squeeze(1))
            if spec.top_k:
                top = logprobs.topk(spec.top_k, dim=-1)
                top_val.append(top.values)
                top_idx.append(top.indices)
        if not spec.top_k:
            return torch.cat(chosen), None, None
        return torch.cat(chosen), torch.cat(top_val), torch.cat(top_idx)
