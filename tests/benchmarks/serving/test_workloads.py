"""Workloads are deterministic and share exactly the prefixes they claim to share."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.serving.workloads import (
    FIRST_TOKEN_ID,
    FIXED_CONCURRENCY,
    WORKLOADS,
    WorkloadConfig,
    build,
    fixed_length,
    warmup_prompt,
)

SMALL = WorkloadConfig(
    requests=12,
    output_len=5,
    vocab_size=1000,
    groups=3,
    system_len=40,
    question_len=6,
    turns=3,
    user_len=7,
    shots=4,
    shot_len=5,
    random_len=30,
    stream_requests=3,
    stream_prompt_len=20,
    stream_output_len=9,
    long_prompt_len=50,
    long_prompt_repeats=2,
)
OUTPUT_LEN = {"single-stream": 9, "long-prompt": 1}
"""The workloads whose output length is their own, not `output_len`."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_same_config_builds_the_same_requests_whatever_was_built_before(name: str):
    first = build(name, SMALL)
    for other in WORKLOADS:
        build(other, SMALL)
    assert build(name, SMALL) == first
    assert build(name, dataclasses.replace(SMALL, seed=1)) != first


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_request_asks_for_its_workloads_output_len_from_ordinary_ids(name: str):
    for request in build(name, SMALL):
        assert request.output_len == OUTPUT_LEN.get(name, SMALL.output_len)
        assert all(FIRST_TOKEN_ID <= t < SMALL.vocab_size for t in request.prompt)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    requests = build("shared-prefix", SMALL)
    assert len(requests) == 12 and all(len(r.prompt) == 40 + 6 for r in requests)
    systems = {tuple(r.prompt[:40]) for r in requests}
    assert len(systems) == 3
    for a in requests:
        for b in requests:
            if a is not b:
                shared = common_prefix(a.prompt, b.prompt)
                assert shared >= 40 if a.prompt[:40] == b.prompt[:40] else shared < 40


def test_shared_prefix_interleaves_groups():
    groups = [tuple(r.prompt[:40]) for r in build("shared-prefix", SMALL)]
    assert groups != sorted(groups, key=groups.index)


def test_multi_turn_resends_the_history_and_waits_for_the_previous_turn():
    requests = build("multi-turn", SMALL)
    conversations = 12 // 3
    assert len(requests) == 12
    for i, request in enumerate(requests):
        turn = i // conversations
        assert len(request.prompt) == turn * (7 + 5) + 7
        if turn == 0:
            assert request.after is None
        else:
            previous = requests[request.after]
            assert request.after == i - conversations
            assert request.prompt[: len(previous.prompt)] == previous.prompt
            assert len(request.prompt) == len(previous.prompt) + 5 + 7


def test_few_shot_requests_share_one_exemplar_block():
    requests = build("few-shot", SMALL)
    block = requests[0].prompt[:20]
    assert all(r.prompt[:20] == block and len(r.prompt) == 20 + 6 for r in requests)
    assert len({tuple(r.prompt[20:]) for r in requests}) == len(requests)


def test_random_prompts_have_lengths_in_range_and_share_nothing_long():
    requests = build("random", SMALL)
    assert all(15 <= len(r.prompt) <= 30 for r in requests)
    assert len({len(r.prompt) for r in requests}) > 1
    assert (
        max(common_prefix(a.prompt, b.prompt) for a in requests for b in requests if a is not b) < 3
    )


def test_single_stream_sends_unique_prompts_of_one_length_one_at_a_time():
    requests = build("single-stream", SMALL)
    assert [len(r.prompt) for r in requests] == [20] * 3
    assert (
        max(common_prefix(a.prompt, b.prompt) for a in requests for b in requests if a is not b) < 3
    )
    assert FIXED_CONCURRENCY["single-stream"] == 1


def test_long_prompt_asks_one_token_of_prompts_no_cache_can_serve():
    requests = build("long-prompt", SMALL)
    assert [(len(r.prompt), r.output_len) for r in requests] == [(50, 1)] * 2
    assert common_prefix(requests[0].prompt, requests[1].prompt) < 3
    assert FIXED_CONCURRENCY["long-prompt"] == 1


def test_fixed_length_prompts_are_unique_and_exactly_that_long():
    requests = fixed_length(SMALL, 4, 25)
    assert [len(r.prompt) for r in requests] == [25] * 4
    assert len({tuple(r.prompt) for r in requests}) == 4
    assert fixed_length(SMALL, 4, 25) == requests


def test_the_warmup_prompt_shares_no_prefix_with_the_workloads():
    warmup = warmup_prompt(SMALL)
    for name in WORKLOADS:
        assert all(common_prefix(warmup, r.prompt) < 3 for r in build(name, SMALL))


def test_workload_flags_round_trip():
    import argparse

    parser = argparse.ArgumentParser()
    WorkloadConfig().add_flags(parser)
    args = parser.parse_args(["--system-len", "99", "--requests", "3"])
    assert WorkloadConfig().from_flags(args) == WorkloadConfig(system_len=99, requests=3)
