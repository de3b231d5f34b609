"""The sampling parameters of a whole batch, laid out once as device tensors."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from engine.sampling.penalties import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    count_tokens,
    token_mask,
)
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.vocab_mask import apply_vocab_mask


class SamplingReq(Protocol):
    """What the sampler reads from a request (the scheduler's `Req` provides it)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]


@dataclass
class SamplingBatchInfo:
    """Per-row sampling state of one batch, as in SGLang.

    Built on the host from `SamplingRows` and copied with `non_blocking=True`, so building
    it never waits on the device. Optional tensors are None when no row needs them, so a batch
    of plain requests pays nothing for penalties, biases, min-tokens or seeds. `sort_width`
    and the `need_*` flags are host values for the same reason: the sampler branches on
    them without reading a device value. A greedy row is taken by argmax, so here it has
    temperature 1 and no top-k / top-p / min-p, and costs the filters nothing.
    """

    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32
    top_ps: torch.Tensor  # [B, 1] float32
    top_ks: torch.Tensor  # [B, 1] int64; "off" is vocab_size
    min_ps: torch.Tensor  # [B, 1] float32
    is_greedy: torch.Tensor  # [B] bool
    is_all_greedy: bool
    # How many of the likeliest tokens top-k / top-p look at; 0 when no row uses them.
    sort_width: int
    need_top_p_sampling: bool
    need_min_p_sampling: bool
    return_logprob: bool
    top_logprobs_num: int  # the largest any row asks for
    frequency_penalties: torch.Tensor | None = None  # [B, 1], set together with presence_penalties
    presence_penalties: torch.Tensor | None = None  # [B, 1]
    output_token_counts: torch.Tensor | None = None  # [B, V] float32, output tokens only
    repetition_penalties: torch.Tensor | None = None  # [B, 1]
    seen_token_mask: torch.Tensor | None = None  # [B, V] bool, prompt + output tokens
    logit_bias: torch.Tensor | None = None  # [B, V] float32, additive
    # [N] int64, with min_tokens_ids: (row, token) pairs
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_ids: torch.Tensor | None = None  # [N] int64, EOS / stop ids forbidden this step
    seeded_rows: torch.Tensor | None = None  # [S] int64, rows that carry a seed
    sampling_seeds: torch.Tensor | None = None  # [S] int64
    seed_steps: torch.Tensor | None = None  # [S] int64, index of the output token being sampled
    vocab_mask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32, set by the grammar backend

    @classmethod
    def from_rows(
        cls, rows: SamplingRows, vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingBatchInfo:
        """The part that depends on the parameters alone, which a running batch keeps from
        step to step; `add_req_state` adds what also reads the requests' tokens."""
        device = torch.device(device)
        filtered = ~rows.is_greedy & ((rows.top_ks < vocab_size) | (rows.top_ps < 1.0))
        # Top-p is measured inside the top-k set, so the filters need only the `top_k`
        # likeliest tokens of a row, or all of them for top-p without top-k.
        sort_width = int(rows.top_ks[filtered].max()) if bool(filtered.any()) else 0

        def column(values: torch.Tensor) -> torch.Tensor:
            return values.view(-1, 1).to(device, non_blocking=True)

        return cls(
            vocab_size=vocab_size,
            temperatures=column(rows.temperatures),
            top_ps=column(rows.top_ps),
            top_ks=column(rows.top_ks),
            min_ps=column(rows.min_ps),
            is_greedy=rows.is_greedy.to(device, non_blocking=True),
            is_all_greedy=bool(rows.is_greedy.all()),
            sort_width=sort_width,
            need_top_p_sampling=bool((rows.top_ps < 1.0).any()),
            need_min_p_sampling=bool((rows.min_ps > 0.0).any()),
            return_logprob=bool(rows.logprobs.any()),
            top_logprobs_num=int(rows.top_logprobs_nums.max()) if len(rows) else 0,
        )

    def add_req_state(
        self, reqs: Sequence[SamplingReq], rows: SamplingRows, eos_token_ids: Collection[int]
    ) -> None:
        """Penalties (with the token counts they scale), logit_bias, min-tokens and seeds:
        the rare parameters, laid out per batch from the requests (whose outputs they read)."""
        device = self.temperatures.device
        params = [req.sampling_params for req in reqs]

        def column(values: torch.Tensor) -> torch.Tensor:
            return values.view(-1, 1).to(device, non_blocking=True)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        vocab_size = self.vocab_size
        if bool(((rows.frequency_penalties != 0.0) | (rows.presence_penalties != 0.0)).any()):
            self.frequency_penalties = column(rows.frequency_penalties)
            self.presence_penalties = column(rows.presence_penalties)
            self.output_token_counts = count_tokens(
                [req.output_ids for req in reqs], vocab_size, device
            )
        if bool((rows.repetition_penalties != 1.0).any()):
            self.repetition_penalties = column(rows.repetition_penalties)
            all_ids = [req.origin_input_ids + req.output_ids for req in reqs]
            self.seen_token_mask = token_mask(all_ids, vocab_size, device)

        if any(p.logit_bias for p in params):
            bias_rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
            ids = [t for p in params for t in p.logit_bias]
            bias = torch.tensor(
                [b for p in params for b in p.logit_bias.values()], dtype=torch.float32
            )
            self.logit_bias = torch.zeros(
                len(params), vocab_size, dtype=torch.float32, device=device
            )
            self.logit_bias.index_put_(
                (as_tensor(bias_rows), as_tensor(ids)), bias.to(device, non_blocking=True)
            )

        min_rows: list[int] = []
        min_ids: list[int] = []
        for i, (req, p) in enumerate(zip(reqs, params)):
            if len(req.output_ids) < p.min_new_tokens:
                forbidden = (
                    set(p.stop_token_ids)
                    if p.ignore_eos
                    else set(p.stop_token_ids) | set(eos_token_ids)
                )
                min_rows += [i] * len(forbidden)
                min_ids += sorted(forbidden)
        if min_ids:
            self.min_tokens_rows = as_tensor(min_rows)
            self.min_tokens_ids = as_tensor(min_ids)

        seeds = {i: p.seed for i, p in enumerate(params) if p.seed is not None}
        if seeds:
            self.seeded_rows = as_tensor(list(seeds))
            self.sampling_seeds = as_tensor(list(seeds.values()))
            self.seed_steps = as_tensor([len(reqs[i].output_ids) for i in seeds])

    @property
    def has_logits_bias(self) -> bool:
        """Whether `apply_logits_bias` would change anything."""
        return (
            self.repetition_penalties is not None
            or self.frequency_penalties is not None
            or self.logit_bias is not None
            or self.vocab_mask is not None
            or self.min_tokens_rows is not None
        )

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Everything that edits float32 logits `[B, V]` in place before temperature:
        penalties (multiplicative repetition before the additive ones, as vLLM), then
        logit_bias (after the penalties, as SGLang), then the grammar and min-tokens masks,
        last so that nothing can lift a forbidden token back from -inf."""
        if self.repetition_penalties is not None and self.seen_token_mask is not None:
            apply_repetition_penalty(logits, self.seen_token_mask, self.repetition_penalties)
        if (
            self.frequency_penalties is not None
            and self.presence_penalties is not None
            and self.output_token_counts is not None
        ):
            apply_frequency_presence_penalties(
                logits, self.output_token_counts, self.frequency_penalties, self.presence_penalties
            )
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
        if self.vocab_mask is not None:
            apply_vocab_mask(logits, self.vocab_mask)
        if self.min_tokens_rows is not None and self.min_tokens_ids is not None:
            self._forbid_min_tokens_stops(logits)

    def _forbid_min_tokens_stops(self, logits: torch.Tensor) -> None:
        """Forbid the stop tokens of rows still under min_new_tokens, except in a row whose
        grammar allows nothing else: a grammar that only its stop token can continue has
        ended, and its end is a hard constraint where min_new_tokens is a wish (else every
        token of the row would be -inf and the draw meaningless)."""
        rows, ids = self.min_tokens_rows, self.min_tokens_ids
        assert rows is not None and ids is not None
        kept = logits[rows, ids]
        logits[rows, ids] = float("-inf")
        if self.vocab_mask is not None:
            nothing_left = torch.isneginf(logits).all(dim=-1)
            logits[rows, ids] = torch.where(nothing_left[rows], kept, float("-inf"))


@dataclass(frozen=True)
class SamplingRows:
    """Each request's sampling parameters as host arrays, one row per request.

    Why: the running batch keeps these from step to step and, when requests join or
    leave, concatenates or filters them with one index op per field rather than reading
    every request's `SamplingParams` again (SGLang's `filter_batch` / `merge_batch`). A
    greedy row has temperature 1, top-p 1, top-k `vocab_size` and min-p 0 (see
    `SamplingBatchInfo`).
    """

    temperatures: torch.Tensor  # [B] float32
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    logprobs: torch.Tensor  # [B] bool
    top_logprobs_nums: torch.Tensor  # [B] int64
    needs_req_state: torch.Tensor  # [B] bool: penalties, logit_bias, min-tokens or a seed

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int) -> SamplingRows:
        def row(p: SamplingParams) -> tuple[float | int | bool, ...]:
            greedy = p.is_greedy
            return (
                1.0 if greedy else p.temperature,
                1.0 if greedy else p.top_p,
                vocab_size if greedy or p.top_k == -1 else min(p.top_k, vocab_size),
                0.0 if greedy else p.min_p,
                greedy,
                p.frequency_penalty,
                p.presence_penalty,
                p.repetition_penalty,
                p.logprobs,
                p.top_logprobs_num,
                bool(
                    p.frequency_penalty
                    or p.presence_penalty
                    or p.repetition_penalty != 1.0
                    or p.logit_bias
                    or p.min_new_tokens
                    or p.seed is not None
                ),
            )

        columns = list(zip(*map(row, params))) if params else [()] * len(_ROW_DTYPES)
        return cls(*(torch.tensor(c, dtype=dtype) for c, dtype in zip(columns, _ROW_DTYPES)))

    def __len__(self) -> int:
        return len(self.temperatures)

    def select(self, index: torch.Tensor) -> SamplingRows:
        """The rows at `index` (int64, host), in that order."""
        return SamplingRows(*(getattr(self, f.name).index_select(0, index) for f in fields(self)))

    def cat(self, other: SamplingRows) -> SamplingRows:
        return SamplingRows(
            *(torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self))
        )


_ROW_DTYPES = (
    torch.float32,
    torch.float32,
    torch.int64,
    torch.float32,
    torch.bool,
    torch.float32,
    torch.float32,
    torch.float32,
    torch.bool,
    torch.int64,
    torch.bool,
)
"""`SamplingRows`' field dtypes, in field order."""
