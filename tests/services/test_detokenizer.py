"""The detokenizer as a real process: the test plays the worker (pushing BatchTokenIDOutput)
and the tokenizer (pulling BatchStrOutput), feeding ids one step at a time as the worker does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.io_struct import (
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerReqState,
    FinishReason,
)

LENGTH = FinishReason("length")


@pytest.fixture(scope="module")
def stub(tiny_llama_dir: Path, launcher, make_stub):
    """A running detokenizer; returns the PeerStub that plays the worker and the tokenizer."""
    port = launcher.free_port()
    stub = make_stub("worker", port)
    launcher.start(
        "detokenizer",
        [
            "--model",
            str(tiny_llama_dir),
            "--detokenizer-port",
            str(port),
            "--worker-port",
            str(launcher.free_port()),
            "--tokenizer-port",
            str(stub.output_port),
            "--tokenizer-control-port",
            str(stub.control_port),
        ],
    )
    stub.wait_for(
        lambda: any(m.sender == "detokenizer" for m in stub.alive_signs),
        60,
        "the detokenizer's heartbeat",
    )
    return stub


def token_batch(
    *rows: tuple,
    stop: list[str] | None = None,
    skip_special_tokens: bool = True,
    new: bool = True,
) -> BatchTokenIDOutput:
    """rows: (rid, new ids) or (rid, new ids, finish reason); the other columns are filler.
    `new`: the batch is the rows' first, so it carries their `DetokenizerReqState`."""
    rids = [row[0] for row in rows]
    states = [DetokenizerReqState(rid, list(stop or []), skip_special_tokens) for rid in rids]
    return BatchTokenIDOutput(
        rids=rids,
        output_ids=[row[1] for row in rows],
        finished_reasons=[row[2] if len(row) > 2 else None for row in rows],
        prompt_tokens=[5] * len(rows),
        completion_tokens=[len(row[1]) for row in rows],
        cached_tokens=[2] * len(rows),
        new_reqs=states if new else [],
    )


def stream_one_by_one(
    stub, rid: str, ids: list[int], reason: FinishReason = LENGTH, **options
) -> list[str]:
    """Send `ids` one per batch (the last one finishing `rid`); return the text deltas."""
    for i, token in enumerate(ids):
        row = (rid, [token], reason) if i == len(ids) - 1 else (rid, [token])
        stub.send(token_batch(row, new=i == 0, **options))
    return stub.result(rid).deltas


def test_multibyte_characters_are_held_back_until_complete(stub, tokenizer):
    text = "Café 日本語 🙂!"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), (
        "the text should split characters across tokens"
    )
    deltas = stream_one_by_one(stub, "utf8", ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == text
    assert "" in deltas, "a token ending mid-character adds no text until the next completes it"


def test_a_stop_string_is_never_shown_even_in_part(stub, tokenizer):
    stopped = stream_one_by_one(
        stub,
        "stop",
        tokenizer.encode("Hello world, stop here please")[:5],
        FinishReason("stop", matched="stop here"),
        stop=["stop here"],
    )
    assert "".join(stopped) == "Hello world, "
    assert not any("stop" in delta for delta in stopped)
    released = stream_one_by_one(
        stub, "not-stop", tokenizer.encode("Hello world, stop please"), stop=["stop here"]
    )
    assert "".join(released) == "Hello world, stop please", (
        "held-back text is released once it cannot be a stop"
    )


def test_special_tokens_are_skipped_or_kept_as_asked_and_a_stop_token_is_not_text(stub, tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    eos = FinishReason("stop", matched=ids[-1])
    assert "".join(stream_one_by_one(stub, "skip", ids, eos)) == "assistant\nHi"
    kept = stream_one_by_one(stub, "keep", ids, eos, skip_special_tokens=False)
    assert "".join(kept) == "<|im_start|>assistant\nHi"


def test_rids_in_one_batch_keep_separate_state_and_other_columns_pass_through(stub, tokenizer):
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    batch = token_batch(("a", hello), ("b", world, LENGTH))
    batch.output_token_logprobs_val = [[-0.5], [-1.5]]
    stub.send(batch)
    stub.send(token_batch(("a", world, LENGTH), new=False))
    stub.result("a")
    first, second = stub.batches[-2:]
    assert first.output_strs == ["Hello", " world"] and second.output_strs == [" world"]
    assert first.rids == ["a", "b"] and first.output_ids == [hello, world]
    assert first.finished_reasons == [None, LENGTH]
    assert (first.prompt_tokens, first.cached_tokens) == ([5, 5], [2, 2])
    assert first.output_token_logprobs_val == [[-0.5], [-1.5]]


def test_prompt_logprobs_pass_through_untouched(stub, tokenizer):
    batch = token_batch(("scored", [], LENGTH), ("other", tokenizer.encode("Hi")))
    batch.input_token_logprobs_val = [[None, -3.5, -0.75], []]
    batch.input_top_logprobs_val = [[[], [-1.0, -3.5], [-0.75, -2.0]], []]
    batch.input_top_logprobs_idx = [[[], [40, 41], [42, 43]], []]
    stub.send(batch)
    stub.result("scored")
    out = stub.batches[-1]
    assert out.output_strs == ["", "Hi"]
    assert out.input_token_logprobs_val == [[None, -3.5, -0.75], []]
    assert out.input_top_logprobs_val == [[[], [-1.0, -3.5], [-0.75, -2.0]], []]
    assert out.input_top_logprobs_idx == [[[], [40, 41], [42, 43]], []]


def test_a_finished_rid_starts_afresh_when_reused(stub, tokenizer):
    stream_one_by_one(stub, "reused", tokenizer.encode("Hello world,"), stop=["stop"])
    stub.streams.pop("reused")
    # Had the first life's state survived, its text and its stop string would trim this one.
    assert (
        "".join(stream_one_by_one(stub, "reused", tokenizer.encode(" stop here"))) == " stop here"
    )


def test_garbage_is_dropped_and_the_next_batch_served(stub, tokenizer):
    stub.send_raw(b"\xc1 not msgpack")
    stub.send(
        BatchStrOutput(
            rids=[],
            output_ids=[],
            finished_reasons=[],
            prompt_tokens=[],
            completion_tokens=[],
            cached_tokens=[],
            output_strs=[],
        )
    )  # well-formed, but not for the detokenizer
    assert "".join(stream_one_by_one(stub, "after-garbage", tokenizer.encode("Hi"))) == "Hi"


def test_exits_0_on_sigterm_within_seconds(stub, launcher):
    start = time.monotonic()
    assert launcher.stop("detokenizer", timeout=5) == 0
    assert time.monotonic() - start < 5
