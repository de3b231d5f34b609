"""Penalties change the logits by exactly the OpenAI / CTRL formulas, row by row."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from engine.sampling.penalties import count_tokens, token_mask
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

MakeInfo = Callable[..., SamplingBatchInfo]


def biased(
    make_info: MakeInfo,
    logits: list[list[float]],
    params: list[SamplingParams],
    **state: list[list[int]],
) -> torch.Tensor:
    """The logits after `SamplingBatchInfo.apply_logits_bias`, for requests with this state."""
    out = torch.tensor(logits, dtype=torch.float32)
    make_info(params, out.shape[1], **state).apply_logits_bias(out)
    return out


def test_count_tokens_and_token_mask_match_a_python_counter() -> None:
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 50, (n,), generator=generator).tolist() for n in (0, 1, 7, 300)]
    counts = count_tokens(rows, 50, torch.device("cpu"))
    expected = torch.zeros(4, 50)
    for i, row in enumerate(rows):
        for token, n in Counter(row).items():
            expected[i, token] = n
    assert torch.equal(counts, expected)
    assert torch.equal(token_mask(rows, 50, torch.device("cpu")), expected > 0)


def test_frequency_and_presence_subtract_count_and_indicator_of_output_tokens(
    make_info: MakeInfo,
) -> None:
    logits = [[1.0, 2.0, -1.0, 0.5, 3.0, 0.0]]
    out = biased(
        make_info,
        logits,
        [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)],
        prompts=[[0, 0, 1]],  # the prompt does not count for OpenAI penalties
        outputs=[[3, 3, 3, 5]],
    )
    # token 3: 0.5 - (0.5 * 3 + 0.25); token 5: 0.0 - (0.5 * 1 + 0.25)
    assert out.tolist() == [[1.0, 2.0, -1.0, -1.25, 3.0, -0.75]]


def test_negative_frequency_and_presence_encourage_repeats(make_info: MakeInfo) -> None:
    params = [SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0)]
    out = biased(make_info, [[0.0, 0.0, 0.0]], params, outputs=[[1, 1]])
    assert out.tolist() == [[0.0, 4.0, 0.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output(
    make_info: MakeInfo,
) -> None:
    logits = [[2.0, -2.0, 1.0, -1.0, 3.0, 0.0]]
    out = biased(
        make_info,
        logits,
        [SamplingParams(repetition_penalty=2.0)],
        prompts=[[0, 1, 0]],
        outputs=[[4, 5]],
    )
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 1.5, 0.0]]


def test_repetition_penalty_below_one_rewards_repeats(make_info: MakeInfo) -> None:
    out = biased(
        make_info, [[2.0, -2.0, 1.0]], [SamplingParams(repetition_penalty=0.5)], prompts=[[0, 1]]
    )
    assert out.tolist() == [[4.0, -1.0, 1.0]]


def test_penalties_apply_per_row_and_leave_neutral_rows_untouched(make_info: MakeInfo) -> None:
    logits = [[1.0, 1.0, 1.0, 1.0]] * 3
    params = [
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5),
    ]
    out = biased(make_info, logits, params, prompts=[[0], [0], [0]], outputs=[[1, 1], [1, 1], [2]])
    assert out.tolist() == [
        [1.0, -1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 1.0],
        [0.5, 1.0, 0.0, 1.0],  # repetition first (1 / 2), then presence on the output token
    ]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.0, seed=3)])
def test_plain_batch_builds_no_penalty_or_bias_tensors(
    make_info: MakeInfo, params: SamplingParams
) -> None:
    info = make_info([params], 10, prompts=[[1, 2]], outputs=[[3]])
    assert (
        info.output_token_counts is None
        and info.seen_token_mask is None
        and info.logit_bias is None
    )
    assert info.min_tokens_ids is None
