"""Output batches that would exceed the frame limit go as several messages, in order, never
dropped, and a row too large alone fails its request only; a rid whose detokenization raises
fails alone while the other rows of its batch decode as they would without it."""

from __future__ import annotations

import pytest

from engine.detokenize import IncrementalDetokenizer
from services.detokenizer.detokenizer import BatchDetokenizer
from services.io_struct import (
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerReqState,
    FinishReason,
    decode,
    encode,
    split_batch,
)

LIMIT = 4096
FAILED = FinishReason("abort", message="too large", status_code=400)


def token_batch(sizes: list[int]) -> BatchTokenIDOutput:
    """One row per size: that many ids and as many logprobs; rid i's state rides along."""
    rids = [f"r{i}" for i in range(len(sizes))]
    return BatchTokenIDOutput(
        sender="worker",
        epoch="e" * 32,
        rids=rids,
        output_ids=[list(range(1000, 1000 + n)) for n in sizes],
        finished_reasons=[None] * len(sizes),
        prompt_tokens=[7] * len(sizes),
        completion_tokens=sizes,
        cached_tokens=[0] * len(sizes),
        output_token_logprobs_val=[[-0.5] * n for n in sizes],
        new_reqs=[DetokenizerReqState(rid, [f"stop-{rid}"]) for rid in rids],
    )


def rows_of(parts: list[BatchTokenIDOutput]) -> list[tuple]:
    return [
        (rid, ids, reason, lps)
        for part in parts
        for rid, ids, reason, lps in zip(
            part.rids, part.output_ids, part.finished_reasons, part.output_token_logprobs_val
        )
    ]


def test_a_batch_over_the_limit_arrives_whole_across_several_messages_in_order():
    batch = token_batch([40] * 30)
    expected = rows_of([batch])
    assert len(encode(batch)) > LIMIT
    parts = split_batch(batch, LIMIT, lambda row, size: pytest.fail(f"row {row} failed"))
    assert len(parts) > 1
    decoded = [decode(encode(p)) for p in parts]
    assert all(len(encode(p)) <= LIMIT for p in parts)
    assert rows_of(decoded) == expected
    for part in decoded:  # each rid's constants ride with its row
        assert [s.rid for s in part.new_reqs] == part.rids
        assert part.sender == "worker"


def test_a_batch_within_the_limit_is_sent_as_it_is():
    batch = token_batch([3] * 5)
    assert split_batch(batch, LIMIT, lambda row, size: FAILED) == [batch]


def test_a_row_larger_than_the_limit_alone_fails_its_request_and_the_others_arrive_whole():
    batch = token_batch([40, 40, 2000, 40, 40])
    expected = rows_of([batch])
    failed: list[tuple[int, int]] = []

    def fail(row: int, size: int) -> FinishReason:
        failed.append((row, size))
        return FAILED

    parts = split_batch(batch, LIMIT, fail)
    assert [row for row, _ in failed] == [2] and failed[0][1] > LIMIT
    rows = rows_of([decode(encode(p)) for p in parts])
    assert [r[0] for r in rows] == ["r0", "r1", "r2", "r3", "r4"]
    assert rows[2] == ("r2", [], FAILED, [])
    assert rows[:2] + rows[3:] == expected[:2] + expected[3:]
    assert "r2" not in {s.rid for p in parts for s in p.new_reqs}


def test_a_str_batch_row_over_the_limit_fails_with_its_text_emptied():
    batch = BatchStrOutput(
        rids=["a", "b"],
        output_ids=[[1], [2]],
        finished_reasons=[None, None],
        prompt_tokens=[1, 1],
        completion_tokens=[1, 1],
        cached_tokens=[0, 0],
        output_strs=["x" * 10 * LIMIT, "fine"],
    )
    parts = split_batch(batch, LIMIT, lambda row, size: FAILED)
    rows = [(r, s, f) for p in parts for r, s, f in zip(p.rids, p.output_strs, p.finished_reasons)]
    assert rows == [("a", "", FAILED), ("b", "fine", None)]


# ----- the detokenizer --------------------------------------------------------------------


def step(rows: list[tuple], new: bool = False) -> BatchTokenIDOutput:
    """rows: (rid, new ids, finish reason or None)."""
    rids = [r[0] for r in rows]
    return BatchTokenIDOutput(
        rids=rids,
        output_ids=[r[1] for r in rows],
        finished_reasons=[r[2] for r in rows],
        prompt_tokens=[1] * len(rows),
        completion_tokens=[len(r[1]) for r in rows],
        cached_tokens=[0] * len(rows),
        new_reqs=[DetokenizerReqState(rid) for rid in rids] if new else [],
    )


def test_a_rid_whose_decoding_raises_fails_alone_and_its_later_rows_are_dropped(
    tokenizer, monkeypatch, caplog
):
    ids = tokenizer.encode("Hello there, general Kenobi", add_special_tokens=False)
    first, second = ids[:3], ids[3:]
    clean = BatchDetokenizer(tokenizer)
    expected = [
        clean.detokenize(step([("a", first, None), ("c", first, None)], new=True)).output_strs,
        clean.detokenize(step([("a", second, None), ("c", second, None)])).output_strs,
    ]

    state = BatchDetokenizer(tokenizer)
    out = state.detokenize(step([("a", first, None), ("b", first, None), ("c", first, None)], True))
    assert out.output_strs == [expected[0][0], out.output_strs[1], expected[0][1]]

    def boom(new_ids, finished=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(state.decode_status["b"], "add_tokens", boom)  # b's own decoder
    out = state.detokenize(step([("a", second, None), ("b", second, None), ("c", second, None)]))
    assert [out.output_strs[0], out.output_strs[2]] == expected[1]
    reason = out.finished_reasons[1]
    assert reason.type == "abort" and reason.status_code is None  # a server error: 500
    assert "internal server error while detokenizing" in reason.message
    assert out.output_ids[1] == [] and out.output_strs[1] == ""
    logged = [r for r in caplog.records if r.exc_info and "request b failed" in r.getMessage()]
    assert len(logged) == 1
    assert "b" not in state.decode_status

    # The worker keeps sending b until it finishes: those rows are dropped, then b forgotten.
    done = FinishReason("length")
    out = state.detokenize(step([("b", [5], None), ("a", [], done), ("c", [], done)]))
    assert out.rids == ["a", "c"]
    out = state.detokenize(step([("b", [6], FinishReason("length"))]))
    assert out.rids == [] and not state.failed and not state.decode_status
    # A new request reusing nothing of it decodes as usual.
    out = state.detokenize(step([("d", ids, FinishReason("length"))], new=True))
    assert out.output_strs == [IncrementalDetokenizer(tokenizer).add_tokens(ids, finished=True)]
