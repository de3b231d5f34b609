"""The reasoning parsers on thinking models' outputs, and streamed deltas, split anywhere,
concatenating to the non-streaming result."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tokenizer.parsers import REASONING_PARSERS, ReasoningParser


def test_names_and_think_end_tokens() -> None:
    assert {name: fmt.think_end for name, fmt in REASONING_PARSERS.items()} == {
        "deepseek_r1": "</think>",
        "qwen3": "</think>",
    }
    assert ReasoningParser("qwen3").think_end == "</think>"
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        ReasoningParser("o1")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Okay, the user asks for 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
            ("Okay, the user asks for 2+2.\nThat is 4.", "The answer is **4**."),
        ),
        ("<think>\nHmm.\n</think>\n\n4", ("Hmm.", "4")),
        ("Still thinking when max_tokens hit", ("Still thinking when max_tokens hit", None)),
        ("</think>Just the answer.", (None, "Just the answer.")),
        ("A</think>B</think>C <think>D", ("A", "B</think>C <think>D")),
        ("", (None, None)),
    ],
)
def test_deepseek_r1_starts_in_reasoning(
    text: str, expected: tuple[str | None, str | None]
) -> None:
    assert ReasoningParser("deepseek_r1").parse(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nLet me think.\n</think>\n\nHello!", ("Let me think.", "Hello!")),
        ("\n<think>x</think>y", ("x", "y")),
        ("<think>\n\n</think>\n\nHello!", (None, "Hello!")),
        ("Hello! No reasoning here.", (None, "Hello! No reasoning here.")),
        ("Hi </think> there", (None, "Hi </think> there")),
        ("<think>cut off", ("cut off", None)),
        ("<thin", (None, "<thin")),
    ],
)
def test_qwen3_reasons_only_after_think(text: str, expected: tuple[str | None, str | None]) -> None:
    assert ReasoningParser("qwen3").parse(text) == expected


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_thinking_disabled_has_no_reasoning(name: str) -> None:
    text = "<think>x</think>Hello"
    assert ReasoningParser(name, enable_thinking=False).parse(text) == (None, text)


def test_starts_in_reasoning_overrides_the_default() -> None:
    assert ReasoningParser("qwen3", starts_in_reasoning=True).parse("a</think>b") == ("a", "b")
    assert ReasoningParser("deepseek_r1", starts_in_reasoning=False).parse("a</think>b") == (
        None,
        "a</think>b",
    )


def test_streaming_holds_back_partial_markers() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nStep one") == ("Step one", "")
    assert parser.feed(". </thi") == (".", "")
    assert parser.feed("nk>\n\nAns") == ("", "Ans")
    assert parser.feed("wer") == ("", "wer")
    assert parser.finish() == ("", "")


def test_streaming_releases_a_marker_prefix_that_was_not_one() -> None:
    parser = ReasoningParser("deepseek_r1")
    assert parser.feed("x </th") == ("x", "")
    assert parser.feed("ree") == (" </three", "")
    assert parser.feed(" </") == ("", "")
    assert parser.finish() == (" </", "")  # the output ended: no marker after all


def test_parse_leaves_the_stream_alone() -> None:
    parser = ReasoningParser("deepseek_r1")
    assert parser.feed("a") == ("a", "")
    assert parser.parse("b</think>c") == ("b", "c")
    assert parser.feed("</think>d") == ("", "d")


FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "\n", " ", "\n\n", "word", "<", ">", "é"]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("starts_in_reasoning", [None, True, False])
@given(data=st.data())
def test_streaming_matches_parse(
    name: str, starts_in_reasoning: bool | None, data: st.DataObject
) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    parser = ReasoningParser(name, starts_in_reasoning)
    expected = parser.parse(text)
    reasoning = content = ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = parser.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    assert (reasoning + r, content + c) == (expected[0] or "", expected[1] or "")
