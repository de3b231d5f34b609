"""--speculative-algorithm NGRAM in the engine, on the tiny model (float64): greedy output
ids and logprobs equal the plain engine's under batching, radix reuse, chunked and mixed
prefill, retraction, both event loops, stop tokens and lengths mid-draft; drafts are
accepted (the comparison is not vacuous); every KV slot comes back; the adaptive switch
stops a request whose drafts keep failing.

A random model rarely repeats its prompt, so each test runs its batch twice on the
speculative engine: the second time the trie holds the first run's outputs, whose drafts
the target accepts wholesale (the case of a retried or repeated request)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import constants
from engine.api import Engine
from engine.outputs import GenerateResult
from engine.sched.batch import ScheduleBatch
from engine.sched.req import Req
from engine.speculative import draft_manager
from engine.speculative.draft_state import DraftState
from engine.speculative.draft_tree import DraftTree
from engine.speculative.drafter import NgramDrafter
from engine.speculative.ngram import NgramConfig
from engine.speculative.verify import VerifyOutput

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40}
SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a passage of their own, as code edits and quotes do."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.randrange(3, 256) for _ in range(rng.randint(8, 30))]
        noise = [rng.randrange(3, 256) for _ in range(rng.randint(0, 20))]
        out.append(noise + passage + noise[:5] + passage + passage[: rng.randint(1, 6)])
    return out


def answers(results: list[GenerateResult]) -> list[list[int]]:
    return [r.output_ids for r in results]


def kv_idle_and_whole(engine: Engine) -> bool:
    cache = engine.scheduler.cache_manager
    cache.check_integrity()
    free = cache.allocator.available_size() + cache.tree_cache.evictable_size()
    return free == engine.scheduler.max_total_tokens and not engine.scheduler.has_work()


def accepted(engine: Engine) -> int:
    return engine.scheduler.stats.spec_accepted_tokens


def twice(
    spec: Engine, batch: list[list[int]], params: Any
) -> tuple[list[GenerateResult], list[GenerateResult]]:
    """The batch on the speculative engine, then again once the trie has seen it; the
    second run accepts most of its drafts."""
    first = spec.generate(batch, params)
    before = accepted(spec)
    second = spec.generate(batch, params)
    generated = sum(len(r.output_ids) for r in second)
    assert accepted(spec) - before > generated // 3
    return first, second


@pytest.fixture
def pair(make_engine: Callable[..., Engine]) -> Callable[..., tuple[Engine, Engine]]:
    """`pair(**options)`: a plain engine and a speculative one, both with `options`."""

    def make(**options: Any) -> tuple[Engine, Engine]:
        return make_engine(**options), make_engine(**SPEC, **options)

    return make


def test_greedy_ids_and_logprobs_equal_the_plain_engines_in_one_batch(pair):
    plain, spec = pair()
    batch = prompts(12)
    params = {**GREEDY, "logprobs": True, "top_logprobs_num": 2}
    want = plain.generate(batch, params)
    first, got = twice(spec, batch, params)
    assert answers(first) == answers(got) == answers(want)
    for w, g in zip(want, got):
        assert w.meta.output_token_logprobs is not None and g.meta.output_token_logprobs
        torch.testing.assert_close(
            [lp for lp, _ in g.meta.output_token_logprobs],
            [lp for lp, _ in w.meta.output_token_logprobs],
            rtol=0,
            atol=1e-9,
        )
        assert [t for _, t in g.meta.output_token_logprobs] == g.output_ids
        assert [[i for _, i in top] for top in g.meta.output_top_logprobs or []] == [
            [i for _, i in top] for top in w.meta.output_top_logprobs or []
        ]
    verified = [r.meta.spec_verify_ct for r in got]
    assert all(n > 0 for n in verified) and all(r.meta.spec_verify_ct == 0 for r in want)
    assert min(r.meta.spec_accept_length for r in got) > 2.0
    # A request's tokens are its verify passes' tokens, plus its prefill's one and the
    # plain decode steps of turns where no request drafted.
    assert all(len(r.output_ids) >= r.meta.spec_accept_length * r.meta.spec_verify_ct for r in got)
    assert kv_idle_and_whole(spec)


def test_radix_reuse_and_the_overlap_loop_change_nothing(pair):
    plain, spec = pair(disable_overlap_schedule=False)
    batch = prompts(6, seed=1)
    want = answers(plain.generate(batch, GREEDY))
    first, again = twice(spec, batch, GREEDY)
    assert answers(first) == answers(again) == want
    assert all(r.meta.cached_tokens > 0 for r in again)  # every prompt hit the radix tree
    assert kv_idle_and_whole(spec)


def test_accepted_tokens_kv_is_what_a_decode_step_would_have_written(pair):
    """The radix tree keeps a verify pass's K/V in place; a later request whose prompt
    ends inside what earlier passes accepted reuses it, and continues as the plain engine
    continues that prompt."""
    plain, spec = pair()
    batch = prompts(6, seed=7)
    spec.generate(batch, GREEDY)
    spec.scheduler.flush_cache()  # the tree forgets the first run's K/V, the trie keeps its tokens
    second = spec.generate(batch, GREEDY)
    assert min(r.meta.spec_accept_length for r in second) > 2.0
    follow_ups = [ids + r.output_ids[: 3 + i] for i, (ids, r) in enumerate(zip(batch, second))]
    params = {**GREEDY, "max_new_tokens": 12}
    reused = spec.generate(follow_ups, params)
    assert all(r.meta.cached_tokens >= len(ids) - 1 for ids, r in zip(follow_ups, reused))
    plain.scheduler.cache_manager.tree_cache.reset()
    assert answers(reused) == answers(plain.generate(follow_ups, params))


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_and_mixed_prefill(pair, mixed: bool):
    plain, spec = pair(chunked_prefill_size=16, enable_mixed_chunk=mixed)
    batch = prompts(8, seed=2)
    params = [{**GREEDY, "max_new_tokens": 20 + 5 * i} for i in range(len(batch))]
    want = answers(plain.generate(batch, params))
    assert [answers(run) for run in twice(spec, batch, params)] == [want, want]
    assert kv_idle_and_whole(spec)


def test_retraction_drops_drafts_and_keeps_the_tokens(pair):
    plain, spec = pair(max_total_tokens=900)
    batch = prompts(10, seed=3)
    params = {**GREEDY, "max_new_tokens": 60}
    want = answers(plain.generate(batch, params))
    assert [answers(run) for run in twice(spec, batch, params)] == [want, want]
    assert spec.scheduler.stats.num_retractions > 0
    assert kv_idle_and_whole(spec)


def test_stops_and_lengths_mid_draft_end_where_the_plain_engine_ends(pair):
    plain, spec = pair()
    batch = prompts(8, seed=4)
    full = answers(plain.generate(batch, GREEDY))
    # Each request stops at a token from the middle of its plain output, or at a length
    # that a verify pass would overshoot.
    params = [
        {**GREEDY, "stop_token_ids": [out[len(out) // 2]]}
        if i % 2
        else {**GREEDY, "max_new_tokens": 7 + i}
        for i, out in enumerate(full)
    ]
    want = plain.generate(batch, params)
    spec.generate(batch, GREEDY)  # the trie learns the full outputs: drafts run past the stops
    got = spec.generate(batch, params)
    assert answers(got) == answers(want)
    assert [r.meta.finish_reason for r in got] == [r.meta.finish_reason for r in want]
    assert max(r.meta.spec_accept_length for r in got) > 2.0
    assert kv_idle_and_whole(spec)


def test_sampled_requests_run_beside_greedy_ones_and_free_their_kv(pair):
    _, spec = pair()
    batch = prompts(8, seed=5)
    params = [
        {**GREEDY, "temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else GREEDY
        for i in range(len(batch))
    ]
    first, second = twice(spec, batch, params)
    assert answers(second) == answers(first)  # greedy, and seeded sampling: reproducible
    assert all(len(r.output_ids) == 40 for r in second)
    assert kv_idle_and_whole(spec)


def test_penalised_requests_decode_one_token_a_step_beside_drafting_ones(pair):
    plain, spec = pair()
    batch = prompts(4, seed=6)
    params = [{**GREEDY, "frequency_penalty": 0.5} if i % 2 else GREEDY for i in range(4)]
    first, got = twice(spec, batch, params)
    assert answers(first) == answers(got) == answers(plain.generate(batch, params))
    assert all(r.meta.spec_accept_length == 1.0 for r in got[1::2])


def test_a_verify_pass_stays_within_the_row_cap(pair, monkeypatch: pytest.MonkeyPatch):
    """`SPEC_MAX_VERIFY_ROWS` bounds the rows of every verify pass (roots and drafts); a
    batch as large as the cap does not draft at all."""
    monkeypatch.setattr(constants, "SPEC_MAX_VERIFY_ROWS", 10)
    rows: list[int] = []
    verify = draft_manager.prepare_verify

    def spy(*args: Any, **kwargs: Any) -> ScheduleBatch:
        batch = verify(*args, **kwargs)
        rows.append(len(batch.forward_batch.out_cache_loc))
        return batch

    monkeypatch.setattr(draft_manager, "prepare_verify", spy)
    plain, spec = pair()
    for n in (4, 10):
        batch = prompts(n, seed=8)
        want = answers(plain.generate(batch, GREEDY))
        assert [answers(spec.generate(batch, GREEDY)) for _ in range(2)] == [want, want]
    assert rows and max(rows) <= 10
    assert accepted(spec) > 0


def test_speculative_options_are_checked(make_engine):
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        make_engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1)
    with pytest.raises(ValueError, match="speculative_ngram_min_match_window_size"):
        make_engine(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=0)
    with pytest.raises(ValueError, match="attention backend"):
        make_engine(speculative_algorithm="NGRAM", attention_backend="triton")


def decoding(rid: str, pattern: list[int], max_new_tokens: int = 1000) -> Req:
    """A request that repeats `pattern`, one output token in."""
    req = Req(rid, pattern * 10)
    req.sampling_params.max_new_tokens = max_new_tokens
    req.output_ids = pattern[:1]
    return req


def verify_result(trees: list[DraftTree], accepted_drafts: list[int]) -> VerifyOutput:
    tokens = [[0] * (n + 1) for n in accepted_drafts]
    return VerifyOutput(tokens, [list(range(len(t))) for t in tokens], None, None)


def test_adaptive_drafting_pauses_a_request_whose_drafts_fail_and_retries_later():
    manager = NgramDrafter(NgramConfig(), 5, context_len=4096, adaptive=True)
    req = decoding("r", [1, 2, 3, 4])
    paused_at = None
    for step in range(40):
        trees = manager.propose([req], room=100)
        drafting = trees is not None and trees[0].num_drafts > 0
        if not drafting:
            paused_at = step
            break
        manager.on_verified([req], trees, verify_result(trees, [0]))
    assert paused_at is not None and paused_at <= 6  # the warm-up, then the pause
    state = req.draft_state
    assert isinstance(state, DraftState)
    for _ in range(state.paused_until - manager.step - 1):
        assert manager.propose([req], room=100) is None
    trees = manager.propose([req], room=100)
    assert trees is not None and trees[0].num_drafts > 0  # it tries again
    # A request whose drafts pay keeps drafting.
    good = decoding("g", [1, 2, 3, 4])
    for _ in range(30):
        trees = manager.propose([good], room=100)
        assert trees is not None
        manager.on_verified([good], trees, verify_result(trees, [trees[0].num_drafts]))
    # Without adaptive drafting nobody pauses.
    steady = NgramDrafter(NgramConfig(), 5, context_len=4096, adaptive=False)
    bad = decoding("b", [1, 2, 3, 4])
    for _ in range(20):
        trees = steady.propose([bad], room=100)
        assert trees is not None
        steady.on_verified([bad], trees, verify_result(trees, [0]))


def test_drafts_fit_the_room_and_the_length_left():
    manager = NgramDrafter(NgramConfig(), 8, context_len=4096, adaptive=True)
    reqs = [decoding(name, [5, 6, 7, 8, 9], max_new_tokens=100) for name in "abc"]
    trees = manager.propose(reqs, room=10)
    assert trees is not None and sum(t.num_drafts for t in trees) == 10
    reqs[0].sampling_params.max_new_tokens = 3  # two more tokens: one draft, one sampled
    trees = manager.propose(reqs, room=100)
    assert trees is not None and trees[0].num_drafts == 1
