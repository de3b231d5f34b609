"""The worker's output side: each turn's advanced, finished and rejected requests go to the
detokenizer as one `BatchTokenIDOutput` (a request's constants, its stop strings and
decode options, ride once, in the first batch that carries it; a batch too large for one
message goes as several, and a request whose own row is too large fails alone); a traced
request gets its queue-wait, prefill and decode spans when it finishes; and the turn's
KV-cache events are published."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.cache.kv_events import BlockEventRecorder
from engine.sched.req import FinishReason, Req
from engine.sched.scheduler import Scheduler
from services.io_struct import BatchTokenIDOutput, DetokenizerReqState, split_batch
from services.ipc import Outbox
from services.process import Service
from services.worker.kv_event_publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


class _Entry(NamedTuple):
    """One request's column entry in an output batch."""

    req: Req
    start: int
    """The entry's output ids start here: those the detokenizer has not seen, or replace."""
    rollback: int
    """How many ids it saw a jump-forward replaced (the entry's first `rollback` ids)."""
    trace_context: dict[str, str]
    prompt_logprobs: bool = False
    """The entry carries the request's prompt logprobs (once, when its prefill completes)."""
    first: bool = True
    """The request's first output: the batch carries its `DetokenizerReqState`."""


@dataclass
class ReqState:
    """What the worker remembers of a live request beyond the scheduler's `Req`."""

    tokenizer_epoch: str
    """The tokenizer life that sent it: a restarted tokenizer has no client for it."""
    trace_context: dict[str, str] = field(default_factory=dict)
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    """First admission into a batch (time.monotonic(), as all times here)."""
    first_token: float | None = None
    prompt_logprobs_sent: bool = False
    """Its prompt logprobs went out (they go once, in the first output after the prefill)."""
    announced: bool = False
    """Its `DetokenizerReqState` went out (once, with its first output)."""


class WorkerOutputMixin(Service):
    """The `Worker`'s output side (a base of it, as SGLang's scheduler mixins are)."""

    scheduler: Scheduler
    live: dict[str, ReqState]
    """rid → state of each request queued or running in the scheduler."""
    rejected: list[Req]
    """Requests refused at submission, reported with the next output batch."""
    to_detokenizer: Outbox
    max_output_bytes: int
    """An output batch encoding to more is split by rows (`split_batch`)."""
    speculative: bool
    """Output batches carry the per-request speculative columns (`spec_verify_ct`)."""
    kv_events: BlockEventRecorder | None
    kv_publisher: ZmqEventPublisher | None

    def send_outputs(self, reqs: list[Req]) -> None:
        """One output message per turn for everything that advanced, finished (aborts
        included) or was rejected."""
        entries = [_Entry(req, 0, 0, {}) for req in self.rejected]
        self.rejected = []
        # Under the overlap loop a req can advance and then be retracted-and-aborted in one turn.
        outputs = {id(r): r for r in reqs}.values()
        now = time.monotonic()
        for req in outputs:
            state = self.live.get(req.rid)
            if state is None:
                continue  # an output too large to send failed it: that went out already
            if state.first_token is None and req.output_ids:
                state.first_token = now
            start, rollback = req.read_output()
            prompt_logprobs = req.prompt_logprobs_ready and not state.prompt_logprobs_sent
            state.prompt_logprobs_sent |= prompt_logprobs
            entries.append(
                _Entry(
                    req,
                    start,
                    rollback,
                    state.trace_context if req.finished else {},
                    prompt_logprobs,
                    first=not state.announced,
                )
            )
            state.announced = True
            if req.finished:
                del self.live[req.rid]
                if self.tracing is not None:
                    self.trace_finished(req, state, now)
        if entries:
            self.send_batch_output(entries)
        self.publish_kv_events()

    def publish_kv_events(self) -> None:
        if self.kv_events is not None and self.kv_publisher is not None:
            self.kv_publisher.publish(self.kv_events.take())

    def send_batch_output(self, entries: list[_Entry]) -> None:
        """One column entry per request: the output ids the detokenizer has not seen yet, or
        that replace ids a jump-forward rolled back (with the count in `rollbacks`)."""
        want_logprobs = any(e.req.sampling_params.logprobs for e in entries)
        want_top = any(e.req.sampling_params.top_logprobs_num for e in entries)
        contexts = [e.trace_context for e in entries]
        logprobs: list[list[float]] = []
        top_val: list[list[list[float]]] = []
        top_idx: list[list[list[int]]] = []
        for req, start, *_ in entries:
            params = req.sampling_params
            if want_logprobs:
                logprobs.append(
                    [lp for lp, _ in req.output.token_logprobs[start:]] if params.logprobs else []
                )
            if want_top:
                top = req.output.top_logprobs[start:] if params.top_logprobs_num else []
                top_val.append([[lp for lp, _ in entry] for entry in top])
                top_idx.append([[tid for _, tid in entry] for entry in top])
        prompt = _prompt_logprob_columns(entries)
        out = BatchTokenIDOutput(
            rids=[e.req.rid for e in entries],
            output_ids=[e.req.output_ids[e.start :] for e in entries],
            finished_reasons=[e.req.lifecycle.finished_reason for e in entries],
            prompt_tokens=[len(e.req.origin_input_ids) for e in entries],
            completion_tokens=[len(e.req.output_ids) for e in entries],
            cached_tokens=[e.req.prefill.cached_tokens or 0 for e in entries],
            new_reqs=[_detokenizer_state(e.req) for e in entries if e.first],
            output_token_logprobs_val=logprobs if want_logprobs else None,
            output_top_logprobs_val=top_val if want_top else None,
            output_top_logprobs_idx=top_idx if want_top else None,
            sender=self.role,  # stamped now: `split_batch` measures what is sent
            epoch=self.epoch,
            trace_contexts=contexts if any(contexts) else None,
            rollbacks=[e.rollback for e in entries] if any(e.rollback for e in entries) else None,
            input_token_logprobs_val=prompt.input_token_logprobs_val,
            input_top_logprobs_val=prompt.input_top_logprobs_val,
            input_top_logprobs_idx=prompt.input_top_logprobs_idx,
            spec_verify_ct=[e.req.spec_verify_ct for e in entries] if self.speculative else None,
            spec_accept_length=(
                [e.req.spec_accept_length for e in entries] if self.speculative else None
            ),
        )

        def fail(row: int, size: int) -> FinishReason:
            return self.fail_oversized(entries[row].req, size)

        for part in split_batch(out, self.max_output_bytes, fail):
            self.to_detokenizer.put(part)

    def fail_oversized(self, req: Req, size: int) -> FinishReason:
        """Fail `req`, whose row of an output batch alone encodes to `size` bytes, over the
        frame limit: it is aborted (its KV freed) and its emptied row carries the reason.
        Its later outputs are not sent (it is no longer live)."""
        message = (
            f"this request's output of one step encodes to {size} bytes, over the "
            f"{self.max_output_bytes}-byte limit of a message between the server's "
            "processes; ask for fewer logprobs or prompt logprobs, or shorter stop strings"
        )
        logger.error("request %s failed: %s", req.rid, message)
        self.live.pop(req.rid, None)
        if not req.finished:
            self.scheduler.abort_request(req.rid, FinishReason("abort", None, message, 400))
        return FinishReason("abort", None, message, 400)

    def trace_finished(self, req: Req, state: ReqState, now: float) -> None:
        """The request's worker spans, from the times kept while it ran: queue wait until
        its first admission, prefill until its first token, decode until now."""
        tracing, carrier, reason = self.tracing, state.trace_context, req.lifecycle.finished_reason
        if tracing is None or reason is None:
            return
        error = (reason.message or "aborted") if reason.type == "abort" else None
        attributes = {"radixserve.rid": req.rid}
        if state.admitted is None:
            tracing.record("queue_wait", carrier, state.arrived, now, error, **attributes)
            return
        tracing.record("queue_wait", carrier, state.arrived, state.admitted, **attributes)
        first_token = state.first_token or now
        tracing.record(
            "prefill",
            carrier,
            state.admitted,
            first_token,
            None if state.first_token else error,
            **attributes,
            **{
                "radixserve.prompt_tokens": len(req.origin_input_ids),
                "radixserve.cached_tokens": req.prefill.cached_tokens or 0,  # set at admission
            },
        )
        if state.first_token is not None:
            tracing.record(
                "decode",
                carrier,
                first_token,
                now,
                error,
                **attributes,
                **{
                    "radixserve.completion_tokens": len(req.output_ids),
                    "radixserve.retractions": req.lifecycle.num_retractions,
                },
            )


class _PromptLogprobColumns(NamedTuple):
    """The `input_*` columns of one BatchTokenIDOutput."""

    input_token_logprobs_val: list[list[float | None]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None


def _prompt_logprob_columns(entries: list[_Entry]) -> _PromptLogprobColumns:
    """The `input_*` columns of an output batch: each entry's prompt logprobs when it
    carries them, else []; None when no entry carries any."""
    carrying = [e.req if e.prompt_logprobs else None for e in entries]
    if not any(carrying):
        return _PromptLogprobColumns()
    values = [req.output.prompt_logprobs if req else [] for req in carrying]
    if not any(req and req.sampling_params.prompt_top_logprobs_num for req in carrying):
        return _PromptLogprobColumns(values)
    tops = [req.output.prompt_top_logprobs if req else [] for req in carrying]
    return _PromptLogprobColumns(
        values,
        [[[lp for lp, _ in t] for t in top] for top in tops],
        [[[tid for _, tid in t] for t in top] for top in tops],
    )


def _detokenizer_state(req: Req) -> DetokenizerReqState:
    params = req.sampling_params
    return DetokenizerReqState(req.rid, params.stop, params.skip_special_tokens)
