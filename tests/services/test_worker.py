"""The worker and the detokenizer as real processes on real sockets; the test plays the
tokenizer (docs/architecture.md §1): it pushes to the worker and pulls the text outputs and the
control replies."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from engine.sampling.sampling_params import SamplingParams
from services.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    Hello,
    TokenizedGenerateReqInput,
    WorkerReady,
)

MAX_TOTAL_TOKENS = 4096
LONG = SamplingParams(temperature=0, max_new_tokens=3000, ignore_eos=True)
"""A request that runs long enough to act on it mid-stream."""


@pytest.fixture(scope="module")
def stub(tiny_llama_dir: Path, launcher, make_stub):
    """The worker and the detokenizer, running and ready; returns the PeerStub that plays
    the tokenizer between them."""
    worker_port, detokenizer_port = launcher.free_port(), launcher.free_port()
    stub = make_stub("tokenizer", worker_port)
    flags = [
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--worker-port",
        str(worker_port),
        "--detokenizer-port",
        str(detokenizer_port),
        "--tokenizer-port",
        str(stub.output_port),
        "--tokenizer-control-port",
        str(stub.control_port),
    ]
    for role in ("worker", "detokenizer"):
        launcher.start(role, flags)
    stub.wait_for(lambda: any(isinstance(m, WorkerReady) for m in stub.replies), 120, "WorkerReady")
    return stub


def generate(stub, rid: str, input_ids: list[int], params: SamplingParams) -> None:
    stub.send(
        TokenizedGenerateReqInput(rid=rid, input_ids=input_ids, sampling_params=params, stream=True)
    )


def server_info(stub, rid: str) -> dict:
    stub.send(GetServerInfoReq(rid=rid))
    return stub.reply(GetServerInfoReqOutput, rid).info


def assert_all_kv_free(info: dict) -> None:
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["protected_kv_tokens"] == 0
    assert info["available_kv_tokens"] + info["evictable_kv_tokens"] == MAX_TOTAL_TOKENS


def test_worker_announces_its_limits_and_both_processes_heartbeat(stub):
    ready = stub.reply(WorkerReady)
    assert (ready.max_total_tokens, ready.context_length, ready.vocab_size) == (
        MAX_TOTAL_TOKENS,
        8192,
        49152,
    )
    assert ready.sender == "worker" and ready.eos_token_ids == [2]
    stub.wait_for(
        lambda: {m.sender for m in stub.alive_signs} >= {"worker", "detokenizer"}, 10, "heartbeats"
    )


def test_greedy_stream_equals_the_offline_engine(stub, offline, tokenizer):
    input_ids = tokenizer.encode("The capital of France is")
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "logprobs": True}
    expected = offline.generate(input_ids, params)[0]
    generate(stub, "greedy", input_ids, SamplingParams(**params))
    stream = stub.result("greedy")
    assert stream.ids == expected.output_ids
    assert stream.messages > 1, "the output should arrive token by token, not at the end"
    assert stream.text == tokenizer.decode(stream.ids, skip_special_tokens=True)
    assert msgspec.structs.asdict(stream.finished_reason) == {
        "type": "length",
        "matched": None,
        "message": None,
        "status_code": None,
    }
    assert (stream.prompt_tokens, stream.completion_tokens) == (len(input_ids), 24)
    assert stream.logprobs == pytest.approx(
        [lp for lp, _ in expected.meta.output_token_logprobs], abs=1e-4
    )


def test_stop_string_ends_the_stream_and_is_trimmed(stub, offline, tokenizer):
    input_ids = tokenizer.encode("Once upon a time")
    free = offline.generate(
        input_ids, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    )[0]
    text = free.text
    cut = len(tokenizer.decode(free.output_ids[:8]))
    stop = next(text[i : i + 3] for i in range(cut, len(text)) if text.find(text[i : i + 3]) == i)
    generate(
        stub,
        "stop",
        input_ids,
        SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=[stop]),
    )
    stream = stub.result("stop")
    assert stream.text == text[: text.index(stop)]
    assert not any(stop in delta for delta in stream.deltas)
    assert (stream.finished_reason.type, stream.finished_reason.matched) == ("stop", stop)


def test_a_request_that_can_never_fit_is_rejected_with_400_and_serving_goes_on(stub, tokenizer):
    generate(stub, "too-big", list(range(100, 200)), SamplingParams(max_new_tokens=5000))
    rejected = stub.result("too-big")
    assert (rejected.finished_reason.type, rejected.finished_reason.status_code) == ("abort", 400)
    assert "--max-total-tokens" in rejected.finished_reason.message
    assert (rejected.ids, rejected.prompt_tokens, rejected.completion_tokens) == ([], 100, 0)
    generate(stub, "after-too-big", tokenizer.encode("Hello"), SamplingParams(max_new_tokens=4))
    assert stub.result("after-too-big").finished_reason.type in ("length", "stop")


def test_abort_mid_stream_frees_the_kv_slots(stub, tokenizer):
    generate(stub, "to-abort", tokenizer.encode("Tell me a very long story"), LONG)
    stub.first_output("to-abort")
    stub.send(AbortReq(rid="to-abort"))
    stream = stub.result("to-abort")
    assert stream.finished_reason.type == "abort"
    assert 0 < stream.completion_tokens < LONG.max_new_tokens
    assert_all_kv_free(server_info(stub, "after-abort"))


def test_flush_is_refused_while_a_request_runs_and_empties_the_cache_when_idle(stub, tokenizer):
    generate(stub, "busy", tokenizer.encode("Count to a thousand"), LONG)
    stub.first_output("busy")
    stub.send(FlushCacheReq(rid="flush-busy"))
    refused = stub.reply(FlushCacheReqOutput, "flush-busy")
    assert not refused.success and "1 running" in refused.message
    stub.send(AbortReq(rid="busy"))
    stub.result("busy")
    stub.send(FlushCacheReq(rid="flush-idle"))
    assert stub.reply(FlushCacheReqOutput, "flush-idle").success
    info = server_info(stub, "after-flush")
    assert (info["available_kv_tokens"], info["evictable_kv_tokens"]) == (MAX_TOTAL_TOKENS, 0)


def test_a_step_whose_output_exceeds_the_frame_limit_arrives_split_and_every_request_finishes(
    stub, offline, tokenizer
):
    """Eight requests admitted together, each with a 9 MiB stop string: their first output
    batch carries the eight stop strings (72 MiB, over the 64 MiB frame limit). It goes as
    several messages; before, it was dropped and all eight hung."""
    input_ids = tokenizer.encode("Once upon a time")
    params = SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, stop=["\x00" * (9 * 2**20)]
    )
    expected = offline.generate(
        input_ids, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    )
    rids = [f"huge-stop-{i}" for i in range(8)]
    for rid in rids:
        generate(stub, rid, input_ids, params)
    for rid in rids:
        stream = stub.result(rid, timeout=60)
        assert stream.finished_reason.type == "length"
        assert stream.ids == expected[0].output_ids
    assert_all_kv_free(server_info(stub, "after-huge-stop"))


def test_garbage_on_the_worker_port_is_dropped_and_the_next_request_served(
    stub, launcher, tokenizer
):
    stub.send_raw(b"\xc1 not msgpack")
    stub.send_raw(msgspec.msgpack.encode({"type": "NoSuchMessage", "rid": "x"}))
    generate(
        stub, "after-garbage", tokenizer.encode("Hello again"), SamplingParams(max_new_tokens=4)
    )
    assert stub.result("after-garbage").finished
    assert launcher.procs["worker"].poll() is None


def test_a_restarted_tokenizer_learns_the_limits_again_and_its_old_requests_end(stub, tokenizer):
    generate(stub, "old-life", tokenizer.encode("Before the restart"), LONG)
    stub.first_output("old-life")
    stub.pump()
    stub.replies.clear()
    stub.sender.epoch = "restarted-tokenizer"
    stub.send(Hello())
    generate(
        stub, "new-life", tokenizer.encode("After the restart"), SamplingParams(max_new_tokens=4)
    )
    assert stub.reply(WorkerReady).max_total_tokens == MAX_TOTAL_TOKENS
    assert stub.result("old-life").finished_reason.type == "abort"
    assert stub.result("new-life").finished_reason.type in ("length", "stop")


def test_each_process_exits_0_on_sigterm_within_seconds(stub, launcher):
    for role in ("worker", "detokenizer"):
        start = time.monotonic()
        assert launcher.stop(role, timeout=5) == 0, f"{role} did not exit cleanly"
        assert time.monotonic() - start < 5
