"""The worker's metrics: the collector's arithmetic on plain samples, and a real Worker
(in this process, model loaded, no peers) that turns scheduler events into metrics and
serves them with its health on its own port."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.kernels.cpu.isa import ISA_FLAGS, PATHS
from engine.sampling.sampling_params import SamplingParams
from engine.sched.scheduler import after_turns
from observability.worker_metrics import (
    ROLLING_WINDOW_S,
    CpuInfo,
    SWASample,
    WorkerMetrics,
    WorkerSample,
)
from services.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from services.settings import PORT_FIELDS, Settings
from services.worker.metrics import METRICS_SAMPLE_INTERVAL_S
from services.worker.worker import Worker
from testing.net import free_ports

IDLE = WorkerSample(
    time=0.0,
    cache_hit_tokens=0,
    cache_query_tokens=0,
    prompt_tokens=0,
    generation_tokens=0,
    retracted_requests=0,
    retracted_input_tokens=0,
    retracted_output_tokens=0,
    evicted_tokens=0,
    new_token_ratio=0.7,
    evictable_tokens=0,
    protected_tokens=0,
    available_tokens=1000,
    total_tokens=1000,
    num_running=0,
    num_waiting=0,
    num_grammar_queue=0,
)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "tp_rank": "0", **labels})


def metrics(model_name: str = "m") -> tuple[CollectorRegistry, WorkerMetrics]:
    registry = CollectorRegistry()
    return registry, WorkerMetrics(registry, model_name)


def test_kv_usage_counts_only_what_live_requests_hold():
    sample = dataclasses.replace(
        IDLE, available_tokens=600, evictable_tokens=300, protected_tokens=50
    )
    assert sample.kv_usage == pytest.approx(0.1)  # 1000 - 600 free - 300 the tree could give back
    assert (
        dataclasses.replace(IDLE, available_tokens=700, evictable_tokens=300).kv_usage == 0
    )  # idle: no leak
    registry, m = metrics()
    m.publish(sample)
    assert value(registry, "radixserve_kv_usage_ratio") == pytest.approx(0.1)
    assert value(registry, "radixserve_cache_config_info", page_size="1", num_pages="1000") == 1


def test_a_hybrid_model_adds_its_sliding_window_pool_and_the_hits_per_pool():
    registry, m = metrics()
    m.publish(IDLE)
    assert b"swa" not in generate_latest(registry), "one pool: no sliding-window series"
    m.publish(
        dataclasses.replace(
            IDLE,
            cache_hit_tokens=30,
            cache_full_hit_tokens=50,
            cache_query_tokens=80,
            swa=SWASample(
                total_tokens=300, available_tokens=100, evictable_tokens=150, protected_tokens=20
            ),
        )
    )
    assert value(registry, "radixserve_swa_kv_usage_ratio") == pytest.approx(50 / 300)
    assert value(registry, "radixserve_swa_kv_total_tokens") == 300
    assert value(registry, "radixserve_radix_swa_evictable_tokens") == 150
    assert value(registry, "radixserve_radix_swa_protected_tokens") == 20
    hits = "radixserve_swa_prefix_cache_hit_tokens_total"
    assert (value(registry, hits, pool="full"), value(registry, hits, pool="swa")) == (50, 30)


def test_two_worker_metric_sets_in_one_process_do_not_collide():
    (ra, a), (rb, b) = metrics("m"), metrics("other")
    a.publish(dataclasses.replace(IDLE, cache_hit_tokens=5, cache_query_tokens=10))
    b.publish(IDLE)
    a.observe_forward("decode", 4, 0.01)
    assert value(ra, "radixserve_prefix_cache_hit_tokens_total") == 5
    assert (
        rb.get_sample_value(
            "radixserve_prefix_cache_hit_tokens_total", {"model_name": "other", "tp_rank": "0"}
        )
        == 0
    )
    assert b"decode" not in generate_latest(rb)


def test_rolling_gauges_follow_the_last_window_while_counters_keep_everything():
    registry, m = metrics()
    m.publish(dataclasses.replace(IDLE, time=0.0, cache_hit_tokens=90, cache_query_tokens=100))
    assert value(registry, "radixserve_cache_hit_rate") == pytest.approx(
        0.9
    )  # one sample: since the start
    m.publish(
        dataclasses.replace(
            IDLE, time=10.0, cache_hit_tokens=90, cache_query_tokens=200, generation_tokens=50
        )
    )
    assert value(registry, "radixserve_cache_hit_rate") == pytest.approx(
        0.0
    )  # 0 hits in the 100 new queries
    assert value(registry, "radixserve_generation_tokens_per_second") == pytest.approx(5.0)
    later = ROLLING_WINDOW_S + 20
    m.publish(
        dataclasses.replace(
            IDLE, time=later, cache_hit_tokens=140, cache_query_tokens=300, generation_tokens=50
        )
    )
    assert value(registry, "radixserve_cache_hit_rate") == pytest.approx(
        0.5
    )  # the first sample left the window
    m.publish(
        dataclasses.replace(IDLE, time=later + 5, cache_hit_tokens=140, cache_query_tokens=300)
    )
    assert value(registry, "radixserve_cache_hit_rate") == pytest.approx(
        0.5
    )  # no new admission: unchanged
    assert value(registry, "radixserve_prefix_cache_query_tokens_total") == 300


def test_grammar_compiles_masks_hits_and_refusals_are_counted_per_library():
    registry, m = metrics()
    m.observe_grammar_compile("xgrammar", 0.02)
    m.observe_grammar_mask("llguidance", 0.0002)
    m.observe_grammar_mask("llguidance", 0.0004)
    m.count_grammar_cache_hit("xgrammar")
    m.count_grammar_refusal("xgrammar", "compile_budget")
    m.count_grammar_refusal("llguidance", "mask_budget")
    assert value(registry, "radixserve_grammar_compile_time_seconds_count", backend="xgrammar") == 1
    assert value(registry, "radixserve_grammar_mask_time_seconds_count", backend="llguidance") == 2
    assert value(registry, "radixserve_grammar_cache_hits_total", backend="xgrammar") == 1
    refusals = "radixserve_grammar_refusals_total"
    assert value(registry, refusals, backend="xgrammar", reason="compile_budget") == 1
    assert value(registry, refusals, backend="llguidance", reason="mask_budget") == 1


def test_spec_counters_and_the_accept_length_histogram_come_from_the_sample():
    registry, m = metrics()
    m.publish(IDLE)  # speculation off: zeros, so the dashboard's queries still find series
    assert value(registry, "radixserve_spec_verify_steps_total") == 0
    assert value(registry, "radixserve_spec_accept_length_bucket", le="+Inf") == 0
    m.publish(
        dataclasses.replace(
            IDLE,
            spec_verify_steps=6,
            spec_proposed_tokens=30,
            spec_accepted_tokens=9,
            spec_accept_lengths=((1, 2), (3, 2), (4, 1), (20, 1)),  # 20: past the last bucket
        )
    )
    assert value(registry, "radixserve_spec_verify_steps_total") == 6
    assert value(registry, "radixserve_spec_proposed_tokens_total") == 30
    assert value(registry, "radixserve_spec_accepted_tokens_total") == 9
    buckets = {
        s.labels["le"]: s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
        if s.name == "radixserve_spec_accept_length_bucket"
    }
    cumulative = [2, 2, 4, 5] + [5] * 12
    assert buckets == {**{str(le): float(n) for le, n in zip(range(1, 17), cumulative)}, "+Inf": 6}
    assert value(registry, "radixserve_spec_accept_length_count") == 6
    assert value(registry, "radixserve_spec_accept_length_sum") == 1 * 2 + 3 * 2 + 4 + 20


def test_cpu_info_labels_what_runs_the_model_and_is_there_before_any_sample():
    registry = CollectorRegistry()
    WorkerMetrics(
        registry, "m", cpu_info=CpuInfo("avx2", "float32", "gguf:Q4_1", "float16", "true")
    )
    assert (
        value(
            registry,
            "radixserve_cpu_info",
            isa="avx2",
            dtype="float32",
            weights="gguf:Q4_1",
            kv_cache_dtype="float16",
            deterministic="true",
        )
        == 1
    )
    assert b"radixserve_cpu_info" not in generate_latest(metrics()[0])  # none given: none shown


# ----- a real Worker ----------------------------------------------------------------------


def tiny_worker_settings(model: Path, **options: Any) -> Settings:
    """A worker on free ports serving the tiny model as "m" in float32."""
    ports = dict(zip(PORT_FIELDS, free_ports(len(PORT_FIELDS))))
    return Settings(
        model=str(model),
        dtype="float32",
        device="cpu",
        host="127.0.0.1",
        served_model_name="m",
        **ports,
        **options,
    )


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: Path) -> Iterator[Worker]:
    worker = Worker(
        tiny_worker_settings(
            tiny_llama_dir, max_total_tokens=2048, chunked_prefill_size=32, heartbeat_interval=0.2
        )
    )
    yield worker
    worker.close()


def test_a_deterministic_worker_says_so_in_server_info_and_metrics(tiny_llama_dir: Path):
    worker = Worker(
        tiny_worker_settings(
            tiny_llama_dir, max_total_tokens=512, enable_deterministic_inference=True
        )
    )
    try:
        assert worker.server_info()["enable_deterministic_inference"] is True
        url = f"http://127.0.0.1:{worker.settings.worker_metrics_port}"
        families = text_string_to_metric_families(httpx2.get(f"{url}/metrics").text)
        [info] = [s for f in families for s in f.samples if s.name == "radixserve_cpu_info"]
        assert info.labels["deterministic"] == "true"
    finally:
        worker.close()


def sent_outputs(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> list[BatchTokenIDOutput]:
    """The output batches the worker sends to the detokenizer from now on (still sent)."""
    sent: list[BatchTokenIDOutput] = []
    put = worker.to_detokenizer.put

    def keep(batch: BatchTokenIDOutput) -> None:
        sent.append(batch)
        put(batch)

    monkeypatch.setattr(worker.to_detokenizer, "put", keep)
    return sent


def test_a_speculative_worker_counts_its_verify_passes_and_sends_each_requests_share(
    tiny_llama_dir: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
):
    """NGRAM: a greedy request repeating an earlier one is drafted from the trie the first
    fed, so its drafts are accepted; the counters reach /metrics, and the output batches
    carry each request's `spec_verify_ct` and `spec_accept_length`."""
    worker = Worker(
        tiny_worker_settings(tiny_llama_dir, max_total_tokens=512, speculative_algorithm="NGRAM")
    )
    sent = sent_outputs(worker, monkeypatch)
    try:
        info = worker.server_info()
        assert info["speculative_algorithm"] == "NGRAM"
        assert info["speculative_num_draft_tokens"] == worker.settings.speculative_num_draft_tokens
        prompt = tokenizer.encode("one two three four five six seven eight. " * 4)
        params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
        for rid in ("first", "again"):
            run(
                worker,
                TokenizedGenerateReqInput(rid=rid, input_ids=prompt, sampling_params=params),
            )
        url = f"http://127.0.0.1:{worker.settings.worker_metrics_port}"
        samples = {
            (s.name, s.labels.get("le")): s.value
            for f in text_string_to_metric_families(httpx2.get(f"{url}/metrics").text)
            for s in f.samples
        }
        steps = samples["radixserve_spec_verify_steps_total", None]
        accepted = samples["radixserve_spec_accepted_tokens_total", None]
        assert steps > 0 and 0 < accepted <= samples["radixserve_spec_proposed_tokens_total", None]
        assert samples["radixserve_spec_accept_length_count", None] == steps
        assert samples["radixserve_spec_accept_length_bucket", "+Inf"] == steps
        assert samples["radixserve_spec_accept_length_sum", None] == steps + accepted
        assert worker.server_info()["scheduler_stats"]["spec_verify_steps"] == steps
        last = {
            rid: (batch.spec_verify_ct[i], batch.spec_accept_length[i])
            for batch in sent
            for i, rid in enumerate(batch.rids)
            if batch.spec_verify_ct is not None and batch.spec_accept_length is not None
        }
        assert set(last) == {"first", "again"}  # every row carries them, zeros included
        verify_ct, accept_length = last["again"]
        assert verify_ct > 0 and accept_length > 1
    finally:
        worker.close()


def run(worker: Worker, *reqs: TokenizedGenerateReqInput) -> None:
    for req in reqs:
        worker.handle(req)
    worker.serve(lambda: not worker.has_work())
    time.sleep(METRICS_SAMPLE_INTERVAL_S)
    worker.serve(
        after_turns(1)
    )  # a loop turn, when a sample is due: publishes what the scrape reads


def test_worker_counts_each_request_once_and_observes_its_batches(worker: Worker, tokenizer):
    prefix = tokenizer.encode(
        "The history of the radix tree and of prefix caching in language model serving. " * 4
    )
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    reqs = [
        TokenizedGenerateReqInput(
            rid=f"r{i}", input_ids=prefix + tokenizer.encode(f" Part {i}."), sampling_params=params
        )
        for i in range(3)
    ]
    run(worker, reqs[0])
    run(worker, *reqs[1:])
    registry = worker.registry
    # Chunked prefill (32 tokens a chunk) still counts each request's prompt once.
    assert value(registry, "radixserve_prefix_cache_query_tokens_total") == sum(
        len(r.input_ids) for r in reqs
    )
    assert value(registry, "radixserve_prefix_cache_hit_tokens_total") >= 2 * (len(prefix) - 1)
    assert value(registry, "radixserve_queue_time_seconds_count") == 3
    assert value(registry, "radixserve_generation_tokens_total") == 12
    assert value(registry, "radixserve_batch_size_count", mode="extend") >= 3
    assert value(registry, "radixserve_forward_time_seconds_count", mode="decode") >= 3
    assert value(registry, "radixserve_kv_usage_ratio") == 0
    assert value(registry, "radixserve_kv_total_tokens") == 2048


def test_worker_counts_a_refused_grammar(worker: Worker):
    params = SamplingParams(max_new_tokens=4, regex="(unclosed")
    run(
        worker,
        TokenizedGenerateReqInput(rid="bad-grammar", input_ids=[1, 2, 3], sampling_params=params),
    )
    refusals = "radixserve_grammar_refusals_total"
    # auto: neither library parses it, so it goes to llguidance, which refuses it
    assert value(worker.registry, refusals, backend="llguidance", reason="invalid") == 1


def test_worker_serves_metrics_and_a_healthz_that_fails_when_the_loop_stalls(worker: Worker):
    url = f"http://127.0.0.1:{worker.settings.worker_metrics_port}"
    assert (
        'radixserve_num_requests_running{model_name="m",tp_rank="0"} 0.0'
        in httpx2.get(f"{url}/metrics").text
    )
    assert httpx2.get(f"{url}/healthz").status_code == 200
    turned, progressed = worker.last_turn, worker.last_progress
    worker.last_turn -= worker.settings.stall_timeout + 1
    worker.last_progress = worker.last_turn
    try:
        reply = httpx2.get(f"{url}/healthz")
        assert reply.status_code == 503 and "has made no progress" in reply.text
        worker.mark_progress()  # a layer of a long prefill: computing, not stuck
        assert httpx2.get(f"{url}/healthz").status_code == 200
    finally:
        worker.last_turn, worker.last_progress = turned, progressed
    assert httpx2.get(f"{url}/nothing").status_code == 404


def test_worker_reports_its_cpu_kernel_path_in_metrics_and_server_info(worker: Worker):
    info = worker.server_info()
    assert info["cpu_isa"] in PATHS
    assert info["enable_deterministic_inference"] is False
    assert set(info["cpu_flags"]) <= set(ISA_FLAGS)
    if info["cpu_isa"] != "none":
        assert {"avx2", "fma", "f16c"} <= set(info["cpu_flags"])
    url = f"http://127.0.0.1:{worker.settings.worker_metrics_port}"
    samples = [
        sample
        for family in text_string_to_metric_families(httpx2.get(f"{url}/metrics").text)
        for sample in family.samples
        if sample.name == "radixserve_cpu_info"
    ]
    assert [(s.labels, s.value) for s in samples] == [
        (
            {
                "model_name": "m",
                "tp_rank": "0",
                "isa": info["cpu_isa"],
                "dtype": "float32",
                "weights": "float32",
                "kv_cache_dtype": "float32",  # the dtype set explicitly: so is the cache's
                "deterministic": "false",
            },
            1,
        )
    ]


def test_a_worker_without_speculation_sends_no_spec_columns(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
):
    sent = sent_outputs(worker, monkeypatch)
    params = SamplingParams(temperature=0, max_new_tokens=2)
    run(worker, TokenizedGenerateReqInput(rid="plain", input_ids=[1, 2, 3], sampling_params=params))
    assert sent and all(b.spec_verify_ct is None and b.spec_accept_length is None for b in sent)
    assert worker.server_info()["speculative_algorithm"] is None
    assert value(worker.registry, "radixserve_spec_verify_steps_total") == 0
