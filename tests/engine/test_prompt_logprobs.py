"""Prompt logprobs (`logprob_start_len`, `prompt_top_logprobs_num`) and prefill-only requests
(`max_new_tokens` 0) on the tiny Llama: against transformers, across radix hits, chunked and
mixed prefill and both event loops — and after every scenario, no KV slot leaked."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.api import Engine
from engine.model.forward_batch import ForwardMode, PromptLogprobsInput
from engine.model.layers.embedding import VocabParallelEmbedding
from engine.model.layers.logits_processor import LogitsProcessor
from engine.outputs import GenerateMeta
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req

GREEDY = {"temperature": 0, "ignore_eos": True}
PREFILL = {"max_new_tokens": 0, "logprob_start_len": 0}
"""What an evaluation harness sends to score a text: a prefill alone, every prompt logprob."""
TOP = 4


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def assert_idle_and_leak_free(engine: Engine) -> None:
    scheduler = engine.scheduler
    scheduler.run_event_loop(lambda: scheduler.in_flight is None)  # overlap: a wasted decode
    assert not scheduler.has_work()
    cache = scheduler.cache_manager
    cache.check_integrity()
    allocator = cache.allocator
    assert allocator.available_size() + cache.tree_cache.evictable_size() == allocator.size
    assert cache.tree_cache.protected_size() == 0
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


def values(meta: GenerateMeta) -> list[float | None]:
    assert meta.input_token_logprobs is not None
    return [lp for lp, _ in meta.input_token_logprobs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """transformers in float64 on the same weights: log-softmax `[len(prompt), vocab]`, row
    p the distribution of token p + 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)

    return logprobs


@pytest.mark.parametrize("start", [0, 1, 23, 47])
def test_prompt_logprobs_and_their_top_k_match_transformers(make_engine, reference, start):
    engine = make_engine(dtype="float32")
    prompt = prompt_of(48, seed=1)
    meta = engine.generate(
        prompt, {**PREFILL, "logprob_start_len": start, "prompt_top_logprobs_num": TOP}
    )[0].meta
    expected = reference(prompt)

    assert meta.input_token_logprobs is not None and meta.input_top_logprobs is not None
    assert [t for _, t in meta.input_token_logprobs] == prompt[start:]
    assert len(meta.input_top_logprobs) == len(prompt) - start
    for position, (logprob, top) in enumerate(
        zip(values(meta), meta.input_top_logprobs), start=start
    ):
        if position == 0:
            assert logprob is None and top == [], "nothing predicts the first token"
            continue
        row = expected[position - 1]
        assert logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        best = row.topk(TOP)
        assert [t for _, t in top] == best.indices.tolist()
        assert [lp for lp, _ in top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert_idle_and_leak_free(engine)


def test_without_logprob_start_len_there_are_none_and_top_k_alone_is_refused(make_engine):
    engine = make_engine()
    meta = engine.generate(prompt_of(10, seed=2), {**GREEDY, "max_new_tokens": 2})[0].meta
    assert meta.input_token_logprobs is None and meta.input_top_logprobs is None
    no_top = engine.generate(prompt_of(10, seed=2), PREFILL)[0].meta
    assert no_top.input_token_logprobs is not None and no_top.input_top_logprobs is None
    with pytest.raises(ValueError, match="prompt_top_logprobs_num needs logprob_start_len"):
        engine.generate([5, 6, 7], {"prompt_top_logprobs_num": 2})
    with pytest.raises(ValueError, match="logprob_start_len must be >= -1"):
        engine.generate([5, 6, 7], {"logprob_start_len": -2})
    assert_idle_and_leak_free(engine)


def test_logprob_start_len_must_lie_inside_the_prompt(make_engine):
    engine = make_engine()
    with pytest.raises(
        ValueError, match=r"logprob_start_len must be below the prompt length \(3\)"
    ):
        engine.generate([5, 6, 7], {"logprob_start_len": 3})
    one_token = engine.generate([5], PREFILL)[0].meta
    assert one_token.input_token_logprobs == [(None, 5)]
    last = engine.generate([5, 6, 7], {**PREFILL, "logprob_start_len": 2})[0].meta
    assert [t for _, t in last.input_token_logprobs or []] == [7]
    assert_idle_and_leak_free(engine)


def test_a_radix_hit_stops_before_the_positions_prompt_logprobs_need(make_engine):
    engine = make_engine()
    prompt = prompt_of(60, seed=3)
    engine.generate(prompt, {**GREEDY, "max_new_tokens": 4})  # the whole prompt is cached now
    first, again = (engine.generate(prompt, PREFILL)[0].meta for _ in range(2))
    assert first.cached_tokens == again.cached_tokens == 0
    assert values(again) == values(first)

    middle = engine.generate(prompt, {**PREFILL, "logprob_start_len": 30})[0].meta
    assert middle.cached_tokens == 29, "position 29's logits give token 30's logprob"
    assert values(middle) == pytest.approx(values(first)[30:], abs=1e-12)

    # A prompt sharing 50 tokens: its first 50 positions score exactly as the first prompt's.
    sharing = prompt[:50] + prompt_of(10, seed=4)
    shared = engine.generate(sharing, {**PREFILL, "logprob_start_len": 40})[0].meta
    assert shared.cached_tokens == 39
    assert values(shared)[:10] == pytest.approx(values(first)[40:50], abs=1e-12)
    # Its own KV went into the tree as usual: a plain request hits all of it but the last.
    plain = engine.generate(sharing, {**GREEDY, "max_new_tokens": 1})[0].meta
    assert plain.cached_tokens == len(sharing) - 1
    assert_idle_and_leak_free(engine)


@pytest.mark.parametrize(
    "options",
    [
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 7, "disable_overlap_schedule": False},
        {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
        {"disable_overlap_schedule": False},
    ],
)
def test_chunked_prefill_and_batching_give_the_prompt_logprobs_of_one_unchunked_prefill(
    make_engine, options
):
    prompts = [prompt_of(n, seed=10 + n) for n in (70, 33, 9, 52)]
    params = [
        {**PREFILL, "prompt_top_logprobs_num": 3},
        {**GREEDY, "max_new_tokens": 5, "logprob_start_len": 20},
        {**GREEDY, "max_new_tokens": 6},
        {**PREFILL, "logprob_start_len": 51, "prompt_top_logprobs_num": 1},
    ]
    alone = make_engine(chunked_prefill_size=None)
    expected = [alone.generate(p, sp)[0] for p, sp in zip(prompts, params)]

    engine = make_engine(**options)
    results = engine.generate(prompts, params)
    for got, want in zip(results, expected):
        assert got.output_ids == want.output_ids
        assert (got.meta.input_token_logprobs is None) == (want.meta.input_token_logprobs is None)
        if want.meta.input_token_logprobs is not None:
            assert values(got.meta) == pytest.approx(values(want.meta), abs=1e-9)
        got_top, want_top = got.meta.input_top_logprobs, want.meta.input_top_logprobs
        assert (got_top is None) == (want_top is None)
        for g, w in zip(got_top or [], want_top or []):
            assert [t for _, t in g] == [t for _, t in w]
            assert [lp for lp, _ in g] == pytest.approx([lp for lp, _ in w], abs=1e-9)
    assert_idle_and_leak_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_scored_in_a_mixed_batch_matches_scoring_it_alone(make_engine, overlap):
    prompt = prompt_of(40, seed=5)
    expected = make_engine().generate(prompt, PREFILL)[0].meta

    engine = make_engine(
        enable_mixed_chunk=True, chunked_prefill_size=16, disable_overlap_schedule=not overlap
    )
    scheduler = engine.scheduler
    decoding = Req("decoding", prompt_of(12, seed=6), SamplingParams(max_new_tokens=30, **GREEDY))
    scored = Req("scored", prompt, SamplingParams(**PREFILL))
    scheduler.add_request(decoding)
    turns = iter(range(1000))

    def arrive_mid_decode() -> None:
        if next(turns) == 4:
            scheduler.add_request(scored)

    scheduler.run_event_loop(lambda: decoding.finished and scored.finished, arrive_mid_decode)
    assert scheduler.stats.forward_modes.get("mixed", 0) > 0
    assert scored.output_ids == [] and scored.lifecycle.finished_reason is not None
    assert scored.lifecycle.finished_reason.type == "length"
    assert scored.output.prompt_logprobs == pytest.approx(values(expected), abs=1e-9)
    assert len(decoding.output_ids) == 30
    assert_idle_and_leak_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunked_prefill_size", [None, 8])
def test_max_new_tokens_0_ends_after_the_prefill_with_no_token_and_no_leaked_slot(
    make_engine, overlap, chunked_prefill_size
):
    prompts = [prompt_of(n, seed=20 + n) for n in (30, 5, 17)]
    reference = make_engine()
    alone = [reference.generate(p, {**GREEDY, "max_new_tokens": 6})[0].output_ids for p in prompts]

    engine = make_engine(
        disable_overlap_schedule=not overlap, chunked_prefill_size=chunked_prefill_size
    )
    zero = {"max_new_tokens": 0}
    results = engine.generate(prompts, [zero, {**GREEDY, "max_new_tokens": 6}, {**zero, **PREFILL}])
    for result in (results[0], results[2]):
        assert result.output_ids == [] and result.text == ""
        assert result.meta.finish_reason is not None
        assert result.meta.finish_reason.type == "length"
        assert result.meta.completion_tokens == 0
    assert results[1].output_ids == alone[1], "a prefill-only batch-mate changes nothing"
    assert engine.scheduler.stats.generation_tokens == 6
    # The prompt's KV went into the tree: the same prompt now hits all but its last token.
    again = engine.generate(prompts[0], {**GREEDY, "max_new_tokens": 2})[0]
    assert again.meta.cached_tokens == len(prompts[0]) - 1
    assert again.output_ids == alone[0][:2]
    assert_idle_and_leak_free(engine)


def test_a_prefill_only_stream_yields_one_chunk_with_the_meta(make_engine):
    engine = make_engine()
    prompt = prompt_of(12, seed=7)
    chunks = list(engine.generate_stream(prompt, PREFILL))
    assert len(chunks) == 1 and chunks[0].output_ids == [] and chunks[0].meta is not None
    assert (
        chunks[0].meta.input_token_logprobs
        == engine.generate(prompt, PREFILL)[0].meta.input_token_logprobs
    )
    assert_idle_and_leak_free(engine)


def test_an_abort_mid_chunked_prefill_frees_its_slots(make_engine):
    engine = make_engine(chunked_prefill_size=8)
    scheduler = engine.scheduler
    req = Req("scored", prompt_of(40, seed=8), SamplingParams(**PREFILL))
    scheduler.add_request(req)
    scheduler.run_event_loop(lambda: len(req.output.prompt_logprobs) > 8)
    assert req.prompt_logprobs_pending and scheduler.prefill.chunked_req is req
    scheduler.abort_request(req.rid)
    assert (
        req.lifecycle.finished_reason is not None and req.lifecycle.finished_reason.type == "abort"
    )
    assert_idle_and_leak_free(engine)


def test_a_logprob_that_underflows_to_minus_inf_is_clamped_to_the_float32_minimum():
    lm_head = VocabParallelEmbedding(3, 1)
    with torch.no_grad():
        lm_head.weight.copy_(torch.tensor([[3e38], [0.0], [-3e38]]))
    spec = PromptLogprobsInput(torch.tensor([0, 1]), torch.tensor([2, 1]), 3, [2])
    # The processor reads only these of a ForwardBatch.
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, extend_lens=torch.tensor([3]), prompt_logprobs=spec
    )
    out = LogitsProcessor()(torch.ones(3, 1), lm_head, batch)
    lowest = torch.finfo(torch.float32).min
    assert out.input_token_logprobs is not None and out.input_top_logprobs_val is not None
    assert out.input_token_logprobs.tolist() == [lowest, pytest.approx(-3e38, rel=1e-6)]
    assert torch.isfinite(out.input_top_logprobs_val).all()
    assert out.input_top_logprobs_idx is not None
    assert out.input_top_logprobs_idx.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert out.next_token_logits.shape == (1, 3)
    plain = LogitsProcessor()(
        torch.ones(3, 1), lm_head, SimpleNamespace(**{**vars(batch), "prompt_logprobs": None})
    )
    assert plain.input_token_logprobs is None and torch.equal(
        plain.next_token_logits, out.next_token_logits
    )
