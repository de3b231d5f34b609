"""Messages between the tokenizer, worker and detokenizer (see docs/architecture.md).

Every message is a `msgspec.Struct` in the tagged union `Message` (tag field "type",
tag value the class name), encoded as msgpack. Decoding is typed: bytes that are not a
well-formed message of a known type raise `ProtocolError` and nothing else, so a
receiver can drop them. Nothing is unpickled: a socket must never be a way to run code.

Who sends what to whom (ports are Settings fields):

    tokenizer   → worker       (worker_port):            TokenizedGenerateReqInput, AbortReq,
                                                          FlushCacheReq, GetServerInfoReq,
                                                          LoadLoRAAdapterReq, UnloadLoRAAdapterReq
    worker      → detokenizer  (detokenizer_port):       BatchTokenIDOutput (with a
                                                          DetokenizerReqState per new rid)
    detokenizer → tokenizer    (tokenizer_port):         BatchStrOutput
    worker      → tokenizer    (tokenizer_control_port): WorkerReady, FlushCacheReqOutput,
                                                          GetServerInfoReqOutput,
                                                          LoRAAdapterReqOutput
    every process, on every socket it sends on:          Hello (once), Heartbeat (every second)

Every message carries `sender` (the process role) and `epoch` (unique per process start);
`services.ipc.Sender` stamps both, and `services.ipc.PeerMonitor` uses them to drop
messages from a restarted peer's previous life.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar

import msgspec

from engine.cache.namespace import PrefixNamespace
from engine.sampling.sampling_params import SamplingParams
from engine.sched.finish_reason import FinishReason


class ProtocolError(ValueError):
    """Bytes that are not a valid message: malformed, truncated, or of an unknown type."""


def new_epoch() -> str:
    """A fresh, unique process-start id; a peer with a new epoch has restarted."""
    return uuid.uuid4().hex


class _Msg(msgspec.Struct, tag_field="type", tag=True, kw_only=True, omit_defaults=True):
    sender: str = ""
    """Role of the sending process: "tokenizer", "worker" or "detokenizer"."""
    epoch: str = ""
    """The sender's `new_epoch()` at start; "" when the message was never stamped."""


# ----- liveness ---------------------------------------------------------------------------


class Hello(_Msg):
    """Any process → each peer it sends to, once at start: "I am `sender`, life `epoch`"."""


class Heartbeat(_Msg):
    """Any process → each peer it sends to, every `heartbeat_interval` seconds."""


# ----- requests (tokenizer → worker) ------------------------------------------------------


class TokenizedGenerateReqInput(_Msg):
    """Tokenizer → worker: one request, already tokenized.

    `sampling_params` is the engine's own `SamplingParams` dataclass: msgspec checks its
    field types on decode, and the worker checks values with `verify(vocab_size)` (the
    token-id range is only known there). Logprobs are asked for with
    `sampling_params.logprobs` / `top_logprobs_num`, and the prompt's with
    `logprob_start_len` / `prompt_top_logprobs_num`, so there is no separate flag.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    extra_key: PrefixNamespace | None = None
    """Radix namespace: requests in different namespaces share no KV."""
    priority: int = 0
    routing_key: str | None = None
    trace_context: dict[str, str] = msgspec.field(default_factory=dict)
    """W3C trace-context carrier (`traceparent`, `tracestate`) so spans join across processes."""
    lora_name: str | None = None
    """The LoRA adapter to serve it with; None: the base model."""


class AbortReq(_Msg):
    """Tokenizer → worker: stop `rid` now and free its KV (client gone, or asked to)."""

    rid: str


class FlushCacheReq(_Msg):
    """Tokenizer → worker: empty the radix cache (refused while requests are in flight)."""

    rid: str = ""
    """Pairs the reply with its request, so a late reply is not taken for the next one's."""


class GetServerInfoReq(_Msg):
    """Tokenizer → worker: ask for the worker's live state (pool sizes, queues, stats)."""

    rid: str = ""
    check_integrity: bool = False
    """Also run the radix tree's integrity check (idle workers only; a walk of every node
    and KV slot, so not for every scrape)."""


class LoadLoRAAdapterReq(_Msg):
    """Tokenizer → worker: load the PEFT adapter at `path` under `name` (run-time update)."""

    name: str
    path: str
    rid: str = ""


class UnloadLoRAAdapterReq(_Msg):
    """Tokenizer → worker: unload adapter `name` (refused while requests use it)."""

    name: str
    rid: str = ""


# ----- control replies (worker → tokenizer, on the control socket) ------------------------


class WorkerReady(_Msg):
    """Worker → tokenizer, once the model is loaded (and again after each restart):
    `/health` turns 200 and requests can be checked against these limits."""

    model_path: str
    served_model_name: str
    max_total_tokens: int
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    max_running_requests: int
    lora_adapters: dict[str, str] = {}
    """Name → path of each LoRA adapter loaded now (a `model` a request may name)."""


class FlushCacheReqOutput(_Msg):
    """Worker → tokenizer: whether the flush happened, and why not."""

    success: bool
    message: str = ""
    rid: str = ""


class LoRAAdapterReqOutput(_Msg):
    """Worker → tokenizer: the answer to a load or unload, with the adapters loaded after it.
    `status` is the HTTP status a refusal is answered with (400, 404 or 409)."""

    success: bool
    status: int = 200
    message: str = ""
    param: str | None = None
    lora_adapters: dict[str, str] = {}
    rid: str = ""


class GetServerInfoReqOutput(_Msg):
    """Worker → tokenizer: the answer to `GetServerInfoReq`, a msgpack-able dict."""

    info: dict[str, Any]
    rid: str = ""


# ----- outputs ----------------------------------------------------------------------------


_NOT_PER_RID = ("sender", "epoch", "rids", "new_reqs")
"""Fields of an output batch that are not one entry per rid."""
_PAYLOAD = (
    "output_ids",
    "output_token_logprobs_val",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    "input_token_logprobs_val",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
)
"""Per-rid columns of lists that a failed row sends empty."""
FRAME_HEADROOM_BYTES = 1024
"""What the wire may add to an encoded message under a frame limit (ZMTP framing, CURVE's
box): an output batch is split to encode to at most the limit less this."""


class _BatchOutput(_Msg, kw_only=True):
    """Per-request columns of one scheduler step, one entry per rid (SGLang's layout).
    Lengths are checked on construction and on decode, so a column can never be misread
    as another request's."""

    rids: list[str]
    output_ids: list[list[int]]
    """Token ids new since the previous output of that rid."""
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    """Prompt tokens served from the radix cache (OpenAI's `cached_tokens`)."""
    output_token_logprobs_val: list[list[float]] | None = None
    """Per rid, the sampled tokens' logprobs (one per new id; [] for a rid that asked none)."""
    output_top_logprobs_val: list[list[list[float]]] | None = None
    """Per rid, per new id, the `top_logprobs_num` best logprobs; `_idx` holds their token ids."""
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    rollbacks: list[int] | None = None
    """Per rid, how many ids sent before this `output_ids` a grammar jump-forward replaced
    (re-encoded with the forced text; the text only grows). None when no rid rolled back."""
    input_token_logprobs_val: list[list[float | None]] | None = None
    """Per rid, once (in its first output after its prefill completes): the logprob of each
    prompt token from its `logprob_start_len` on, None at prompt position 0, which nothing
    predicts ([] for a rid that carries none). None when no rid of the batch carries any.
    The receiver knows the prompt's ids, so they are not sent back."""
    input_top_logprobs_val: list[list[list[float]]] | None = None
    """Per rid, per one of those positions, the `prompt_top_logprobs_num` best logprobs
    ([] at position 0); `_idx` holds their token ids."""
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    spec_verify_ct: list[int] | None = None
    """Per rid, the speculative verify passes it took part in so far (SGLang's name). None
    when the worker runs without speculative decoding."""
    spec_accept_length: list[float] | None = None
    """Per rid, its tokens per verify pass so far: 1 + the drafts accepted per pass (0.0
    before any). None when the worker runs without speculative decoding."""

    def __post_init__(self) -> None:
        n = len(self.rids)
        for name in self._per_rid_fields():
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise ValueError(
                    f"{type(self).__name__}.{name} has {len(column)} entries for {n} rids"
                )
        for name in (
            "output_token_logprobs_val",
            "output_top_logprobs_val",
            "output_top_logprobs_idx",
        ):
            column = getattr(self, name)
            for rid, ids, values in zip(self.rids, self.output_ids, column or ()):
                if values and len(values) != len(ids):
                    raise ValueError(
                        f"{name} of {rid!r} has {len(values)} entries for {len(ids)} new tokens"
                    )
        self._check_prompt_logprobs()

    def _check_prompt_logprobs(self) -> None:
        """Top-k columns come as a pair, and match the logprobs column position by position."""
        top_val, top_idx = self.input_top_logprobs_val, self.input_top_logprobs_idx
        if (top_val is None) != (top_idx is None):
            raise ValueError("input_top_logprobs_val and input_top_logprobs_idx come together")
        if top_val is None or top_idx is None:
            return
        values = self.input_token_logprobs_val or [[] for _ in self.rids]
        for rid, positions, vals, idx in zip(self.rids, values, top_val, top_idx):
            if vals and len(vals) != len(positions):
                raise ValueError(
                    f"input_top_logprobs_val of {rid!r} has {len(vals)} entries "
                    f"for {len(positions)} prompt positions"
                )
            if [len(v) for v in vals] != [len(i) for i in idx]:
                raise ValueError(
                    f"input_top_logprobs_idx of {rid!r} does not match input_top_logprobs_val"
                )

    def _per_rid_fields(self) -> tuple[str, ...]:
        return tuple(f for f in self.__struct_fields__ if f not in _NOT_PER_RID)

    def select(self, rows: Sequence[int]) -> Self:
        """The batch of these rows alone, in this order, with their rids' constants."""
        columns = {
            name: None if (column := getattr(self, name)) is None else [column[i] for i in rows]
            for name in self._per_rid_fields()
        }
        rids = [self.rids[i] for i in rows]
        return msgspec.structs.replace(self, rids=rids, **columns, **self._constants_of(rids))

    def _constants_of(self, rids: list[str]) -> dict[str, Any]:
        """The fields that are not per-rid columns, for a batch of `rids` only."""
        return {}

    def fail_row(self, row: int, reason: FinishReason) -> None:
        """Finish `row` with `reason`, its payload (ids, logprobs, text) emptied: its
        request fails, and what the row still carries is a few bytes. The columns it
        changes are copied first (a batch may share them with the one it came from)."""
        self._set_cell("finished_reasons", row, reason)
        for name in _PAYLOAD:
            if getattr(self, name) is not None:
                self._set_cell(name, row, [])

    def _set_cell(self, name: str, row: int, value: Any) -> None:
        column = list(getattr(self, name))
        column[row] = value
        setattr(self, name, column)


class DetokenizerReqState(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """What the detokenizer needs of one request to turn its ids into text, constant for
    its whole life: sent once, in the output batch that first carries the rid, and kept
    by the detokenizer until that rid finishes (aborts included)."""

    rid: str
    stop: list[str] = []
    """Stop strings to trim from the text (the scheduler already stopped on them)."""
    skip_special_tokens: bool = True


class BatchTokenIDOutput(_BatchOutput, kw_only=True):
    """Worker → detokenizer: new token ids of every request that advanced or finished.

    A step's batch carries only what changes per step; the per-request constants ride
    once, in `new_reqs`."""

    new_reqs: list[DetokenizerReqState] = []
    """The state of each rid this batch carries for the first time (in any order; not a
    per-rid column)."""
    trace_contexts: list[dict[str, str]] | None = None
    """Per rid, its W3C trace context in the batch where it finishes ({} before, and for an
    untraced request), so the detokenizer can add its span to the request's trace. None
    when no rid of the batch has one."""

    def _constants_of(self, rids: list[str]) -> dict[str, Any]:
        kept = set(rids)
        return {"new_reqs": [state for state in self.new_reqs if state.rid in kept]}

    def fail_row(self, row: int, reason: FinishReason) -> None:
        super().fail_row(row, reason)
        rid = self.rids[row]
        self.new_reqs = [state for state in self.new_reqs if state.rid != rid]


class BatchStrOutput(_BatchOutput, kw_only=True):
    """Detokenizer → tokenizer: the same columns, plus the text each rid gained."""

    output_strs: list[str]
    """Text delta per rid: safe to show (no broken UTF-8, no partial stop string)."""

    def fail_row(self, row: int, reason: FinishReason) -> None:
        super().fail_row(row, reason)
        self._set_cell("output_strs", row, "")


Message = (
    Hello
    | Heartbeat
    | TokenizedGenerateReqInput
    | AbortReq
    | FlushCacheReq
    | GetServerInfoReq
    | LoadLoRAAdapterReq
    | UnloadLoRAAdapterReq
    | WorkerReady
    | FlushCacheReqOutput
    | GetServerInfoReqOutput
    | LoRAAdapterReqOutput
    | BatchTokenIDOutput
    | BatchStrOutput
)

MESSAGE_TYPES: tuple[type[_Msg], ...] = Message.__args__

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """msgpack bytes of one message; anything not in `Message` is a TypeError here rather
    than bytes the peer cannot read."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """The message in `data`, or ProtocolError saying what is wrong with it."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: absurdly nested input
        raise ProtocolError(f"invalid message ({len(data)} bytes): {e}") from e


OutputBatch = TypeVar("OutputBatch", BatchTokenIDOutput, BatchStrOutput)


def split_batch(
    batch: OutputBatch, max_bytes: int, fail: Callable[[int, int], FinishReason]
) -> list[OutputBatch]:
    """`batch` as consecutive runs of its rows, in order, each encoding to at most
    `max_bytes` (one encode when it fits whole, the common case), so that no batch is
    dropped for its size. A row that alone encodes to more is failed: `fail(row, size)`
    gives its finish reason, and it goes on emptied (`fail_row`); the other rows arrive
    whole. A run is sized by its rows' one-row encodings, which together exceed it."""
    if len(encode(batch)) <= max_bytes:
        return [batch]
    parts: list[OutputBatch] = []
    run: list[int] = []
    run_bytes = 0
    for row in range(len(batch.rids)):
        size = len(encode(batch.select([row])))
        if size > max_bytes:
            batch.fail_row(row, fail(row, size))
            size = len(encode(batch.select([row])))
        if run and run_bytes + size > max_bytes:
            parts.append(batch.select(run))
            run, run_bytes = [], 0
        run.append(row)
        run_bytes += size
    parts.append(batch.select(run))
    return parts
