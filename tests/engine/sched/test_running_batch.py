"""The running batch's per-request arrays equal a rebuild from its requests after every
turn — through admission, finish, abort, retraction, chunked and mixed prefill and
jump-forward — and the overlap loop decodes the normal loop's greedy tokens meanwhile."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.api import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req
from engine.sched.scheduler import Scheduler


def assert_idle_and_leak_free(engine: Engine) -> None:
    scheduler = engine.scheduler
    scheduler.run_event_loop(lambda: scheduler.in_flight is None)  # overlap: a wasted decode
    assert not scheduler.has_work() and not scheduler.running
    scheduler.running.check_consistent()
    cache = scheduler.cache_manager
    cache.check_integrity()
    allocator = cache.allocator
    assert allocator.available_size() + cache.tree_cache.evictable_size() == allocator.size


def random_prompts(n: int, seed: int, low: int = 4, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(low, high))] for _ in range(n)]


TIGHT = dict(
    max_total_tokens=600,
    chunked_prefill_size=48,
    enable_mixed_chunk=True,
    max_running_requests=10,
)
"""A pool that forces retractions, prefills cut into chunks, decodes riding along."""


def run_checked(
    scheduler: Scheduler, reqs: list[Req], at_turn: Callable[[int], None] = lambda n: None
) -> None:
    """Run until `reqs` finish, checking the running batch against its requests each turn."""
    turns = itertools.count()

    def send_outputs(outputs: list[Req]) -> None:
        scheduler.running.check_consistent()

    scheduler.run_event_loop(
        lambda: all(r.finished for r in reqs), lambda: at_turn(next(turns)), send_outputs
    )


def greedy_reqs(prompts: list[list[int]], prefix: str) -> list[Req]:
    return [
        Req(
            f"{prefix}{i}",
            p,
            SamplingParams(max_new_tokens=90 + 15 * (i % 5), temperature=0, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]


def test_overlap_decodes_the_normal_loops_tokens_through_retraction_and_chunking(make_engine):
    prompts = random_prompts(16, seed=21, low=5, high=60)
    results = {}
    for overlap in (False, True):
        engine = make_engine(disable_overlap_schedule=not overlap, **TIGHT)
        scheduler = engine.scheduler
        reqs = greedy_reqs(prompts, "g")
        for req in reqs[:6]:
            scheduler.add_request(req)

        def arrive(turn: int, scheduler: Scheduler = scheduler, reqs: list[Req] = reqs) -> None:
            if turn == 4:
                for req in reqs[6:]:
                    scheduler.add_request(req)

        run_checked(scheduler, reqs, arrive)
        assert scheduler.stats.num_retractions > 0
        assert scheduler.stats.forward_modes.get("mixed", 0) > 0
        results[overlap] = [r.output_ids for r in reqs]
        assert_idle_and_leak_free(engine)
    assert results[True] == results[False]


@pytest.mark.parametrize("overlap", [False, True])
def test_arrays_follow_mixed_sampling_parameters_finishes_and_aborts(make_engine, overlap):
    engine = make_engine(disable_overlap_schedule=not overlap, **TIGHT)
    scheduler = engine.scheduler
    variants = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, top_k=20, seed=3),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.7, repetition_penalty=1.2, logprobs=True, top_logprobs_num=2),
        dict(temperature=0, min_new_tokens=5, logit_bias={7: 2.0}),
    ]
    reqs = [
        Req(
            f"s{i}",
            p,
            SamplingParams(max_new_tokens=10 + 7 * (i % 6), ignore_eos=True, **variants[i % 6]),
        )
        for i, p in enumerate(random_prompts(18, seed=22, low=5, high=80))
    ]
    for req in reqs:
        scheduler.add_request(req)

    def abort_some(turn: int) -> None:
        if turn == 6:
            for req in list(scheduler.running)[:2] + scheduler.prefill.waiting[:1]:
                scheduler.abort_request(req.rid)

    run_checked(scheduler, reqs, abort_some)
    assert sum(r.lifecycle.finished_reason.type == "abort" for r in reqs) == 3
    assert_idle_and_leak_free(engine)


def test_a_stale_array_is_caught(make_engine):
    engine = make_engine()
    scheduler = engine.scheduler
    reqs = greedy_reqs(random_prompts(3, seed=23), "x")
    for req in reqs:
        scheduler.add_request(req)
    scheduler.run_event_loop(lambda: len(scheduler.running) == 3 and not scheduler.prefill.waiting)
    scheduler.running.check_consistent()
    reqs[1].kv.allocated_len += 1
    with pytest.raises(AssertionError, match="seq_lens"):
        scheduler.running.check_consistent()
    reqs[1].kv.allocated_len -= 1
    reqs[2].sampling_params.temperature = 0.5
    with pytest.raises(AssertionError, match="temperatures"):
        scheduler.running.check_consistent()


def test_arrays_follow_jump_forward(tiny_llama_dir: Path):
    schema = (
        '{"type": "object", "properties": {"name": {"const": "radixserve engine"}, '
        '"n": {"type": "integer"}}, "required": ["name", "n"]}'
    )
    with Engine(
        str(tiny_llama_dir),
        dtype="float64",
        device="cpu",
        max_total_tokens=4096,
        enable_jump_forward=True,
        disable_overlap_schedule=False,
    ) as engine:
        scheduler = engine.scheduler
        reqs = [
            Req(f"j{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=24, json_schema=schema))
            if i % 2
            else Req(f"j{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=24, temperature=0))
            for i in range(6)
        ]
        for req in reqs:
            scheduler.add_request(req)
        run_checked(scheduler, reqs)
        assert scheduler.stats.jump_forwards > 0
        scheduler.run_event_loop(lambda: scheduler.in_flight is None)
        scheduler.cache_manager.check_integrity()
