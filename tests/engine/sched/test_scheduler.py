"""The scheduler end to end on a tiny float64 model: continuous batching, radix reuse,
chunked and mixed prefill, the overlap loop, retraction, aborts — and after every
scenario, no KV slot leaked."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from engine.api import Engine
from engine.outputs import GenerateResult
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import FinishReason, Req
from engine.sched.scheduler import Scheduler, after_turns

GREEDY = {"temperature": 0, "ignore_eos": True}


def assert_idle_and_leak_free(engine: Engine) -> None:
    scheduler = engine.scheduler
    # The overlap loop may still hold one wasted decode.
    scheduler.run_event_loop(lambda: scheduler.in_flight is None)
    assert not scheduler.has_work()
    cache = scheduler.cache_manager
    cache.check_integrity()
    allocator = cache.allocator
    assert allocator.available_size() + cache.tree_cache.evictable_size() == allocator.size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


def arrivals(scheduler: Scheduler, at_turn: dict[int, list[Req]]) -> Callable[[], None]:
    """A `recv_requests` that submits `at_turn[n]` at the start of the loop's turn n."""
    turns = itertools.count()

    def recv_requests() -> None:
        for req in at_turn.get(next(turns), []):
            scheduler.add_request(req)

    return recv_requests


def random_prompts(n: int, seed: int, low: int = 4, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(low, high))] for _ in range(n)]


def outputs(results: list[GenerateResult]) -> list[list[int]]:
    return [r.output_ids for r in results]


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_arriving_during_decode_join_the_batch_and_match_running_alone(
    make_engine, overlap
):
    engine = make_engine(disable_overlap_schedule=not overlap)
    prompts = random_prompts(4, seed=1)
    alone = [engine.generate(p, {**GREEDY, "max_new_tokens": 24})[0].output_ids for p in prompts]

    reqs = [
        Req(f"r{i}", p, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    scheduler = engine.scheduler
    scheduler.add_request(reqs[0])
    # Later requests arrive while earlier ones decode.
    recv_requests = arrivals(scheduler, {3: [reqs[1]], 5: [reqs[2]], 9: [reqs[3]]})
    scheduler.run_event_loop(lambda: all(r.finished for r in reqs), recv_requests)
    assert scheduler.stats.forward_modes.get("decode", 0) > 0
    assert [r.output_ids for r in reqs] == alone
    assert_idle_and_leak_free(engine)


def test_cpu_defaults_to_the_normal_loop_which_the_offline_benchmark_measures_faster(make_engine):
    assert not make_engine().scheduler.overlap
    assert make_engine(disable_overlap_schedule=False).scheduler.overlap


def test_second_request_sharing_a_200_token_prefix_reports_the_cached_tokens(make_engine):
    engine = make_engine()
    shared = random_prompts(1, seed=2, low=200, high=200)[0]
    first = engine.generate(shared + [10, 11], {**GREEDY, "max_new_tokens": 4})[0]
    second = engine.generate(shared + [12, 13, 14], {**GREEDY, "max_new_tokens": 4})[0]
    assert first.meta.cached_tokens == 0
    assert second.meta.cached_tokens >= 200
    assert engine.scheduler.stats.cache_hit_tokens == second.meta.cached_tokens
    assert_idle_and_leak_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_lpm_prefills_a_prefix_shared_by_eight_simultaneous_requests_once(make_engine, overlap):
    engine = make_engine(schedule_policy="lpm", disable_overlap_schedule=not overlap)
    shared = random_prompts(1, seed=3, low=300, high=300)[0]
    prompts = [shared + [20 + i, 30 + i] for i in range(8)]
    results = engine.generate(prompts, {**GREEDY, "max_new_tokens": 6})
    prefilled = engine.scheduler.stats.prefill_tokens
    assert prefilled < len(shared) + 8 * 3, (
        f"prefilled {prefilled} tokens: the shared prefix ran more than once"
    )
    assert sum(r.meta.cached_tokens for r in results) >= 7 * len(shared)

    reference = make_engine(disable_radix_cache=True)
    assert outputs(results) == outputs(reference.generate(prompts, {**GREEDY, "max_new_tokens": 6}))
    assert_idle_and_leak_free(engine)


@pytest.mark.parametrize(
    "options",
    [
        {"chunked_prefill_size": 64, "disable_overlap_schedule": False},
        {"chunked_prefill_size": 64, "enable_mixed_chunk": True, "disable_overlap_schedule": False},
        {"chunked_prefill_size": 64, "disable_overlap_schedule": True},
        {"chunked_prefill_size": 64, "enable_mixed_chunk": True, "disable_overlap_schedule": True},
    ],
)
def test_chunked_and_mixed_prefill_match_unchunked_runs(make_engine, options):
    prompts = random_prompts(6, seed=4, low=30, high=300)
    params = {**GREEDY, "max_new_tokens": 12}
    reference = outputs(make_engine(chunked_prefill_size=None).generate(prompts, params))
    engine = make_engine(**options)
    scheduler = engine.scheduler
    reqs = [
        Req(f"c{i}", p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    scheduler.add_request(reqs[0])
    # The rest arrive while the first decodes, so mixed batches can form.
    recv_requests = arrivals(scheduler, {6: reqs[1:]})
    scheduler.run_event_loop(lambda: all(r.finished for r in reqs), recv_requests)
    assert [r.output_ids for r in reqs] == reference
    if options.get("enable_mixed_chunk"):
        assert scheduler.stats.forward_modes.get("mixed", 0) > 0
    assert_idle_and_leak_free(engine)


def test_overlap_loop_matches_the_normal_loop_on_32_random_requests(make_engine):
    rng = random.Random(5)
    prompts = random_prompts(32, seed=5)
    params = [
        {"temperature": 0, "max_new_tokens": rng.randint(1, 40), "ignore_eos": rng.random() < 0.5}
        for _ in prompts
    ]
    normal = make_engine(disable_overlap_schedule=True).generate(prompts, params)
    overlap = make_engine(
        disable_overlap_schedule=False, debug_future_map=True, max_running_requests=12
    )
    assert outputs(overlap.generate(prompts, params)) == outputs(normal)
    assert_idle_and_leak_free(overlap)


def test_poisoned_future_map_stress_with_chunking_retraction_and_sampling(make_engine):
    engine = make_engine(
        disable_overlap_schedule=False,
        debug_future_map=True,
        max_total_tokens=700,
        chunked_prefill_size=48,
        enable_mixed_chunk=True,
        max_running_requests=16,
    )
    prompts = random_prompts(40, seed=6, low=5, high=120)
    params = [
        {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 48, "ignore_eos": True, "seed": i}
        if i % 3
        else {**GREEDY, "max_new_tokens": 48}
        for i in range(40)
    ]
    results = engine.generate(prompts, params)
    assert all(len(r.output_ids) == 48 for r in results)
    assert engine.scheduler.stats.num_retractions > 0
    assert_idle_and_leak_free(engine)


def test_forced_retraction_finishes_everything_identically_and_jumps_the_ratio(make_engine):
    prompts = random_prompts(16, seed=7, low=10, high=30)
    ample = outputs(make_engine().generate(prompts, {**GREEDY, "max_new_tokens": 256}))

    engine = make_engine(max_total_tokens=600, disable_overlap_schedule=True)
    scheduler = engine.scheduler
    reqs = [
        Req(f"t{i}", p, SamplingParams(max_new_tokens=256, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.add_request(req)
    checked = 0
    decoded_before: dict[int, int] = {}
    retractions_before = 0

    def before_turn() -> None:
        nonlocal decoded_before, retractions_before
        decoded_before = {id(r): len(r.output_ids) for r in scheduler.running}
        retractions_before = scheduler.stats.num_retractions

    def after_turn(outputs: list[Req]) -> None:
        nonlocal checked
        if scheduler.stats.num_retractions > retractions_before:
            kept = [r for r in reqs if id(r) in decoded_before and r.kv.req_pool_idx is not None]
            expected = min(
                1.0,
                (sum(decoded_before[id(r)] for r in kept) + 20 * len(kept))
                / (sum(r.sampling_params.max_new_tokens for r in kept) + 1),
            )
            assert scheduler.ratio.new_token_ratio == pytest.approx(expected)
            checked += 1

    scheduler.run_event_loop(lambda: not scheduler.has_work(), before_turn, after_turn)
    assert checked > 0 and scheduler.stats.num_retractions > 0
    assert scheduler.stats.retracted_output_tokens > 0
    assert [r.output_ids for r in reqs] == ample
    assert all(r.lifecycle.finished_reason.type == "length" for r in reqs)
    assert_idle_and_leak_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_request_outgrowing_the_pool_alone_finishes_with_an_error_and_the_rest_finish(
    make_engine, overlap
):
    engine = make_engine(
        max_total_tokens=600, clip_max_new_tokens=64, disable_overlap_schedule=not overlap
    )
    prompts = random_prompts(4, seed=8, low=10, high=20)
    params = [{**GREEDY, "max_new_tokens": 1000}] + [{**GREEDY, "max_new_tokens": 40}] * 3
    results = engine.generate(prompts, params)
    hog = results[0].meta.finish_reason
    assert hog.type == "abort" and "cannot hold" in hog.message
    assert 500 < len(results[0].output_ids) < 600
    assert [r.meta.finish_reason.type for r in results[1:]] == ["length"] * 3
    assert_idle_and_leak_free(engine)


def test_requests_that_can_never_fit_are_rejected_at_submission(make_engine):
    engine = make_engine(max_total_tokens=600)
    with pytest.raises(ValueError, match="KV cache holds 600"):
        engine.generate(list(range(3, 253)) * 3, {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="KV cache holds 600"):
        engine.generate([5, 6, 7], {"max_new_tokens": 1000})
    with pytest.raises(ValueError, match="context length"):
        make_engine(context_length=64).generate(list(range(3, 67)), {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([5, 6, 7], {"top_p": 1.5})
    with pytest.raises(ValueError, match="KV cache holds 600"):
        engine.generate([[5, 6, 7], [8, 9], list(range(3, 253)) * 3], {"max_new_tokens": 4})
    assert not engine.scheduler.has_work(), "the rejected prompt's batch-mates were left queued"
    assert (
        engine.generate([5, 6, 7], {**GREEDY, "max_new_tokens": 3})[0].meta.completion_tokens == 3
    )
    assert_idle_and_leak_free(engine)


def test_max_new_tokens_beyond_the_context_is_capped(make_engine):
    engine = make_engine(context_length=64)
    result = engine.generate(list(range(3, 43)), {**GREEDY, "max_new_tokens": 500})[0]
    assert len(result.output_ids) == 64 - 40
    assert result.meta.finish_reason.type == "length"


@pytest.mark.parametrize("overlap", [False, True])
def test_aborting_waiting_and_running_requests_frees_all_their_slots(make_engine, overlap):
    engine = make_engine(disable_overlap_schedule=not overlap, max_running_requests=2)
    scheduler = engine.scheduler
    reqs = [
        Req(f"a{i}", p, SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))
        for i, p in enumerate(random_prompts(4, seed=9))
    ]
    for req in reqs:
        scheduler.add_request(req)
    scheduler.run_event_loop(after_turns(5))
    assert reqs[0] in scheduler.running and reqs[3] in scheduler.prefill.waiting
    scheduler.abort_request("a0")
    scheduler.abort_request("a3")
    scheduler.run_event_loop(lambda: not scheduler.has_work())
    assert [r.lifecycle.finished_reason.type for r in reqs] == [
        "abort",
        "length",
        "length",
        "abort",
    ]
    assert len(reqs[3].output_ids) == 0
    assert_idle_and_leak_free(engine)


def test_stop_token_ids_and_min_new_tokens(make_engine):
    engine = make_engine()
    prompt = random_prompts(1, seed=10)[0]
    free_run = engine.generate(prompt, {**GREEDY, "max_new_tokens": 20})[0].output_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    stopped = engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_at]}
    )[0]
    assert stopped.output_ids == free_run[: first + 1]
    assert stopped.meta.finish_reason == FinishReason("stop", matched=stop_at)
    late = engine.generate(
        prompt,
        {
            "temperature": 0,
            "max_new_tokens": 20,
            "stop_token_ids": [stop_at],
            "min_new_tokens": first + 2,
        },
    )[0]
    assert len(late.output_ids) > first + 1
    assert_idle_and_leak_free(engine)


def test_logprobs_of_the_chosen_and_top_tokens_are_returned_per_output_token(make_engine):
    engine = make_engine()
    result = engine.generate(
        random_prompts(1, seed=11)[0],
        {**GREEDY, "max_new_tokens": 5, "logprobs": True, "top_logprobs_num": 3},
    )[0]
    meta = result.meta
    assert [t for _, t in meta.output_token_logprobs] == result.output_ids
    for (chosen, token), top in zip(meta.output_token_logprobs, meta.output_top_logprobs):
        assert len(top) == 3 and top[0] == (
            chosen,
            token,
        )  # greedy: the chosen token is the likeliest
        assert chosen <= 0 and top[0][0] >= top[1][0] >= top[2][0]
    assert engine.generate([5, 6], {"max_new_tokens": 2})[0].meta.output_token_logprobs is None
