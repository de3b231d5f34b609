"""A fleet of three replicas of the services' tiny model behind SGLang's gateway `smg`:
cache-aware routing keeps one replica's hit rate and beats round-robin by far, routing by
the replicas' published KV events does as well as one replica, no request is lost, and
every replica's KV comes back to idle.

The workload is sent one request at a time in a seeded order: smg's load-balance fallback
never fires (nothing is in flight elsewhere), so the hit rates are the same on every run
(which replica gets which prompt may change: smg breaks ties at random). 8 system prompts
x 3 questions: with three requests per prompt, round-robin misses most (each prompt's
first visit to each replica misses), while a router that keeps a prompt on one replica
misses once per prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.fleet.precise import choose, matched_blocks
from benchmarks.fleet.replicas import Counters, Replica, sample_total, start_fleet
from benchmarks.fleet.run import FleetRun, ModeResult, subscribe, text_prompt, warm_up
from benchmarks.serving.workloads import WorkloadConfig, build, warmup_prompt
from testing.launcher import cpu_flags

WORKLOAD = WorkloadConfig(
    seed=0, requests=24, groups=8, system_len=256, question_len=16, output_len=4
)
REPLICAS = 3
MODES = ("single", "cache_aware", "round_robin", "precise")


@pytest.fixture(scope="module")
def fleet(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    """Three replicas, started at once (a 2 s heartbeat: nine processes share the cores)."""
    log_dir = tmp_path_factory.mktemp("fleet")
    with start_fleet(
        REPLICAS,
        cpu_flags(8192, tiny_llama_dir),
        log_dir,
        kv_events=True,
        heartbeat_interval=2.0,
        timeout=180,
        show_logs=True,
    ) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def results(
    fleet: list[Replica], tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, ModeResult]:
    """The shared-prefix workload through every mode, one after the other."""
    model, _ = fleet[0].model_info()
    warm_up(fleet, model, text_prompt(tokenizer, warmup_prompt(WORKLOAD)))
    requests = build("shared-prefix", WORKLOAD)
    prompts = [text_prompt(tokenizer, r.prompt) for r in requests]
    log_dir = tmp_path_factory.mktemp("fleet-smg")
    with subscribe(fleet) as events:
        run = FleetRun(fleet, requests, prompts, model, log_dir, events=events, timeout_s=60)
        out = {mode: run.run(mode) for mode in MODES}
    for r in out.values():
        print(r.mode, f"hit {r.hit_rate:.3f}", r.requests_per_replica, r.summary.errors)
    return out


def test_cache_aware_routing_keeps_a_single_replicas_hit_rate(results: dict[str, ModeResult]):
    single = results["single"].hit_rate
    assert single > 0.5  # the workload does share prefixes
    assert results["cache_aware"].hit_rate >= 0.9 * single


def test_cache_aware_routing_beats_round_robin_by_25_points(results: dict[str, ModeResult]):
    assert results["cache_aware"].hit_rate >= results["round_robin"].hit_rate + 0.25
    # Fewer hits, more prefill: the tokens round-robin recomputes.
    assert results["round_robin"].prefill_tokens > results["cache_aware"].prefill_tokens


def test_no_request_is_lost_and_every_replica_returns_to_idle(results: dict[str, ModeResult]):
    for mode, r in results.items():
        assert r.lost == 0 and r.summary.errors == {}, mode
        assert sum(r.requests_per_replica) == WORKLOAD.requests, mode
        assert r.idle == [True] * REPLICAS, mode
    assert results["single"].requests_per_replica == [WORKLOAD.requests, 0, 0]
    assert results["round_robin"].requests_per_replica == [WORKLOAD.requests // REPLICAS] * 3


def test_routing_by_kv_events_keeps_a_single_replicas_hit_rate(results: dict[str, ModeResult]):
    precise = results["precise"]
    assert precise.hit_rate >= 0.9 * results["single"].hit_rate
    assert precise.event_waits_timed_out == 0  # every choice saw the fleet as it was


# ----- the pieces, without servers ------------------------------------------------------


def test_choose_takes_the_longest_stored_prefix_then_the_least_assigned_replica():
    chain = [11, 12, 13]
    assert choose(chain, [{11}, {11, 12}, {12, 13}], [0, 5, 0]) == 1
    assert choose(chain, [{11}, {11}, set()], [3, 1, 0]) == 1
    assert choose(chain, [set(), set(), set()], [1, 0, 0]) == 1
    assert matched_blocks(chain, {12, 13}) == 0  # a prefix, not any overlap


def test_text_prompts_that_share_token_chunks_share_their_text(tokenizer):
    rng = random.Random(0)
    shared = [rng.randrange(100, 49152) for _ in range(64)]
    a, b = (text_prompt(tokenizer, shared + [rng.randrange(100, 49152)] * 7) for _ in range(2))
    prefix = text_prompt(tokenizer, shared)
    assert a.startswith(prefix) and b.startswith(prefix)


def test_counters_sum_label_sets_and_subtract():
    text = 'x_total{a="1"} 2.0\nx_total{a="2"} 3.0\n'
    assert sample_total(text, "x_total") == 5.0 and sample_total(text, "y_total") == 0.0
    assert Counters(5, 10, 7, 2) - Counters(1, 2, 3, 1) == Counters(4, 8, 4, 1)
