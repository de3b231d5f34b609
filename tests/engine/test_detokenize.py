import pytest

from engine.detokenize import IncrementalDetokenizer
from engine.model.tokenizer_cache import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def stream(tokenizer, ids: list[int], stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = [detok.add_tokens([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    return deltas, detok


def test_token_by_token_deltas_concatenate_to_the_full_decode(tokenizer):
    text = "Grüße aus Zürich — naïve café, 東京 🚀 and spaces  here."
    ids = tokenizer.encode(text)
    deltas, detok = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == detok.final_text()
    assert all("\ufffd" not in d for d in deltas), (
        "a broken multi-byte character leaked into a delta"
    )


def test_stop_string_is_trimmed_and_never_streamed(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story, more text")
    deltas, detok = stream(tokenizer, ids, stop=["END"])
    assert detok.final_text() == "The answer is 42. "
    assert "".join(deltas) == "The answer is 42. "
