"""The offline Engine on the embedded SmolLM2 model: text in, text out."""

import pytest

from engine.api import Engine
from engine.sched.req import FinishReason

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def engine():
    with Engine(dtype="float32", max_total_tokens=4096) as engine:
        yield engine


def test_generate_returns_text_ids_and_meta_per_prompt(engine):
    results = engine.generate([PROMPT, "1, 2, 3, 4,"], {"temperature": 0, "max_new_tokens": 12})
    assert len(results) == 2
    for result in results:
        assert result.text and len(result.output_ids) <= 12
        assert result.text == engine.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        meta = result.meta  # logprobs only when asked
        assert meta.output_token_logprobs is None and meta.output_top_logprobs is None
    assert results[1].text.lstrip().startswith("5")


def test_stop_string_ends_generation_and_is_trimmed(engine):
    greedy = {"temperature": 0, "max_new_tokens": 24}
    free = engine.generate(PROMPT, {**greedy, "ignore_eos": True})[0].text
    stop = free.split()[2]
    stopped = engine.generate(PROMPT, {**greedy, "stop": stop})[0]
    assert stopped.meta.finish_reason == FinishReason("stop", matched=stop)
    assert stopped.text == free[: free.index(stop)]


def test_streaming_deltas_add_up_to_the_generated_text(engine):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    chunks = list(engine.generate_stream(PROMPT, params))
    assert "".join(c.text for c in chunks) == engine.generate(PROMPT, params)[0].text
    assert sum(len(c.output_ids) for c in chunks) == 16
    assert chunks[-1].meta.finish_reason == FinishReason("length")
    assert chunks[0].meta is None


def test_a_repeated_prompt_is_served_from_the_radix_cache(engine):
    engine.generate(PROMPT + " red,", {"max_new_tokens": 2})
    again = engine.generate(PROMPT + " red,", {"max_new_tokens": 2})[0]
    assert again.meta.cached_tokens == again.meta.prompt_tokens - 1


def test_bad_options_and_params_are_named():
    with pytest.raises(TypeError, match="max_total_token"):
        Engine(max_total_token=10)


def test_mismatched_sampling_params_list_is_rejected(engine):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        engine.generate([PROMPT], [{}, {}])
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate(PROMPT, {"max_tokens": 3})
