"""The per-token service path without processes: the worker's output batches as encoded on
the wire to the detokenizer (a request's constants go once), the detokenizer's state freed
with each request's last output, one wake-up per group per batch on the tokenizer side, and
pre-encoded SSE deltas equal to the stream's own events."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import FinishReason as EngineFinishReason
from engine.sched.req import Req
from engine.speculative.draft_state import DraftState
from services.detokenizer.detokenizer import BatchDetokenizer
from services.io_struct import (
    FRAME_HEADROOM_BYTES,
    BatchStrOutput,
    BatchTokenIDOutput,
    FinishReason,
    decode,
    encode,
)
from services.ipc import MAX_MESSAGE_BYTES
from services.tokenizer.manager import TokenizerManager, _Group
from services.tokenizer.serving_base import ChoiceAccumulator
from services.tokenizer.serving_chat import ChatCompletionStream
from services.tokenizer.serving_completions import CompletionStream
from services.tokenizer.serving_generate import generate_response
from services.tokenizer.serving_openai import ResponseHeader
from services.tokenizer.sse import DeltaEvents, sse_event
from services.worker.outputs import ReqState
from services.worker.worker import Worker

STOP = "a stop string long enough to spot on the wire"


class _Wire:
    """Stands for the worker's outbox to the detokenizer: keeps each message as encoded."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def put(self, msg: BatchTokenIDOutput) -> None:
        self.sent.append(encode(msg))


def bare_worker() -> tuple[Worker, _Wire]:
    """A Worker with only what `send_outputs` reads: no engine, no sockets."""
    worker = Worker.__new__(Worker)
    wire = _Wire()
    worker.to_detokenizer = wire  # type: ignore[assignment]
    worker.live, worker.rejected = {}, []
    worker.tracing = None
    worker.kv_events = worker.kv_publisher = None
    worker.epoch = "worker-epoch"
    worker.max_output_bytes = MAX_MESSAGE_BYTES - FRAME_HEADROOM_BYTES
    worker.speculative = False
    return worker, wire


def submit(worker: Worker, rid: str, params: SamplingParams) -> Req:
    req = Req(rid, [1, 2, 3], params)
    worker.live[rid] = ReqState("tokenizer-epoch")
    return req


def run_steps(tokenizer, texts: dict[str, str], aborted: str | None = None) -> list[bytes]:
    """Each rid of `texts` generates its text's ids one per step (all in one batch), then
    finishes by length (`aborted`: by an abort, one step early); the encoded batches."""
    worker, wire = bare_worker()
    ids = {rid: tokenizer.encode(text) for rid, text in texts.items()}
    reqs = {rid: submit(worker, rid, SamplingParams(stop=[STOP])) for rid in texts}
    for step in range(max(len(i) for i in ids.values())):
        advanced = []
        for rid, req in reqs.items():
            if req.finished or step >= len(ids[rid]):
                continue
            req.output_ids.append(ids[rid][step])
            if rid == aborted and step == len(ids[rid]) - 2:
                req.finish(EngineFinishReason("abort", message="client left"))
            elif step == len(ids[rid]) - 1:
                req.finish(EngineFinishReason("length"))
            advanced.append(req)
        worker.send_outputs(advanced)
    assert not worker.live
    return wire.sent


def detokenized(tokenizer, wire: list[bytes]) -> tuple[BatchDetokenizer, dict[str, str]]:
    detokenizer = BatchDetokenizer(tokenizer)
    texts: dict[str, str] = {}
    for data in wire:
        batch = decode(data)
        assert isinstance(batch, BatchTokenIDOutput)
        out = detokenizer.detokenize(batch)
        for rid, text in zip(out.rids, out.output_strs):
            texts[rid] = texts.get(rid, "") + text
    return detokenizer, texts


def test_a_requests_constants_cross_the_wire_once_with_its_first_output(tokenizer):
    wire = run_steps(tokenizer, {"a": "Hello world, how are you?", "b": "Bonjour à tous"})
    assert len(wire) > 3
    assert sum(data.count(STOP.encode()) for data in wire) == 2, "once per request"
    first, *later = [decode(data) for data in wire]
    assert [s.rid for s in first.new_reqs] == ["a", "b"]
    assert first.new_reqs[0].stop == [STOP]
    assert all(batch.new_reqs == [] for batch in later)
    # A step's batch of the same two rids costs the same bytes, whatever their stop strings.
    steady = [
        len(d) for d, b in zip(wire[1:], later) if len(b.rids) == 2 and not any(b.finished_reasons)
    ]
    assert steady and max(steady) < len(wire[0]) - 2 * len(STOP)


def test_the_detokenizer_frees_a_requests_state_when_it_finishes(tokenizer):
    texts = {"a": "Hello world, how are you?", "b": "Café 日本語 🙂!"}
    detokenizer, out = detokenized(tokenizer, run_steps(tokenizer, texts))
    assert out == texts
    assert detokenizer.decode_status == {}


def test_the_detokenizer_frees_a_requests_state_when_it_is_aborted(tokenizer):
    texts = {"a": "Hello world, how are you?", "gone": "one two three four five"}
    detokenizer, out = detokenized(tokenizer, run_steps(tokenizer, texts, aborted="gone"))
    assert out["a"] == texts["a"]
    assert texts["gone"].startswith(out["gone"]) and out["gone"] != texts["gone"]
    assert detokenizer.decode_status == {}


def test_a_rejected_request_carries_its_state_and_leaves_none(tokenizer):
    worker, wire = bare_worker()
    req = Req("refused", [1], SamplingParams(stop=[STOP]))
    req.finish(EngineFinishReason("abort", message="too long", status_code=400))
    worker.rejected.append(req)
    worker.send_outputs([])
    (batch,) = [decode(d) for d in wire.sent]
    assert [s.rid for s in batch.new_reqs] == ["refused"]
    detokenizer = BatchDetokenizer(tokenizer)
    assert detokenizer.detokenize(batch).output_strs == [""]
    assert detokenizer.decode_status == {}


def _str_batch(rows: list[tuple[str, str]], finished: set[str] = frozenset()) -> BatchStrOutput:
    n = len(rows)
    return BatchStrOutput(
        rids=[rid for rid, _ in rows],
        output_ids=[[7]] * n,
        finished_reasons=[FinishReason("length") if rid in finished else None for rid, _ in rows],
        prompt_tokens=[3] * n,
        completion_tokens=[1] * n,
        cached_tokens=[0] * n,
        output_strs=[text for _, text in rows],
    )


def test_the_tokenizer_wakes_a_group_once_per_batch_with_every_row_it_brought():
    async def scenario() -> None:
        manager = TokenizerManager.__new__(TokenizerManager)  # routing only: no sockets
        manager.tokenizer, manager.num_queued = None, 3
        pair = _Group(index={"p-0": 0, "p-1": 1}, unfinished={"p-0", "p-1"})
        alone = _Group(index={"q-0": 0}, unfinished={"q-0"}, queued={"q-0"})
        manager.groups = {"p-0": pair, "p-1": pair, "q-0": alone}
        manager._route(_str_batch([("p-0", "a"), ("q-0", "b"), ("p-1", "c"), ("gone", "d")]))
        assert pair.queue.qsize() == 1 and alone.queue.qsize() == 1
        outputs = pair.queue.get_nowait()
        assert isinstance(outputs, list)
        assert [(o.rid, o.index, o.text) for o in outputs] == [("p-0", 0, "a"), ("p-1", 1, "c")]
        assert manager.num_queued == 2 and not alone.queued

    asyncio.run(scenario())


@pytest.mark.parametrize("speculative", [True, False])
def test_spec_decoding_stats_cross_the_wire_into_generate_meta_info(tokenizer, speculative):
    """Under speculative decoding a request's verify passes and tokens per pass go from the
    worker through the detokenizer to the native answer's meta_info; without it, neither
    the wire nor the answer carries them."""
    worker, wire = bare_worker()
    worker.speculative = speculative
    req = submit(worker, "s", SamplingParams())
    req.output_ids += tokenizer.encode("one two three four five six")
    req.draft_state = DraftState(verify_ct=2, accepted_drafts=3)  # 1 + 3/2 tokens per pass
    req.finish(EngineFinishReason("length"))
    worker.send_outputs([req])
    (data,) = wire.sent
    batch = decode(data)
    assert isinstance(batch, BatchTokenIDOutput)
    out = BatchDetokenizer(tokenizer).detokenize(batch)
    manager = TokenizerManager.__new__(TokenizerManager)  # routing only: no sockets
    manager.tokenizer, manager.num_queued = None, 0
    group = _Group(index={"s": 0}, unfinished={"s"})
    manager.groups = {"s": group}
    manager._route(out)
    outputs = group.queue.get_nowait()
    assert isinstance(outputs, list)
    choice = ChoiceAccumulator(want_logprobs=False).add(outputs[0])
    assert choice is not None
    meta_info = generate_response(choice)["meta_info"]
    if speculative:
        assert (batch.spec_verify_ct, batch.spec_accept_length) == ([2], [2.5])
        assert (out.spec_verify_ct, out.spec_accept_length) == ([2], [2.5])
        assert (meta_info["spec_verify_ct"], meta_info["spec_accept_length"]) == (2, 2.5)
    else:
        assert batch.spec_verify_ct is None and batch.spec_accept_length is None
        assert b"spec_" not in data  # omitted from the wire, not sent as nulls
        assert "spec_verify_ct" not in meta_info and "spec_accept_length" not in meta_info


TEXTS = [
    "Hello",
    " world",
    ' "quoted" \\ back',
    "tab\there\nnew",
    "\x00\x1f\x7f",
    "é 日本 🙂",
    "\u2028",
]


@pytest.mark.parametrize("stream_type", [ChatCompletionStream, CompletionStream])
def test_pre_encoded_deltas_equal_the_streams_own_events(stream_type):
    header = ResponseHeader(id="chatcmpl-1234", model="the-model", created=1700000000)
    stream = stream_type(header, n=2)
    fast = DeltaEvents(stream.text_chunk)
    for index in (0, 1):
        stream.delta(index, "")  # opens the choice
    for i, text in enumerate(TEXTS * 2):
        index = i % 2
        (delta,) = stream.delta(index, text)
        assert fast.encode(delta) == sse_event(stream.text_chunk(delta)), text
    assert stream.delta(0, "") == []
    assert stream.text_offsets == {0: len("".join(TEXTS)), 1: len("".join(TEXTS))}
