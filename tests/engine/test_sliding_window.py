"""Sliding-window attention through the whole engine, on a tiny random Gemma 3 whose first
two of three layers see the last 8 tokens: greedy answers equal transformers' in each way
the scheduler can reach a token's keys (one prefill, chunks across a window edge, a radix
hit ending inside or past a window, retraction and re-prefill, speculative verify, mixed
chunked prefill, the overlap loop, the radix cache off). Each case also runs with the window
ignored, and its answers then part from transformers': the case really reaches past a
window. The sliding layers keep their K/V in a pool of their own (`SWAKVPool`) unless
`disable_hybrid_swa_memory`; every case runs both ways, and ends with every slot of both
pools free or the tree's.

Then the other features on the same model: the deterministic mode, prompt logprobs, grammars
with jump-forward, LoRA, tensor parallelism (its one KV head on both ranks)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from engine.api import Engine
from engine.constants import SWA_EVICTION_INTERVAL
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.mem.swa_kv_pool import SWAKVPool
from engine.model.attention.base import AttentionLayer
from engine.outputs import GenerateResult
from engine.sched.req import Req
from engine.sched.scheduler import Scheduler
from testing.models import TINY_SLIDING_WINDOW, save_tiny_model, tiny_hf_model
from tests.engine.lora.conftest import ALL_TARGETS, make_adapter, peft

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
OPTIONS: dict[str, Any] = dict(
    dtype="float64", device="cpu", max_total_tokens=4096, skip_tokenizer_init=True
)
GREEDY = {"temperature": 0, "ignore_eos": True}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


SHARED = prompt(0, 21)  # not a multiple of the window
CASES: dict[str, tuple[list[list[int]], dict[str, Any], dict[str, Any]]] = {
    "prefill_and_decode": ([prompt(1, 5), prompt(2, 30)], {"max_new_tokens": 12}, {}),
    "chunks_across_a_window_edge": (
        [prompt(3, 45)],
        {"max_new_tokens": 4},
        {"chunked_prefill_size": 11},
    ),
    "radix_hit_past_the_window": (
        [SHARED + prompt(4, 3), SHARED + prompt(5, 12)],
        {"max_new_tokens": 6},
        {},
    ),
    "radix_hit_inside_the_window": (
        [SHARED[:5] + prompt(6, 20), SHARED[:5] + prompt(7, 2)],
        {"max_new_tokens": 6},
        {},
    ),
    "retraction": (
        [prompt(10 + i, 20) for i in range(5)],
        {"max_new_tokens": 50},
        {"max_total_tokens": 280, "chunked_prefill_size": 32},
    ),
    # An SWA pool of 150 slots for two requests of 180 and 172 tokens: each finishes, even
    # alone, only if the window's leavings are freed as it decodes.
    "small_swa_pool": (
        [prompt(30, 20), prompt(31, 12)],
        {"max_new_tokens": 160},
        {"max_total_tokens": 600, "swa_full_tokens_ratio": 0.1},
    ),
    "ngram_verify": (
        [prompt(20, 6) * 5],
        {"max_new_tokens": 16},
        {"speculative_algorithm": "NGRAM"},
    ),
    # The first request decodes while the others' chunks cross window edges in its batches.
    "mixed_chunked_prefill": (
        [prompt(1, 5), prompt(8, 45), prompt(2, 30)],
        {"max_new_tokens": 12},
        {"chunked_prefill_size": 11, "enable_mixed_chunk": True},
    ),
    "overlap_loop": (
        [prompt(1, 5), prompt(8, 45), prompt(2, 30)],
        {"max_new_tokens": 12},
        {"chunked_prefill_size": 11, "enable_mixed_chunk": True, "disable_overlap_schedule": False},
    ),
    "radix_cache_disabled": (
        [prompt(3, 45), prompt(2, 30)],
        {"max_new_tokens": 12},
        {"chunked_prefill_size": 11, "disable_radix_cache": True},
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3")
    hf_model().save_pretrained(path)
    return path


MODEL_ARGS: dict[str, Any] = dict(
    dtype=torch.float64,
    weight_scale=0.2,
    num_hidden_layers=3,
    layer_types=LAYER_TYPES,
    max_position_embeddings=512,
)


def hf_model(**config: Any) -> PreTrainedModel:
    return tiny_hf_model("gemma3", **MODEL_ARGS, **config)


@pytest.fixture(scope="module")
def reference() -> PreTrainedModel:
    return hf_model()


def hf_greedy(model: PreTrainedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


def run_case(
    model_dir: Path, name: str, hybrid: bool = True
) -> tuple[list[list[int]], list[int], dict[str, int]]:
    """Each prompt's greedy answer and cached prompt tokens, and the scheduler's counters;
    `hybrid`: over the two pools of a hybrid model, else one pool for every layer."""
    prompts, params, options = CASES[name]
    options = {**OPTIONS, **options, "disable_hybrid_swa_memory": not hybrid}
    with Engine(str(model_dir), **options) as engine:
        runner = engine.scheduler.model_runner
        assert isinstance(runner.token_to_kv_pool, SWAKVPool) == hybrid
        assert engine.scheduler.info().swa_max_total_tokens == runner.swa_max_total_num_tokens
        check_integrity_after_every_step(engine.scheduler)
        if name in CACHED:  # the tree holds the first, and a branch point where the second
            engine.generate(prompts[0], {**GREEDY, **params})  # parts from it: the request
            branching = prompts[1][: CACHED[name]] + prompt(99, 3)  # that first branches off
            engine.generate([branching], {**GREEDY, **params})  # recomputes the shared part
        results = engine.generate(prompts, {**GREEDY, **params})
        counters = engine.scheduler.stats.counters()
        check_pools_whole(engine.scheduler)
    return [r.output_ids for r in results], [r.meta.cached_tokens for r in results], counters


def check_pools_whole(scheduler: Scheduler) -> None:
    """Once the batch an overlap loop left in flight is done, every slot of both pools is
    free or the tree's, none locked (with the radix cache off, every slot is free)."""
    scheduler.run_event_loop(lambda: scheduler.in_flight is None)
    cache = scheduler.cache_manager
    tree, allocator = cache.tree_cache, cache.allocator
    assert tree.protected_size() == 0
    assert cache.full_available_size() + tree.evictable_size() == allocator.size
    if isinstance(allocator, SWATokenToKVPoolAllocator):
        assert allocator.swa_available_size() + tree.swa_evictable_size() == allocator.size_swa


def holding_kv(scheduler: Scheduler) -> list[Req]:
    reqs = {id(r): r for r in [*scheduler.running.reqs, *scheduler.prefill.chunked()]}
    return [r for r in reqs.values() if r.kv.req_pool_idx is not None]


def check_integrity_after_every_step(
    scheduler: Scheduler, after: Callable[[], None] | None = None
) -> None:
    """Every slot of both pools accounted exactly once after each batch's result."""
    process = scheduler.process_batch_result

    def checked(*args: Any) -> None:
        process(*args)
        scheduler.cache_manager.check_integrity(holding_kv(scheduler))
        if after is not None:
            after()

    scheduler.process_batch_result = checked  # type: ignore[method-assign]


@pytest.fixture
def window_ignored(monkeypatch) -> Iterator[None]:
    """Every layer built as a full-attention one: what a backend that drops the window does."""
    original = AttentionLayer.__init__

    def full(self: AttentionLayer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, "sliding_window": None})

    monkeypatch.setattr(AttentionLayer, "__init__", full)
    yield


def expected(reference: PreTrainedModel, name: str) -> list[list[int]]:
    prompts, params, _ = CASES[name]
    return [hf_greedy(reference, p, params["max_new_tokens"]) for p in prompts]


CACHED = {
    "radix_hit_past_the_window": len(SHARED),
    "radix_hit_inside_the_window": 5,
}
"""The second prompt's hit in the radix cases: the shared prefix, longer and shorter than
the window, whose SWA KV the tree kept as the window before a branch point."""


@pytest.mark.parametrize("hybrid", [True, False], ids=["two-pools", "one-pool"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_answers_match_transformers(model_dir, reference, name, hybrid):
    answers, cached, counters = run_case(model_dir, name, hybrid)
    assert answers == expected(reference, name)
    if name == "retraction":
        assert counters["num_retractions"] > 0
    if name == "ngram_verify":
        assert counters["spec_accepted_tokens"] > 0
    if name in ("mixed_chunked_prefill", "overlap_loop"):
        assert counters["forward_modes"]["mixed"] > 0
    if name in CACHED:
        assert cached[1] == CACHED[name] > 0
        assert CACHED[name] > TINY_SLIDING_WINDOW or name.endswith("inside_the_window")


@pytest.mark.parametrize("name", list(CASES))
def test_ignoring_the_window_changes_the_answers(model_dir, reference, name, window_ignored):
    """In one pool, where every token's K/V stays for a layer that ignores the window to
    read (two pools would have freed what it reads)."""
    answers, _, _ = run_case(model_dir, name, hybrid=False)
    assert answers != expected(reference, name)


def test_without_window_checkpoints_the_request_after_a_branch_recomputes(model_dir, reference):
    """The anchors' design (`disable_window_checkpoints`): the tree keeps no window where the
    shared prefix ends, so the radix case's second prompt hits nothing."""
    name = "radix_hit_past_the_window"
    prompts, params, _ = CASES[name]
    with Engine(str(model_dir), **OPTIONS, disable_window_checkpoints=True) as engine:
        check_integrity_after_every_step(engine.scheduler)
        engine.generate(prompts[0], {**GREEDY, **params})
        engine.generate([prompts[1][: len(SHARED)] + prompt(99, 3)], {**GREEDY, **params})
        results = engine.generate(prompts, {**GREEDY, **params})
    assert [r.output_ids for r in results] == expected(reference, name)
    assert results[1].meta.cached_tokens == 0


def test_a_long_decode_holds_far_less_kv_than_one_pool_of_every_layer(model_dir, reference):
    """At 320 tokens, the sliding layers hold about a window and an eviction interval of
    the output (the prompt's window, which the tree keeps, left behind): the request's KV
    bytes, at their peak, stay under half of what every layer holding every token takes."""
    ids, new_tokens = prompt(40, 20), 300
    with Engine(str(model_dir), **OPTIONS) as engine:
        runner = engine.scheduler.model_runner
        allocator = runner.token_to_kv_pool_allocator
        assert isinstance(allocator, SWATokenToKVPoolAllocator)
        peak = [0, 0]

        def record() -> None:
            peak[0] = max(peak[0], allocator.size - allocator.full_available_size())
            peak[1] = max(peak[1], allocator.size_swa - allocator.swa_available_size())

        check_integrity_after_every_step(engine.scheduler, record)
        (result,) = engine.generate([ids], {**GREEDY, "max_new_tokens": new_tokens})
    assert result.output_ids == hf_greedy(reference, ids, new_tokens)
    config = runner.model_config
    cell = MHATokenToKVPool.cell_size(
        config.num_key_value_heads, config.head_dim, 1, runner.kv_cache_dtype
    )
    swa_layers = sum(runner.swa_layers or ())
    full_layers = config.num_hidden_layers - swa_layers
    held = (peak[0] * full_layers + peak[1] * swa_layers) * cell
    all_full = (len(ids) + new_tokens) * config.num_hidden_layers * cell
    assert peak[0] >= len(ids) + new_tokens - 2  # measured at the longest context
    assert peak[1] <= len(ids) + TINY_SLIDING_WINDOW + SWA_EVICTION_INTERVAL + 1
    assert held < 0.5 * all_full


@pytest.mark.parametrize("hybrid", [True, False], ids=["two-pools", "one-pool"])
def test_a_second_turn_hits_the_first_turns_output_past_the_window(model_dir, reference, hybrid):
    """A second turn extends the first's prompt and output: the tree kept all of the first
    turn's KV, the SWA KV behind its window as tombstones (two pools), and the hit reaches
    the first turn's last committed token, far past a window."""
    first, new_tokens = prompt(50, 6), 60
    options = {**OPTIONS, "disable_hybrid_swa_memory": not hybrid}
    with Engine(str(model_dir), **options) as engine:
        check_integrity_after_every_step(engine.scheduler)
        (one,) = engine.generate([first], {**GREEDY, "max_new_tokens": new_tokens})
        tree = engine.scheduler.cache_manager.tree_cache
        tombstoned = len(tree.cached_slots()) - len(tree.cached_swa_slots())
        second = first + one.output_ids + prompt(51, 5)
        (two,) = engine.generate([second], {**GREEDY, "max_new_tokens": 6})
    assert one.output_ids == hf_greedy(reference, first, new_tokens)
    assert two.output_ids == hf_greedy(reference, second, 6)
    assert two.meta.cached_tokens == len(first) + new_tokens - 1 > TINY_SLIDING_WINDOW
    assert (tombstoned > 0) == hybrid, "the first turn freed SWA KV behind its window"


@pytest.mark.timeout(300)
def test_a_retracted_request_longer_than_the_swa_pool_is_prefilled_again_in_pieces(
    model_dir, reference
):
    """Pools of 300 full and 150 SWA slots for six requests of 10 + 200 tokens: the full pool
    overflows, and a request retracted late has more tokens to prefill again than the whole
    SWA pool holds. It goes in pieces the SWA budget holds (not waiting for a room that never
    comes), and every answer equals transformers'."""
    prompts, new_tokens = [prompt(60 + i, 10) for i in range(6)], 200
    options = {**OPTIONS, "max_total_tokens": 200, "swa_full_tokens_ratio": 0.5}
    with Engine(str(model_dir), **options) as engine:
        scheduler = engine.scheduler
        allocator = scheduler.cache_manager.swa_allocator
        assert allocator is not None and (allocator.size, allocator.size_swa) == (300, 150)
        requeued: list[int] = []

        def record() -> None:
            requeued.extend(r.seqlen for r in scheduler.prefill.waiting if r.output_ids)

        check_integrity_after_every_step(scheduler, record)
        results = engine.generate(prompts, {**GREEDY, "max_new_tokens": new_tokens})
    assert max(requeued) > allocator.size_swa
    assert [r.output_ids for r in results] == [hf_greedy(reference, p, new_tokens) for p in prompts]


def test_the_overlap_loop_reads_the_slots_a_batch_was_built_over(model_dir, reference):
    """A prompt whose KV the tree holds behind a window (SWA tombstones) is prefilled again;
    its first decode runs while the scheduler hands that prefill to the tree, which takes
    the request's SWA slots over for its tombstones and frees the request's duplicates. The
    decode reads the slots and the SWA mapping as they stood when its batch was built."""
    ids, new_tokens = prompt(8, 45), 12
    with Engine(str(model_dir), **OPTIONS, disable_overlap_schedule=False) as engine:
        assert engine.scheduler.overlap
        check_integrity_after_every_step(engine.scheduler)
        answers = [
            engine.generate([ids], {**GREEDY, "max_new_tokens": new_tokens})[0].output_ids
            for _ in range(4)
        ]
        check_pools_whole(engine.scheduler)
    assert answers == [hf_greedy(reference, ids, new_tokens)] * 4


CHUNKS_OVERLAP: dict[str, Any] = dict(
    chunked_prefill_size=7, enable_mixed_chunk=True, disable_overlap_schedule=False
)
"""Chunks shorter than the window, in mixed batches, under the overlap loop."""


def answer(result: GenerateResult) -> tuple[list[int], Any]:
    """What the deterministic mode repeats bit for bit: the ids and their logprobs."""
    return result.output_ids, result.meta.output_token_logprobs


def test_the_deterministic_mode_gives_a_request_the_same_bits_in_any_batch(model_dir):
    """`enable_deterministic_inference` over two pools (in float32, its kernels' dtype): a
    prompt five windows long gets the same tokens and logprobs alone, among neighbours
    greedy and sampled, and among them again under chunks shorter than the window, mixed
    batches and the overlap loop, where its second run prefills what the tree holds
    behind a window."""
    probe, params = prompt(8, 45), {**GREEDY, "max_new_tokens": 12, "logprobs": True}
    neighbours = [prompt(100 + i, 3 + 9 * i) for i in range(4)]
    sampled = {"temperature": 0.8, "max_new_tokens": 9, "ignore_eos": True}
    batch_params = [sampled, params, params, sampled, sampled]
    options = {**OPTIONS, "dtype": "float32", "enable_deterministic_inference": True}

    def among(engine: Engine) -> tuple[list[int], Any]:
        return answer(engine.generate([neighbours[0], probe, *neighbours[1:]], batch_params)[1])

    with Engine(str(model_dir), **options) as engine:
        check_integrity_after_every_step(engine.scheduler)
        alone = answer(engine.generate([probe], params)[0])
        assert among(engine) == alone
    with Engine(str(model_dir), **options, **CHUNKS_OVERLAP) as engine:
        check_integrity_after_every_step(engine.scheduler)
        assert among(engine) == alone
        assert answer(engine.generate([probe], params)[0]) == alone


@pytest.mark.parametrize(
    "options",
    [{}, CHUNKS_OVERLAP],
    ids=["one-prefill", "chunks-overlap"],
)
def test_prompt_logprobs_match_transformers_past_the_window_and_after_a_radix_hit(
    model_dir, reference, options
):
    """Over two pools, the prompt logprobs of a prompt six windows long equal transformers'
    log-softmax: from its first token (nothing cached can serve), and from token 22, where
    its first 21 tokens hit the branch point the tree keeps a window before."""
    ids = SHARED + prompt(60, 30)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
    with Engine(str(model_dir), **OPTIONS, **options) as engine:
        check_integrity_after_every_step(engine.scheduler)
        for tail in (61, 62):  # two requests part after SHARED: a branch point there
            engine.generate([SHARED + prompt(tail, 4)], {**GREEDY, "max_new_tokens": 3})
        for start, hit in ((1, 0), (len(SHARED) + 1, len(SHARED))):
            params = {"max_new_tokens": 0, "logprob_start_len": start}
            meta = engine.generate([ids], params)[0].meta
            assert meta.cached_tokens == hit
            assert meta.input_token_logprobs is not None
            got = [logprob for logprob, _ in meta.input_token_logprobs]
            want = [expected[p - 1, ids[p]].item() for p in range(start, len(ids))]
            assert got == pytest.approx(want, abs=1e-4)
        check_pools_whole(engine.scheduler)


FORCED = " the quick brown fox jumps over the lazy dog"
FORCED_REGEX = r"[a-z]{2,5}" + FORCED + r" [a-z]{2,5}\."
"""Two forced runs: the text above, more than a window of tokens, and the closing period,
whose tokens merge with the letters before it (a rollback into the first run's extend)."""


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory) -> Path:
    """The tiny Gemma 3 with SmolLM2's tokenizer (and vocabulary), for grammars."""
    path = tmp_path_factory.mktemp("gemma3-text")
    return save_tiny_model(path, "gemma3", tokenizer="embedded", **MODEL_ARGS)


def stream(engine: Engine, text: str, params: dict[str, Any]) -> tuple[list[int], int, str]:
    """The output ids, the most a step appended, and the text, read as a client streams."""
    ids: list[int] = []
    longest, pieces = 0, []
    for chunk in engine.generate_stream(text, params):
        del ids[len(ids) - chunk.rollback :]
        ids += chunk.output_ids
        longest = max(longest, len(chunk.output_ids))
        pieces.append(chunk.text)
        assert chunk.meta is None or chunk.meta.finish_reason.type == "stop"
    return ids, longest, "".join(pieces)


def test_jump_forward_takes_a_forced_run_past_the_window_in_one_step(text_model_dir):
    """With jump-forward, a step appends the first forced run (more than a window) and the
    next extend computes it. Two pools give one pool's output (one pool keeps every token's
    K/V), matching the regex, and prefill as many tokens: after each jump the request hits
    the tree up to the tokens it kept, whose window the tree keeps live."""
    options = {**OPTIONS, "skip_tokenizer_init": False, "enable_jump_forward": True}
    params = {"temperature": 0, "max_new_tokens": 40, "regex": FORCED_REGEX}
    runs = {}
    for hybrid in (True, False):
        with Engine(str(text_model_dir), **options, disable_hybrid_swa_memory=not hybrid) as engine:
            check_integrity_after_every_step(engine.scheduler)
            ids, longest, text = stream(engine, "Say it: " * 12, params)
            stats = engine.scheduler.stats
            runs[hybrid] = ids, stats.prefill_tokens
            check_pools_whole(engine.scheduler)
        assert re.fullmatch(FORCED_REGEX, text), text
        assert stats.jump_forwards == 2 and longest > TINY_SLIDING_WINDOW
    assert runs[True] == runs[False]


def test_lora_on_gemmas_seven_projections_gives_the_merged_models_answers(
    model_dir, reference, tmp_path
):
    """A peft adapter on q/k/v/o and gate/up/down: over two pools, its requests get the
    greedy answers of peft's merged model, and base requests in the same batches the base
    model's."""
    adapter = make_adapter(model_dir, tmp_path / "adapter", seed=0, rank=4, targets=ALL_TARGETS)
    merged = peft.PeftModel.from_pretrained(hf_model(), adapter).merge_and_unload().eval()
    prompts, new_tokens = [prompt(1, 5), prompt(8, 45), prompt(2, 30)], 12
    options = {**OPTIONS, "lora_paths": f"adapter={adapter}", "chunked_prefill_size": 11}
    with Engine(str(model_dir), **options) as engine:
        check_integrity_after_every_step(engine.scheduler)
        results = engine.generate(
            prompts * 2, {**GREEDY, "max_new_tokens": new_tokens}, ["adapter"] * 3 + [None] * 3
        )
    adapted = [hf_greedy(merged, p, new_tokens) for p in prompts]
    assert [r.output_ids for r in results] == adapted + [
        hf_greedy(reference, p, new_tokens) for p in prompts
    ]
    assert adapted != [r.output_ids for r in results[3:]], "the adapter changes the answers"


@pytest.mark.timeout(180)
def test_tp2_holds_the_one_kv_head_on_both_ranks_over_two_pools(tmp_path):
    """Gemma 3 270M's heads (4 query heads, 1 KV head) at tp_size 2: each rank attends with
    2 query heads over the whole KV head, in two pools; the answers are transformers',
    also for a prompt prefilled again over what the tree holds behind a window."""
    model = hf_model(num_key_value_heads=1)
    model.save_pretrained(tmp_path)
    prompts, new_tokens = [prompt(1, 5), prompt(8, 45), prompt(2, 30)], 12
    options = {**OPTIONS, "chunked_prefill_size": 11, "disable_overlap_schedule": False}
    with Engine(str(tmp_path), **options, tp_size=2) as engine:
        runner = engine.scheduler.model_runner
        assert isinstance(runner.token_to_kv_pool, SWAKVPool)
        assert (runner.attn_backend.num_heads, runner.attn_backend.num_kv_heads) == (2, 1)
        check_integrity_after_every_step(engine.scheduler)
        results = engine.generate(prompts, {**GREEDY, "max_new_tokens": new_tokens})
        again = engine.generate([prompts[1]], {**GREEDY, "max_new_tokens": new_tokens})
    expected = [hf_greedy(model, p, new_tokens) for p in prompts]
    assert [r.output_ids for r in results + again] == expected + expected[1:2]
