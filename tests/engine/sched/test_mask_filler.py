"""The mask thread: rows fill beside the caller, a row past its budget costs its own
request only (a GrammarCostError; the other rows are filled on a fresh thread), a matcher
that raises is reported, and without a budget (tensor parallelism) every row is waited for.

The matcher here is a stand-in for a library's: its fill sleeps (without the GIL, as both
libraries' native fills run) and marks its row."""

from __future__ import annotations

import threading
import time

import torch

from engine.grammar.cost import GrammarCostError
from engine.sched.mask_filler import MaskFiller, MaskRow
from engine.sched.req import Req

VOCAB = 64


class SleepyMatcher:
    def __init__(self, seconds: float, fail: bool = False):
        self.seconds = seconds
        self.fail = fail
        self.done = threading.Event()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("the library raised")
        vocab_mask[row] = 1  # token 0 of each word only
        self.done.set()


def rows(*matchers: SleepyMatcher) -> list[MaskRow]:
    return [MaskRow(i, Req(f"r{i}", [1, 2]), m) for i, m in enumerate(matchers)]  # type: ignore[arg-type]


def test_a_row_past_its_budget_ends_its_request_and_the_others_are_filled():
    heard: list[tuple[str, float]] = []
    filler = MaskFiller(0.05, lambda library, seconds: heard.append((library, seconds)))
    slow, fast = SleepyMatcher(1.0), SleepyMatcher(0.0)
    batch = rows(SleepyMatcher(0.0), slow, fast)
    started = time.monotonic()
    mask, faults = filler.start(batch, 4, VOCAB, torch.device("cpu")).result()
    assert time.monotonic() - started < 0.5  # not the slow row's second
    assert [(req.rid, type(error)) for req, error in faults] == [("r1", GrammarCostError)]
    assert "longer than 50 ms" in str(faults[0][1])
    assert mask is not None
    assert mask[0].eq(1).all() and mask[2].eq(1).all()  # filled, the last on a fresh thread
    assert mask[1].eq(-1).all() and mask[3].eq(-1).all()  # the void row; no grammar
    assert fast.done.is_set() and not slow.done.is_set()
    assert len(heard) == 2
    filler.shutdown()


def test_a_raising_matcher_is_reported_and_no_budget_waits_for_every_row():
    filler = MaskFiller(None)
    batch = rows(SleepyMatcher(0.2), SleepyMatcher(0.0, fail=True))
    mask, faults = filler.start(batch, 2, VOCAB, torch.device("cpu")).result()
    assert [(req.rid, str(error)) for req, error in faults] == [("r1", "the library raised")]
    assert mask is not None and mask[0].eq(1).all() and mask[1].eq(-1).all()
    filler.shutdown()


def test_the_fill_runs_beside_the_caller():
    filler = MaskFiller(1.0)
    matcher = SleepyMatcher(0.3)
    started = time.monotonic()
    pending = filler.start(rows(matcher), 1, VOCAB, torch.device("cpu"))
    assert time.monotonic() - started < 0.1  # start returned before the fill ended
    time.sleep(0.3)  # the caller's "forward"
    pending.result()
    assert time.monotonic() - started < 0.5  # overlapped, not 0.6
    filler.shutdown()
