"""--enable-deterministic-inference on the embedded model (its GGUF blocks, the dtype --dtype
auto picks for this CPU): one request's tokens and logprobs, greedy and seeded at
temperature 1, are the same bits alone, among 4 or 31 neighbours of other lengths and
settings, after a radix hit of its prompt, under chunked and mixed prefill at several chunk
sizes, after retraction, in both event loops, and with speculative decoding."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.api import Engine
from engine.model.batch_invariant import check_supported
from engine.outputs import GenerateResult
from engine.sampling.sampling_params import SamplingParams

PROBE = (
    "A short story about a message in a bottle, found on a beach after a storm by a child "
    "who could not yet read. She carried it home and asked her grandmother what it said. "
    "The message in the bottle was:"
)
ASK = {"max_new_tokens": 16, "ignore_eos": True, "logprobs": True, "top_logprobs_num": 3}
PARAMS = {
    "greedy": {**ASK, "temperature": 0.0},
    "seeded": {**ASK, "temperature": 1.0, "seed": 1234},
    "regex": {**ASK, "temperature": 1.0, "seed": 7, "regex": "[a-z ]{4,40}\\."},
}
WORDS = "the of and to in is you that it he was for on are as with his they at be this".split()


def answer(result: GenerateResult) -> tuple[Any, ...]:
    """What must repeat bit for bit: the ids and every logprob returned with them."""
    meta = result.meta
    return result.output_ids, meta.output_token_logprobs, meta.output_top_logprobs


def neighbours(n: int, seed: int) -> tuple[list[str], list[dict[str, Any]]]:
    """`n` prompts of 3-150 words, greedy or sampled, 4-30 tokens each."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 150))) for _ in range(n)]
    params = [
        {
            "max_new_tokens": rng.randint(4, 30),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
        }
        for _ in range(n)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(enable_deterministic_inference=True, max_total_tokens=16384) as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(engine: Engine) -> dict[str, tuple[Any, ...]]:
    """Each probe's answer alone, its prompt not yet cached."""
    answers = {}
    for name, params in PARAMS.items():
        engine.scheduler.cache_manager.reset()
        answers[name] = answer(engine.generate(PROBE, params)[0])
    return answers


def generate_among(
    engine: Engine, n: int, seed: int, params: dict[str, Any]
) -> list[GenerateResult]:
    """The probe at a random place among `n` neighbours, all submitted at once."""
    prompts, settings = neighbours(n, seed)
    at = random.Random(seed).randint(0, n)
    prompts.insert(at, PROBE)
    settings.insert(at, params)
    results = engine.generate(prompts, settings)
    return [results[at], *results[:at], *results[at + 1 :]]


@pytest.mark.parametrize("name", PARAMS)
def test_the_probe_repeats_alone_among_neighbours_and_from_the_cache(engine, alone, name):
    for n in (4, 31):
        probe = generate_among(engine, n, seed=n, params=PARAMS[name])[0]
        assert answer(probe) == alone[name], f"among {n} neighbours"
    assert answer(engine.generate(PROBE, PARAMS[name])[0]) == alone[name]  # a radix hit


def test_an_unseeded_sampled_request_is_drawn_from_the_server_seed(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    first = engine.generate(PROBE, params)[0].output_ids
    among = generate_among(engine, 9, seed=3, params=params)[0].output_ids
    seeded = engine.generate(PROBE, {**params, "sampling_seed": engine.args.random_seed})[0]
    assert first == among == seeded.output_ids


@pytest.mark.parametrize(
    "options",
    [
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 40, "enable_mixed_chunk": True, "disable_overlap_schedule": False},
    ],
    ids=["chunk16", "chunk40-mixed-overlap"],
)
def test_chunked_prefill_and_the_overlap_loop_give_the_same_bits(alone, options):
    with Engine(enable_deterministic_inference=True, **options) as chunked:
        for name in ("greedy", "seeded"):
            probe = generate_among(chunked, 5, seed=11, params=PARAMS[name])[0]
            assert answer(probe) == alone[name]


EXTRACT = (
    "Extract the person from this sentence as JSON with the keys name and city. "
    "Sentence: Margaret Hamilton, who lived in Boston, wrote the onboard flight software."
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
}


def test_speculative_decoding_gives_the_same_bits(engine, alone):
    """NGRAM drafts verified in one pass: each node reduces as a decode step at its position
    does, and every row is sampled as that step would sample it, so greedy, seeded, regex
    and json_schema requests keep their ids and logprobs bit for bit (a grammar's drafts
    filtered and masked node by node); the second round drafts from the first round's
    outputs, which the target accepts."""
    extract = {**ASK, "temperature": 0.0, "max_new_tokens": 40, "json_schema": json.dumps(PERSON)}
    extract.pop("ignore_eos")
    plain_json = answer(engine.generate(EXTRACT, extract)[0])
    # A stop string inside what a verify pass accepts ends the request where it ends plainly.
    text = engine.generate(PROBE, PARAMS["greedy"])[0].text
    stopped = {**PARAMS["greedy"], "stop": [text.split()[len(text.split()) // 2]]}
    plain_stopped = engine.generate(PROBE, stopped)[0]
    with Engine(
        enable_deterministic_inference=True, speculative_algorithm="NGRAM", max_total_tokens=16384
    ) as spec:
        for round in range(2):
            for name in PARAMS:
                probe = generate_among(spec, 4, seed=round, params=PARAMS[name])[0]
                assert answer(probe) == alone[name], f"round {round}"
            result = spec.generate(EXTRACT, extract)[0]
            assert answer(result) == plain_json, f"round {round}"
            halted = spec.generate(PROBE, stopped)[0]
            assert (halted.text, answer(halted)) == (plain_stopped.text, answer(plain_stopped))
        assert result.meta.spec_accept_length > 2.0  # the grammar request drafted too
        stats = spec.scheduler.stats
        assert stats.spec_accepted_tokens > stats.generation_tokens // 10


def test_the_embedded_model_drafting_for_itself_has_every_greedy_draft_accepted(alone):
    """STANDALONE with the embedded model as its own draft model: both run the same
    batch-invariant kernels, so each greedy draft is the token the target samples."""
    with Engine(
        enable_deterministic_inference=True,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="embedded",
        speculative_adaptive=False,
        max_total_tokens=16384,
    ) as spec:
        prompts, settings = neighbours(3, seed=0)
        greedy = [{**s, "temperature": 0.0} for s in settings]
        results = spec.generate([PROBE, *prompts], [PARAMS["greedy"], *greedy])
        assert answer(results[0]) == alone["greedy"]
        stats = spec.scheduler.stats
        assert stats.spec_proposed_tokens > 0
        assert stats.spec_accepted_tokens == stats.spec_proposed_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_retracted_requests_finish_with_the_same_bits(engine, overlap):
    """A pool too small for every request's output: the scheduler retracts some, which
    later prefill their prompt and output again."""
    prompts, settings = neighbours(12, seed=5)
    prompts.append(PROBE)
    settings = [{**s, "max_new_tokens": 40, "ignore_eos": True, "logprobs": True} for s in settings]
    settings.append(PARAMS["seeded"])
    ample = [answer(r) for r in engine.generate(prompts, settings)]
    with Engine(
        enable_deterministic_inference=True,
        max_total_tokens=1100,
        disable_overlap_schedule=not overlap,
    ) as tight:
        results = [answer(r) for r in tight.generate(prompts, settings)]
        assert tight.scheduler.stats.num_retractions > 0
    assert results == ample


def test_the_mode_is_refused_where_its_kernels_cannot_run(engine):
    with pytest.raises(ValueError, match="not supported on cuda"):
        check_supported(torch.device("cuda"), torch.float32, engine.model_runner.attn_backend)
    with pytest.raises(ValueError, match="not torch.float64"):
        check_supported(torch.device("cpu"), torch.float64, engine.model_runner.attn_backend)
    with pytest.raises(ValueError, match="drop enable_torch_compile"):
        Engine(enable_deterministic_inference=True, enable_torch_compile=True)


def test_sampling_seed_is_sglangs_name_for_the_seed():
    assert SamplingParams.from_dict({"sampling_seed": 5}).seed == 5
    assert SamplingParams.from_dict({"sampling_seed": 5, "seed": 5}).seed == 5
    with pytest.raises(ValueError, match="give one of them"):
        SamplingParams.from_dict({"sampling_seed": 5, "seed": 6})
