"""Containment: an error raised while the scheduler handles one request's grammar (its
compile, mask, accept or jump-forward) or its logprobs fails that request alone, with a
server error, its KV freed; the other requests of the same batch produce exactly the tokens
they produce alone, and the loop serves on."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.api import Engine
from engine.grammar import PendingGrammar
from engine.grammar.xgrammar_backend import XGrammarMatcher
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
PROMPTS = ["The capital of France is", "One, two, three,", "Write a word:"]
"""The faulty request's prompt first, then its two batch-mates'."""
CONSTRAINED = {**GREEDY, "regex": "[a-z]{4}-[a-z]{20}"}
"""Its '-' is forced text: jump-forward plans a jump there."""


def _boom(*args: object, **kwargs: object) -> None:
    raise RuntimeError("boom")


FAULTS = {
    "grammar compile": (PendingGrammar, "result", "compiling its grammar"),
    "grammar mask": (XGrammarMatcher, "fill_vocab_mask", "masking its grammar's tokens"),
    "grammar accept": (XGrammarMatcher, "accept_token", "processing its sampled token"),
    "jump-forward": (
        XGrammarMatcher,
        "find_jump_forward_string",
        "processing its sampled token",
    ),
}
"""Where the constrained request raises: (class, method made to raise, the stage its error
names). Only it has a grammar, so only it meets the raising method; auto serves its regex
with xgrammar."""


@pytest.fixture(scope="module", params=[False, True], ids=["normal", "overlap"])
def engine(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine(
        str(tiny_llama_dir),
        dtype="float64",
        device="cpu",
        max_total_tokens=4096,
        enable_jump_forward=True,
        disable_overlap_schedule=not request.param,
    ) as engine:
        assert (
            engine.scheduler.output_processor.jump_forward
            and engine.scheduler.overlap is request.param
        )
        yield engine


@pytest.fixture(scope="module")
def alone(engine: Engine) -> list[list[int]]:
    """The batch-mates' output ids, each generated alone."""
    return [engine.generate(p, GREEDY)[0].output_ids for p in PROMPTS[1:]]


def assert_idle_and_whole(engine: Engine) -> None:
    scheduler = engine.scheduler
    scheduler.run_event_loop(lambda: scheduler.in_flight is None)
    assert not scheduler.has_work()
    cache = scheduler.cache_manager
    cache.check_integrity()
    allocator = cache.allocator
    assert allocator.available_size() + cache.tree_cache.evictable_size() == allocator.size
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


def run_batch_with_fault(engine: Engine, caplog: pytest.LogCaptureFixture) -> list[Req]:
    """Submit the constrained request and its two batch-mates together, run them to the end."""
    scheduler = engine.scheduler
    reqs = [engine._submit(PROMPTS[0], _params(CONSTRAINED))]
    reqs += [engine._submit(p, _params(GREEDY)) for p in PROMPTS[1:]]
    with caplog.at_level(logging.ERROR, logger="engine.sched.scheduler"):
        scheduler.run_event_loop(should_stop=lambda: all(r.finished for r in reqs))
    return reqs


def _params(options: dict) -> SamplingParams:
    return SamplingParams.from_dict(dict(options))


def assert_failed_alone(
    reqs: list[Req], alone: list[list[int]], stage: str, caplog: pytest.LogCaptureFixture
) -> None:
    faulty, *mates = reqs
    reason = faulty.lifecycle.finished_reason
    assert reason is not None and reason.type == "abort"
    assert reason.status_code is None  # a server error: the client sees a 500
    assert f"internal server error while {stage}" in (reason.message or "")
    assert [r.output_ids for r in mates] == alone
    assert [r.lifecycle.finished_reason.type for r in mates] == ["length", "length"]
    logged = [r for r in caplog.records if r.exc_info and faulty.rid in r.getMessage()]
    assert len(logged) == 1 and "boom" in str(logged[0].exc_info[1])


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_request_whose_grammar_raises_fails_alone_and_its_batch_mates_match_running_alone(
    engine, alone, fault, monkeypatch, caplog
):
    owner, method, stage = FAULTS[fault]
    monkeypatch.setattr(owner, method, _boom)
    reqs = run_batch_with_fault(engine, caplog)
    assert_failed_alone(reqs, alone, stage, caplog)
    assert_idle_and_whole(engine)
    monkeypatch.undo()
    again = engine.generate(PROMPTS[0], CONSTRAINED)[0]
    assert again.meta.finish_reason.type != "abort" and re.match("[a-z]{4}-", again.text)
