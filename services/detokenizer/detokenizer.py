"""The detokenizer: turns each `BatchTokenIDOutput` into a `BatchStrOutput`.

It runs apart from the worker so that decoding text never delays a scheduler round. One
`IncrementalDetokenizer` per live rid holds back broken UTF-8 and anything that could
still turn into a stop string, so every delta it sends is final. A rid's stop strings and
decode options come once, with its first output (`DetokenizerReqState`), and its state is
dropped with its last (a finish or an abort), so a step's batch carries ids only. A rid
whose decoding raises fails alone, with a server error; an output batch too large for one
message goes as several. It serves `/metrics` and `/healthz` on its metrics port, and adds
a detokenize span to each traced request.
"""

from __future__ import annotations

import logging
import time

import msgspec

from engine.detokenize import IncrementalDetokenizer, Tokenizer
from engine.model.tokenizer_cache import load_tokenizer
from engine.sched.finish_reason import text_ids
from observability.detokenizer_metrics import DetokenizerMetrics
from services.io_struct import (
    FRAME_HEADROOM_BYTES,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerReqState,
    FinishReason,
    Message,
    split_batch,
)
from services.ipc import MAX_MESSAGE_BYTES, PeerEvent
from services.process import Service
from services.settings import Settings

logger = logging.getLogger(__name__)

_PASSED_THROUGH = tuple(
    f for f in BatchStrOutput.__struct_fields__ if f not in ("sender", "epoch", "output_strs")
)
"""Columns a BatchStrOutput copies from its BatchTokenIDOutput unchanged."""


class BatchDetokenizer:
    """The detokenizer's state and logic, apart from its sockets: one
    `IncrementalDetokenizer` per live rid, made from the `DetokenizerReqState` that comes
    with the rid's first output and dropped with its last (a finish or an abort)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        """None with skip_tokenizer_init: the API returns token ids only, the text stays ""."""
        self.decode_status: dict[str, IncrementalDetokenizer] = {}
        """rid → its incremental state, from its first output until it finishes."""
        self.failed: set[str] = set()
        """Rids failed here whose worker has not finished them yet: their rows are dropped."""

    def detokenize(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        """The text of each row; a row whose decoding raises fails its request alone."""
        if self.failed:
            batch = self.drop_failed(batch)
        for req_state in batch.new_reqs:
            self.add_request(req_state)
        rollbacks = batch.rollbacks or [0] * len(batch.rids)
        texts: list[str] = []
        errors: list[tuple[int, Exception]] = []
        for row, (rid, ids, reason, rollback) in enumerate(
            zip(batch.rids, batch.output_ids, batch.finished_reasons, rollbacks)
        ):
            try:
                texts.append(self.text_delta(rid, ids, reason, rollback))
            except Exception as e:
                texts.append("")
                errors.append((row, e))
        out = BatchStrOutput(
            **{name: getattr(batch, name) for name in _PASSED_THROUGH}, output_strs=texts
        )
        for row, error in errors:
            logger.error("request %s failed while detokenizing", out.rids[row], exc_info=error)
            message = (
                f"internal server error while detokenizing ({type(error).__name__}); "
                "the request was stopped, and the server serves other requests on"
            )
            out.fail_row(row, self.fail(out, row, message))
        return out

    def drop_failed(self, batch: BatchTokenIDOutput) -> BatchTokenIDOutput:
        """`batch` without the rows of rids failed here; a finished one is forgotten."""
        keep: list[int] = []
        for row, (rid, reason) in enumerate(zip(batch.rids, batch.finished_reasons)):
            if rid not in self.failed:
                keep.append(row)
            elif reason is not None:
                self.failed.discard(rid)
        return batch if len(keep) == len(batch.rids) else batch.select(keep)

    def fail(
        self, batch: BatchStrOutput, row: int, message: str, status_code: int | None = None
    ) -> FinishReason:
        """Fail `row`'s request here: its state is dropped and, until the worker finishes
        it, its later rows too. The finish reason its row carries (None: a server error)."""
        rid = batch.rids[row]
        self.decode_status.pop(rid, None)
        if batch.finished_reasons[row] is None:
            self.failed.add(rid)
        return FinishReason("abort", message=message, status_code=status_code)

    def add_request(self, req_state: DetokenizerReqState) -> None:
        if self.tokenizer is not None:
            self.decode_status[req_state.rid] = IncrementalDetokenizer(
                self.tokenizer, req_state.stop, req_state.skip_special_tokens
            )

    def text_delta(
        self, rid: str, new_ids: list[int], reason: FinishReason | None, rollback: int = 0
    ) -> str:
        """The text `new_ids` add to `rid`'s output that is safe to show; all of what is
        left once it finishes, when its state is dropped. `new_ids` first replace the last
        `rollback` ids (jump-forward)."""
        if self.tokenizer is None:
            return ""
        state = self.decode_status.get(rid)
        if state is None:
            # Its state went to this process's previous life (a restart mid-request, whose
            # requests the tokenizer fails anyway): decode with the defaults meanwhile.
            state = self.decode_status[rid] = IncrementalDetokenizer(self.tokenizer)
        if rollback:
            state.rollback(rollback)
        if reason is None:
            return state.add_tokens(new_ids)
        del self.decode_status[rid]
        return state.add_tokens(text_ids(new_ids, reason), finished=True)


class Detokenizer(Service):
    role = "detokenizer"

    def __init__(self, settings: Settings):
        self.state = BatchDetokenizer(
            None
            if settings.skip_tokenizer_init
            else load_tokenizer(settings.tokenizer or settings.model)
        )
        super().__init__(settings, settings.zmq_address("detokenizer_port"))
        self.to_tokenizer = self.outbox(settings.zmq_address("tokenizer_port"))
        self.max_output_bytes = MAX_MESSAGE_BYTES - FRAME_HEADROOM_BYTES
        """An output batch encoding to more is split by rows (`split_batch`)."""
        self.first_seen: dict[str, float] = {}
        """rid → when its first output arrived (time.monotonic()); kept only while tracing."""
        self.metrics = DetokenizerMetrics(
            self.registry,
            settings.model_id,
            lambda: len(self.state.decode_status),
        )
        self.serve_metrics(settings.detokenizer_metrics_port)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, BatchTokenIDOutput):
            start = time.monotonic()
            self.send(self.state.detokenize(msg))
            end = time.monotonic()
            self.metrics.observe_batch(end - start)
            self.trace(msg, start, end)
        else:
            logger.warning(
                "dropped a %s from %s: not a detokenizer message",
                type(msg).__name__,
                msg.sender or "?",
            )

    def send(self, out: BatchStrOutput) -> None:
        """`out` to the tokenizer, as several messages if it is too large for one."""
        out = msgspec.structs.replace(out, sender=self.role, epoch=self.epoch)

        def fail(row: int, size: int) -> FinishReason:
            message = (
                f"this request's output of one step encodes to {size} bytes, over the "
                f"{self.max_output_bytes}-byte limit of a message between the server's "
                "processes; ask for fewer logprobs or prompt logprobs"
            )
            logger.error("request %s failed: %s", out.rids[row], message)
            return self.state.fail(out, row, message, status_code=400)

        for part in split_batch(out, self.max_output_bytes, fail):
            self.to_tokenizer.put(part)

    def on_peer_event(self, event: PeerEvent) -> None:
        decode_status = self.state.decode_status
        if event.peer == "worker" and event.kind == "restart":
            # The worker's previous life will never finish these rids.
            if decode_status:
                logger.info(
                    "worker restarted; dropped the state of %d request(s)", len(decode_status)
                )
            decode_status.clear()
            self.state.failed.clear()
            self.first_seen.clear()

    def trace(self, batch: BatchTokenIDOutput, start: float, end: float) -> None:
        """Remember when each rid first came; a finished one gets its detokenize span, from
        its first output to its last (the carrier comes with the last). Nothing while
        tracing is off."""
        if self.tracing is None:
            return
        contexts = batch.trace_contexts or [{}] * len(batch.rids)
        for rid, reason, context in zip(batch.rids, batch.finished_reasons, contexts):
            first = self.first_seen.setdefault(rid, start)
            if reason is not None:
                del self.first_seen[rid]
                self.tracing.record("detokenize", context, first, end, **{"radixserve.rid": rid})
