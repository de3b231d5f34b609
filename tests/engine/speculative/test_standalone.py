"""--speculative-algorithm STANDALONE: a draft model of the same tokenizer, run by a scheduler
of its own, drafts greedy chains that the model verifies. Two tiny random models give the
plain engine's greedy tokens; a model drafting for itself has every draft accepted; the
draft scheduler's radix tree serves each step's context; both pools come back whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.api import Engine
from testing.models import save_tiny_model
from tests.engine.speculative.test_speculative import GREEDY, answers, kv_idle_and_whole, prompts


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny Llama of the same vocabulary with other weights, and one layer."""
    return save_tiny_model(tmp_path_factory.mktemp("draft"), seed=7, num_hidden_layers=1)


def standalone(make_engine: Callable[..., Engine], draft: Path, **options: object) -> Engine:
    return make_engine(
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(draft),
        speculative_num_draft_tokens=5,
        speculative_draft_max_total_tokens=4096,
        **options,
    )


def draft_scheduler(engine: Engine):  # type: ignore[no-untyped-def]
    drafter = engine.core.draft_scheduler
    assert drafter is not None
    return drafter


def test_a_model_drafting_for_itself_has_every_draft_accepted(make_engine, tiny_model_dir):
    plain = make_engine()
    spec = standalone(make_engine, tiny_model_dir, speculative_adaptive=False)
    batch = prompts(6, seed=9)
    assert answers(spec.generate(batch, GREEDY)) == answers(plain.generate(batch, GREEDY))
    stats = spec.scheduler.stats
    assert stats.spec_proposed_tokens > 100
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens
    drafter = draft_scheduler(spec)
    assert drafter.stats.cache_hit_tokens > 0  # each step's context came from its radix tree
    assert kv_idle_and_whole(spec)
    drafter.cache_manager.check_integrity()
    assert not drafter.has_work()


def test_another_draft_model_leaves_the_greedy_tokens_unchanged(
    make_engine, tiny_model_dir, other_tiny_model
):
    plain = make_engine(disable_overlap_schedule=False)
    spec = standalone(make_engine, other_tiny_model, disable_overlap_schedule=False)
    batch = prompts(6, seed=10)
    params = [{**GREEDY, "max_new_tokens": 10 + 5 * i} for i in range(len(batch))]
    assert answers(spec.generate(batch, params)) == answers(plain.generate(batch, params))
    assert spec.scheduler.stats.spec_proposed_tokens > 0
    assert kv_idle_and_whole(spec)


def test_standalone_options_are_checked(make_engine, tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        make_engine(speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        make_engine(speculative_algorithm="NGRAM", speculative_draft_model_path="x")
    with pytest.raises(ValueError, match="STANDALONE runs at tp_size 1"):
        make_engine(speculative_algorithm="STANDALONE", speculative_draft_model_path="x", tp_size=2)
    wider = save_tiny_model(tmp_path / "wider", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        standalone(make_engine, wider)
