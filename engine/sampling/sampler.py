"""From logits to next tokens: greedy, temperature, top-k / top-p / min-p, seeded sampling."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from engine.sampling.sampling_batch_info import SamplingBatchInfo


class SamplerOutput(NamedTuple):
    """Device tensors: the caller does the one `.tolist()` when it needs the values."""

    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: torch.Tensor | None  # [B] float32, when any row asks for logprobs
    next_token_top_logprobs_val: (
        torch.Tensor | None
    )  # [B, K] float32, K = the largest top_logprobs_num
    next_token_top_logprobs_idx: torch.Tensor | None  # [B, K] int64


class Sampler(nn.Module):
    """Samples one token per row of a batch with no device sync and no per-token Python.

    Order, per row: `info.apply_logits_bias` (penalties, logit_bias, min-tokens and grammar
    masks), then temperature, then top-k → top-p → min-p (Hugging Face's order: top-p is
    measured on the distribution renormalised after top-k), then one draw. A greedy row takes
    the argmax of the biased logits, bit for bit what `torch.argmax` gives. A seeded row
    draws from a counter-based generator keyed by (seed, output index): see `seeded_uniform`
    for why.

    Logprobs follow SGLang's default: log-softmax of the logits after penalties, biases,
    masks and temperature, before the top-k / top-p / min-p filters — the distribution the
    filters cut from, so a filtered-out candidate in the top-k list still shows its
    probability instead of -inf. (vLLM's default, the raw model logprobs, ignores the
    penalties and the grammar that shaped the choice.) -inf (a forbidden token) and NaN (a
    row whose every token is forbidden) become the float32 minimum, so that every value is
    finite; the services floor what they show (`choice_output.LOGPROB_FLOOR`).
    """

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """`logits` `[B, V]` (any float dtype) is not modified: it is copied only when
        something edits it in place (a bias or mask), never for a plain batch."""
        if info.has_logits_bias:
            logits = logits.to(torch.float32, copy=True)
            info.apply_logits_bias(logits)
        else:
            logits = logits.to(torch.float32)
        if info.is_all_greedy:
            next_token_ids = argmax_rows(logits)
        else:
            # Greedy rows have temperature 1, so their scaled logits are their logits.
            logits = scaled_logits(logits, info.temperatures)
            probs = torch.softmax(logits, dim=-1)
            apply_top_k_top_p_min_p(probs, info)
            sampled = _sample_from_probs(probs, info)
            next_token_ids = torch.where(info.is_greedy, argmax_rows(logits), sampled)
        if not info.return_logprob:
            return SamplerOutput(next_token_ids, None, None, None)
        logprobs = torch.log_softmax(logits, dim=-1).nan_to_num_(
            nan=_FLOAT32_MIN, neginf=_FLOAT32_MIN
        )
        chosen = logprobs.gather(1, next_token_ids.unsqueeze(1)).squeeze(1)
        if not info.top_logprobs_num:
            return SamplerOutput(next_token_ids, chosen, None, None)
        top = logprobs.topk(info.top_logprobs_num, dim=-1)
        return SamplerOutput(next_token_ids, chosen, top.values, top.indices)


_FLOAT32_MIN = torch.finfo(torch.float32).min
_FLOAT32_MAX = torch.finfo(torch.float32).max


def scaled_logits(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`logits / temperatures`, a new tensor, with +inf clamped to float32's largest value.

    Why: a huge logit (the largest bf16 over a small temperature or repetition penalty)
    overflows to +inf, and softmax's inf - inf is NaN; clamped, it is simply the likeliest
    token. -inf, a forbidden token, stays -inf.
    """
    return (logits / temperatures).clamp_(max=_FLOAT32_MAX)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index, as `argmax(dim=-1)` gives it (ties and NaN alike):
    `max` returns the same index and, on CPU, in a half to a tenth of argmax's time over a
    49k vocabulary."""
    return logits.max(dim=-1).indices


def apply_top_k_top_p_min_p(probs: torch.Tensor, info: SamplingBatchInfo) -> None:
    """Zero, in place, the probabilities the filters remove.

    One sort serves top-k and top-p, and only as wide as it must be (`info.sort_width`): a
    partial `topk` of the largest top-k is far cheaper than sorting the vocabulary. Top-p
    keeps the smallest prefix of the sorted, top-k-renormalised distribution whose mass
    reaches `top_p`, and never less than the likeliest token (a tiny `top_p` is 0 in
    float32); a row with `top_p == 1` is exempt, so float rounding in the cumsum can never
    drop its tail. Min-p drops tokens below `min_p` times the largest probability;
    that test is scale-free, so it needs neither the sort nor the renormalisation.
    """
    removed: torch.Tensor | None = None
    width = info.sort_width
    if width:
        if width == probs.shape[-1]:
            sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        else:
            sorted_probs, sorted_ids = probs.topk(width, dim=-1)
        removed_sorted = torch.arange(width, device=probs.device) >= info.top_ks
        if info.need_top_p_sampling:
            cumulative = sorted_probs.cumsum(dim=-1)
            top_k_mass = cumulative.gather(1, info.top_ks.clamp(max=width) - 1)
            mass_before = cumulative - sorted_probs
            removed_sorted |= (mass_before >= info.top_ps * top_k_mass) & (info.top_ps < 1.0)
            removed_sorted[:, 0] = False
        # Past the sorted prefix, a row keeps everything unless its top-k ends inside it.
        removed = (info.top_ks <= width).expand_as(probs).contiguous()
        removed.scatter_(1, sorted_ids, removed_sorted)
    if info.need_min_p_sampling:
        below_min_p = probs < info.min_ps * probs.amax(dim=-1, keepdim=True)
        removed = below_min_p if removed is None else removed | below_min_p
    if removed is not None:
        probs.masked_fill_(removed, 0.0)


_MAX_UNIFORM = 1.0 - 2.0**-52
"""Below this, `u * total` rounds to less than `total` in float64, so the draw stays in range."""


def _sample_from_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """One draw per row from the unnormalised `probs` by inverting its CDF with one uniform.

    Why not the exponential race (argmax of p / Exp(1) noise, as in vLLM): it needs V random
    numbers per row, several times the cost of this float64 cumsum on CPU, and a seeded row
    would need V hashes; `torch.multinomial` syncs on CUDA. The cumsum is float64 so that a
    token keeps its share down to ~1e-16 instead of vanishing below float32's resolution
    near 1. A removed token has zero width in the CDF, so `searchsorted(right=True)` can
    never land on it. Unseeded rows draw from torch's global generator, seeded rows from
    `seeded_uniform`.
    """
    seeded_rows, seeds, steps = info.seeded_rows, info.sampling_seeds, info.seed_steps
    uniform = torch.empty(probs.shape[0], dtype=torch.float64, device=probs.device)
    if seeded_rows is None or len(seeded_rows) < len(uniform):
        uniform.uniform_()
    if seeded_rows is not None and seeds is not None and steps is not None:
        uniform[seeded_rows] = seeded_uniform(seeds, steps)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniform.clamp_(max=_MAX_UNIFORM).unsqueeze(1) * cdf[:, -1:]
    # A row with every token forbidden (grammar and min-tokens disagree) has NaN probs and would
    # land past the end; an in-range id keeps a device-side index assert from killing the server.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 that torch arithmetic takes."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: a bijection on 64-bit words that scatters every input bit."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) float64 per row that is a pure function of (seed, step).

    Why a counter-based generator rather than a `torch.Generator` per request: the draw of
    a seeded row depends on nothing but its seed and the index of the output token being
    sampled, so the request draws the same tokens whatever else is in the batch, wherever it
    sits, after a retraction, or with the overlap scheduler running a step ahead — there is
    no generator state to carry, copy or rewind. It is one batched integer computation for
    all seeded rows (per-row generators need a Python loop and a launch per row), and
    integer arithmetic is exact, so CPU and GPU draw the same numbers.

    Step n of seed s is output n + 1 of SplitMix64 started at `mix64(s)` (mixing the seed
    first keeps nearby seeds from being shifted copies of one stream); its top 53 bits make
    the uniform. int64 products wrap modulo 2**64, as SplitMix64 needs.
    """
    state = _mix64(seeds.to(torch.int64)) + (steps.to(torch.int64) + 1) * _GOLDEN_GAMMA
    return _shift_right(_mix64(state), 11).to(torch.float64) * 2.0**-53
