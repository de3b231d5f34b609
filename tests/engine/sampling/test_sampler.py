"""The sampler draws only from the filtered set, all of it, in the right proportions;
greedy is argmax; seeds reproduce wherever the request sits in the batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.sampling import sampler
from engine.sampling.sampler import Sampler, SamplerOutput, apply_top_k_top_p_min_p, seeded_uniform
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import (
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SAMPLING_EPS,
    SamplingParams,
)

MakeInfo = Callable[..., SamplingBatchInfo]
DRAWS = 8000


def sample(
    make_info: MakeInfo, logits: torch.Tensor, params: list[SamplingParams], **state: Any
) -> SamplerOutput:
    """One sampler step over `logits` for requests with these params and `make_info` state."""
    return Sampler()(logits, make_info(params, logits.shape[1], **state))


def draw_counts(
    make_info: MakeInfo, probs: list[float], params: SamplingParams, draws: int = DRAWS
) -> torch.Tensor:
    """How often each token is drawn from `draws` copies of one row (a batch of `draws` rows)."""
    logits = torch.tensor(probs).log().repeat(draws, 1)
    tokens = sample(make_info, logits, [params] * draws).next_token_ids
    return torch.bincount(tokens, minlength=len(probs))


def assert_follows(counts: torch.Tensor, expected: list[float]) -> None:
    """Drawn exactly the tokens with nonzero probability, each within 5 sigma of its share."""
    draws = int(counts.sum())
    assert (counts > 0).tolist() == [p > 0 for p in expected], (
        f"drew {counts.tolist()}, expected {expected}"
    )
    for token, (count, p) in enumerate(zip(counts.tolist(), expected)):
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(count - draws * p) <= 5 * sigma + 1, (
            f"token {token}: {count} draws, expected {draws * p:.0f}"
        )


def normalised(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(
    ("probs", "params", "expected"),
    [
        pytest.param([0.5, 0.3, 0.2], SamplingParams(), [0.5, 0.3, 0.2], id="plain"),
        pytest.param(
            [0.05, 0.3, 0.1, 0.25, 0.2, 0.1],
            SamplingParams(top_k=3),
            normalised([0, 0.3, 0, 0.25, 0.2, 0]),
            id="top_k",
        ),
        pytest.param([0.5, 0.3, 0.2], SamplingParams(top_k=1), [1.0, 0, 0], id="top_k_1"),
        pytest.param(
            [0.2, 0.05, 0.4, 0.3, 0.05],
            SamplingParams(top_p=0.8),  # 0.4 + 0.3 < 0.8, so 0.2 is needed; 0.9 >= 0.8 is enough
            normalised([0.2, 0, 0.4, 0.3, 0]),
            id="top_p",
        ),
        pytest.param(
            [0.5, 0.25, 0.125, 0.125],  # powers of two: float32 softmax and cumsum are exact
            SamplingParams(
                top_p=0.75
            ),  # the smallest set whose mass reaches top_p, as in Hugging Face
            normalised([0.5, 0.25, 0, 0]),
            id="top_p_reached_exactly",
        ),
        pytest.param(
            [0.1, 0.22, 0.5, 0.18],
            # top-k keeps mass 0.9; top-p then needs 0.75 of it (0.675): 0.5 + 0.22 already has it.
            # Without renormalising after top-k, 0.72 < 0.75 would keep the 0.18 token too.
            SamplingParams(top_k=3, top_p=0.75),
            normalised([0, 0.22, 0.5, 0]),
            id="top_p_after_top_k",
        ),
        pytest.param(
            [0.06, 0.5, 0.04, 0.3, 0.1],
            SamplingParams(min_p=0.15),  # keeps p >= 0.075
            normalised([0, 0.5, 0, 0.3, 0.1]),
            id="min_p",
        ),
        pytest.param(
            [0.5, 0.3, 0.2],
            SamplingParams(temperature=0.5, min_p=0.2),  # p**2 is .25, .09, .04: keeps >= .05
            normalised([0.25, 0.09, 0]),
            id="temperature_before_min_p",
        ),
        pytest.param(
            [0.64, 0.36],
            SamplingParams(temperature=2.0),
            normalised([0.8, 0.6]),
            id="temperature_2",
        ),
    ],
)
def test_draws_only_and_all_of_the_filtered_set_in_proportion(
    make_info: MakeInfo, probs: list[float], params: SamplingParams, expected: list[float]
) -> None:
    assert_follows(draw_counts(make_info, probs, params), expected)


PROBS = [0.4, 0.3, 0.2, 0.06, 0.04]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param(
            [
                SamplingParams(top_k=1),
                SamplingParams(),
                SamplingParams(top_p=0.5),
                SamplingParams(min_p=0.6),
            ],
            [
                [1.0, 0, 0, 0, 0],
                PROBS,
                normalised([0.4, 0.3, 0, 0, 0]),
                normalised([0.4, 0.3, 0, 0, 0]),
            ],
            id="full_sort",
        ),
        pytest.param(
            # The filters look at the top 3 only; rows without top-k must keep the rest.
            [
                SamplingParams(top_k=2),
                SamplingParams(),
                SamplingParams(top_k=3, top_p=0.7),
                SamplingParams(min_p=0.1),
            ],
            [
                normalised([0.4, 0.3, 0, 0, 0]),
                PROBS,
                normalised([0.4, 0.3, 0, 0, 0]),
                normalised(PROBS[:4] + [0]),
            ],
            id="partial_sort",
        ),
    ],
)
def test_each_row_uses_its_own_filters(
    make_info: MakeInfo, params: list[SamplingParams], expected: list[list[float]]
) -> None:
    """`PROBS` and `expected` list tokens by falling probability; the vocabulary shuffles them."""
    order = [3, 1, 4, 0, 2]
    logits = torch.empty(5)
    logits[order] = torch.tensor(PROBS).log()
    tokens = sample(make_info, logits.repeat(DRAWS, 1), params * (DRAWS // 4)).next_token_ids.view(
        -1, 4
    )
    for column, row_expected in enumerate(expected):
        assert_follows(torch.bincount(tokens[:, column], minlength=5)[order], row_expected)


def test_top_p_one_keeps_a_tail_that_float_rounding_absorbs(make_info: MakeInfo) -> None:
    """Tokens of probability 2e-8 vanish in a float32 cumsum near 1; with top_p = 1 in a batch
    where another row uses top-p, they must still be candidates."""
    vocab_size = 100_000
    probs = torch.full((2, vocab_size), 2e-8)
    probs[:, 0] = 1 - (vocab_size - 1) * 2e-8
    apply_top_k_top_p_min_p(
        probs, make_info([SamplingParams(), SamplingParams(top_p=0.5)], vocab_size)
    )
    assert bool((probs[0] > 0).all())
    assert (probs[1] > 0).sum().item() == 1


@pytest.mark.parametrize(("uniform", "token"), [(0.0, 1), (1.0, 3)])
def test_draw_at_either_end_of_the_unit_interval_skips_removed_tokens(
    make_info: MakeInfo, monkeypatch: pytest.MonkeyPatch, uniform: float, token: int
) -> None:
    """u = 0 must not pick a removed first token, nor u -> 1 run past the last kept one."""
    fixed = torch.tensor([uniform], dtype=torch.float64)
    monkeypatch.setattr(sampler, "seeded_uniform", lambda seeds, steps: fixed)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    info = make_info([SamplingParams(seed=1)], 5)
    assert sampler._sample_from_probs(probs, info).tolist() == [token]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_zero_is_argmax_bit_for_bit(make_info: MakeInfo, dtype: torch.dtype) -> None:
    logits = torch.randn(64, 5000).to(dtype)
    logits[::3, [17, 4000, 4999]] = 10.0  # ties: the first largest index wins, as in argmax
    logits[1::3, [3000, 9]] = 10.0
    all_greedy = sample(make_info, logits, [SamplingParams(temperature=0.0)] * 64).next_token_ids
    assert torch.equal(all_greedy, logits.argmax(dim=-1))
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05),
    ]
    tokens = sample(make_info, logits, mixed * 32).next_token_ids
    assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1))


def test_logits_of_the_caller_are_not_modified(make_info: MakeInfo) -> None:
    logits = torch.randn(4, 50)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.5, top_k=5, repetition_penalty=1.5, logit_bias={3: 5.0}, logprobs=True
    )
    sample(make_info, logits, [params] * 4, outputs=[[1, 2]] * 4)
    assert torch.equal(logits, before)


def test_logprobs_are_of_the_tempered_distribution_before_the_filters(make_info: MakeInfo) -> None:
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs_num=4),
        SamplingParams(temperature=0.5, top_k=1, logprobs=True, top_logprobs_num=4),
        SamplingParams(temperature=2.0, logprobs=True),
    ]
    out = sample(make_info, logits, params)
    expected = torch.log_softmax(logits / torch.tensor([[1.0], [0.5], [2.0]]), dim=-1)
    torch.testing.assert_close(
        out.next_token_logprobs, expected.gather(1, out.next_token_ids[:, None]).squeeze(1)
    )
    top = expected.topk(4, dim=-1)
    torch.testing.assert_close(out.next_token_top_logprobs_val, top.values)
    assert torch.equal(out.next_token_top_logprobs_idx, top.indices)
    assert sample(make_info, logits, [SamplingParams()] * 3).next_token_logprobs is None


def test_logprobs_of_forbidden_tokens_are_finite(make_info: MakeInfo) -> None:
    params = SamplingParams(logprobs=True, top_logprobs_num=3)
    info = make_info([params], 3)
    info.vocab_mask = torch.tensor([[0b110]], dtype=torch.int32)  # the grammar forbids token 0
    out = Sampler()(torch.tensor([[5.0, 0.0, -math.inf]]), info)
    assert out.next_token_ids.tolist() == [1]
    assert out.next_token_top_logprobs_idx.tolist() == [[1, 0, 2]]
    assert out.next_token_top_logprobs_val[0, 1:].tolist() == [torch.finfo(torch.float32).min] * 2


def test_row_with_every_token_forbidden_still_yields_an_in_range_id(make_info: MakeInfo) -> None:
    params = [
        SamplingParams(top_p=0.9, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    out = sample(make_info, torch.full((2, 8), -math.inf), params)
    assert all(0 <= t < 8 for t in out.next_token_ids.tolist())


def test_logit_bias_minus_100_forbids_and_plus_100_forces(make_info: MakeInfo) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    forbid_0, force_3 = (
        SamplingParams(logit_bias={0: -100.0}),
        SamplingParams(logit_bias={3: 100.0}),
    )
    assert_follows(draw_counts(make_info, probs, forbid_0), normalised([0, 0.3, 0.15, 0.05]))
    assert_follows(draw_counts(make_info, probs, force_3), [0, 0, 0, 1.0])
    greedy_forbid_0 = SamplingParams(temperature=0.0, logit_bias={"0": -100.0})
    assert sample(
        make_info, torch.tensor([probs]).log(), [greedy_forbid_0]
    ).next_token_ids.tolist() == [1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_masks_eos_and_stop_ids_until_reached(
    make_info: MakeInfo, temperature: float
) -> None:
    eos, stop = 0, 1
    logits = torch.tensor([[10.0, 9.0, 0.0, 0.0]]).repeat(DRAWS, 1)
    params = SamplingParams(temperature=temperature, min_new_tokens=3, stop_token_ids=[stop])
    for generated in range(4):
        info = make_info(
            [params] * DRAWS, 4, outputs=[[2] * generated] * DRAWS, eos_token_ids=[eos]
        )
        tokens = set(Sampler()(logits, info).next_token_ids.tolist())
        if generated < 3:
            assert tokens.isdisjoint({eos, stop}), (
                f"EOS or stop id sampled after {generated} tokens"
            )
        else:
            assert eos in tokens


def test_min_new_tokens_with_ignore_eos_masks_only_stop_ids(make_info: MakeInfo) -> None:
    logits = torch.tensor([[9.0, 10.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sample(make_info, logits, [params], eos_token_ids=[0]).next_token_ids.tolist() == [0]


def test_vocab_mask_forbids_everything_not_allowed(make_info: MakeInfo) -> None:
    vocab_size, allowed = 100, [3, 31, 32, 63, 99]  # both ends of a word, sign bit included
    words = [0] * 4
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    bitmask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    logits = torch.zeros(DRAWS, vocab_size)
    logits[:, 50] = 20.0  # the favourite is not allowed
    info = make_info([SamplingParams(), SamplingParams(temperature=0.0)] * (DRAWS // 2), vocab_size)
    info.vocab_mask = bitmask.repeat(DRAWS, 1)
    tokens = Sampler()(logits, info).next_token_ids
    assert set(tokens[0::2].tolist()) == set(allowed)
    assert set(tokens[1::2].tolist()) == {3}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_only_its_stop_token_continues_ends_before_min_new_tokens(
    make_info: MakeInfo, temperature: float
) -> None:
    eos, vocab_size = 7, 32
    logits = torch.zeros(2, vocab_size)
    logits[:, 5] = 10.0
    params = SamplingParams(temperature=temperature, min_new_tokens=5)
    info = make_info([params] * 2, vocab_size, outputs=[[2]] * 2, eos_token_ids=[eos])
    # Row 0's grammar has ended (EOS alone allowed); row 1's still allows EOS and token 5.
    info.vocab_mask = torch.tensor([[1 << eos], [(1 << eos) | (1 << 5)]], dtype=torch.int32)
    assert Sampler()(logits, info).next_token_ids.tolist() == [eos, 5]


def test_seeded_request_draws_the_same_tokens_alone_or_anywhere_in_any_batch(
    make_info: MakeInfo,
) -> None:
    vocab_size, steps = 256, 24
    target_logits = torch.randn(vocab_size)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    neighbours = [
        SamplingParams(seed=7),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
    ]

    def generate(seed_params: SamplingParams, batch_size: int) -> list[int]:
        output: list[int] = []
        for step in range(steps):
            position = step % batch_size
            logits = torch.randn(batch_size, vocab_size)
            logits[position] = target_logits
            params = [neighbours[(position + i) % 4] for i in range(batch_size)]
            params[position] = seed_params
            outputs = [[0] * step for _ in range(batch_size)]
            outputs[position] = output
            token = sample(make_info, logits, params, outputs=outputs).next_token_ids[position]
            output = output + [int(token)]
        return output

    alone = generate(target, 1)
    assert generate(target, 5) == alone
    assert generate(target, 8) == alone
    assert len(set(alone)) > steps // 2, (
        "a seeded request should still sample, not repeat one token"
    )
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=1235)
    assert generate(other_seed, 1) != alone


def test_seeded_draws_follow_the_distribution_across_seeds_and_across_steps(
    make_info: MakeInfo,
) -> None:
    probs = [0.4, 0.3, 0.2, 0.08, 0.02]
    logits = torch.tensor(probs).log().repeat(DRAWS, 1)
    across_seeds = [SamplingParams(seed=s) for s in range(DRAWS)]
    tokens = sample(make_info, logits, across_seeds).next_token_ids
    assert_follows(torch.bincount(tokens, minlength=5), probs)
    across_steps = [SamplingParams(seed=42)] * DRAWS
    tokens = sample(
        make_info, logits, across_steps, outputs=[[0] * step for step in range(DRAWS)]
    ).next_token_ids
    assert_follows(torch.bincount(tokens, minlength=5), probs)


def test_seeded_uniform_is_the_splitmix64_stream_of_the_mixed_seed() -> None:
    """A pure-Python SplitMix64 pins the int64 tensor arithmetic (wrapping products, logical
    shifts)."""
    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix64(z: int) -> int:
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        return z ^ (z >> 31)

    for seed in (0, 1, 2**63 - 1, 987654321):
        state, expected = mix64(seed), []
        for _ in range(50):
            state = (state + gamma) & mask
            expected.append((mix64(state) >> 11) * 2.0**-53)
        steps = torch.arange(50)
        assert seeded_uniform(torch.full_like(steps, seed), steps).tolist() == expected


EDGE_PARAMS = [
    SamplingParams(temperature=MAX_TEMPERATURE, logprobs=True, top_logprobs_num=4),
    SamplingParams(temperature=SAMPLING_EPS, logprobs=True, top_logprobs_num=4),
    SamplingParams(temperature=0.0, repetition_penalty=MIN_REPETITION_PENALTY, logprobs=True),
    SamplingParams(temperature=SAMPLING_EPS, repetition_penalty=MIN_REPETITION_PENALTY),
    SamplingParams(repetition_penalty=2.0, frequency_penalty=-2.0, presence_penalty=2.0),
    SamplingParams(logit_bias={0: 100.0, 1: 100.0, 2: -100.0}, logprobs=True, top_logprobs_num=3),
    SamplingParams(top_p=5e-324, top_k=1, min_p=1.0, logprobs=True),
    SamplingParams(top_p=1e-45, min_p=5e-324, seed=2**63 - 1, logprobs=True),
]
"""Every sampling parameter at the end of its accepted range, with logprobs where they matter."""


def edge_logits(dtype: torch.dtype, vocab_size: int) -> torch.Tensor:
    """Rows of logits at the edges of `dtype`: its largest and smallest values, ties of the
    largest, tiny values, a row of -inf but one token, and an ordinary row."""
    info = torch.finfo(dtype)
    rows = [
        [info.max, info.max, -info.max] + [0.0] * (vocab_size - 3),
        [-info.max] * vocab_size,
        [info.tiny, -info.tiny, 0.0] + [info.tiny] * (vocab_size - 3),
        [-math.inf, 3.0] + [-math.inf] * (vocab_size - 2),
        [float(i % 7) for i in range(vocab_size)],
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_no_accepted_parameters_make_nan_at_the_edges_of_the_logits(
    make_info: MakeInfo, dtype: torch.dtype
) -> None:
    vocab_size = 16
    logits = edge_logits(dtype, vocab_size)
    for params in EDGE_PARAMS:
        rows = len(logits)
        info = make_info([params] * rows, vocab_size, prompts=[[0, 1]] * rows, outputs=[[2]] * rows)
        out = Sampler()(logits, info)
        ids = out.next_token_ids.tolist()
        assert all(0 <= t < vocab_size for t in ids), (params, ids)
        assert ids[3] == 1, f"{params}: drew a forbidden token from the one-token row"
        for values in (out.next_token_logprobs, out.next_token_top_logprobs_val):
            if values is not None:
                assert not values.isnan().any() and not values.isposinf().any(), (params, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_row_with_every_token_forbidden_gives_an_in_range_id_and_finite_logprobs(
    make_info: MakeInfo, dtype: torch.dtype
) -> None:
    params = [
        SamplingParams(top_p=0.9, logprobs=True, top_logprobs_num=2),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs_num=2),
    ]
    info = make_info(params, 8)
    info.vocab_mask = torch.zeros(2, 1, dtype=torch.int32)  # a grammar that allows nothing
    out = Sampler()(torch.randn(2, 8).to(dtype), info)
    assert all(0 <= t < 8 for t in out.next_token_ids.tolist())
    assert out.next_token_logprobs is not None and out.next_token_top_logprobs_val is not None
    assert torch.isfinite(out.next_token_logprobs).all()
    assert torch.isfinite(out.next_token_top_logprobs_val).all()


def test_a_top_p_that_is_zero_in_float32_keeps_the_likeliest_token(make_info: MakeInfo) -> None:
    counts = draw_counts(make_info, [0.2, 0.5, 0.3], SamplingParams(top_p=1e-50), draws=200)
    assert counts.tolist() == [0, 200, 0]
