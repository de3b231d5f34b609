"""The tokenizer's side of the wire: request state, ZMQ I/O and peer liveness.

`TokenizerManager` pushes tokenized requests to the worker, pulls text outputs from the
detokenizer and control replies from the worker, and routes each output to the request
group waiting for it. A group is what one HTTP request became (`n` samples of each prompt);
leaving it early (client gone) aborts its unfinished requests in the worker. A dead or
restarted peer fails every in-flight group with a 503 instead of leaving it waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from services.ipc import AsyncReceiver, PeerEvent, PeerMonitor, Sender, bind_pull, connect_push
from services.protocol import (
    AbortReq,
    BatchStrOutput,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    Heartbeat,
    Hello,
    Message,
    TokenizedGenerateReqInput,
    WorkerReady,
    new_epoch,
)
from services.settings import Settings
from services.tokenizer.adapters import RequestError
from services.tokenizer.responses import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PEERS = ("worker", "detokenizer")
"""Processes a request needs alive from submission to its last token."""
CONTROL_TIMEOUT_S = 10.0
"""How long a control request (flush, server info) waits for the worker's reply."""


def unavailable(message: str) -> RequestError:
    return RequestError(message, code="service_unavailable", status=503)


@dataclass(frozen=True)
class ReqOutput:
    """What one BatchStrOutput brought one request: its text and ids since the previous one."""

    index: int
    """Position of the request in its group (OpenAI's choice index)."""
    rid: str
    text: str
    output_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class _Group:
    queue: asyncio.Queue[ReqOutput | RequestError] = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)


class TokenizerManager:
    """Owns the sockets; create it inside the running event loop and `start()` it."""

    def __init__(self, settings: Settings, tokenizer: PreTrainedTokenizerBase | None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.epoch = new_epoch()
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context()
        self.to_worker = Sender(
            connect_push(self.ctx, settings.worker_port), "tokenizer", self.epoch, settings.heartbeat_interval
        )
        self.receivers = [
            AsyncReceiver(bind_pull(self.actx, settings.tokenizer_port), "tokenizer-outputs"),
            AsyncReceiver(bind_pull(self.actx, settings.tokenizer_control_port), "tokenizer-control"),
        ]
        self.monitor = PeerMonitor(settings.heartbeat_interval)
        self.worker_info: WorkerReady | None = None
        """The worker's limits; None until it announces itself (and after it restarts)."""
        self.groups: dict[str, _Group] = {}
        """rid → the group waiting for its outputs, from submission until it finishes."""
        self.control: dict[str, asyncio.Future[Message]] = {}
        self.tasks: list[asyncio.Task] = []

    # ----- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._recv_loop(r)) for r in self.receivers]
        self.tasks.append(asyncio.create_task(self._liveness_loop()))
        self.to_worker.hello()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ctx.destroy(linger=100)
        self.actx.destroy(linger=0)

    # ----- state ------------------------------------------------------------------------

    def require_ready(self) -> WorkerReady:
        if self.worker_info is None:
            raise unavailable("the model is still loading; retry when /health answers 200")
        dead = [p for p in PEERS if not self.monitor.is_alive(p)]
        if dead:
            raise unavailable(f"the {' and '.join(dead)} process is not responding; retry later")
        return self.worker_info

    def num_in_flight(self) -> int:
        return len(self.groups)

    # ----- requests ---------------------------------------------------------------------

    @staticmethod
    def new_rid(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def generate(self, reqs: Sequence[TokenizedGenerateReqInput]) -> AsyncIterator[ReqOutput]:
        """Submit `reqs` as one group and yield their outputs as they arrive, until all have
        finished. Raises `RequestError` (503) if a peer dies meanwhile. Leaving the loop
        early aborts the requests that have not finished."""
        self.require_ready()
        group = _Group(unfinished={r.rid for r in reqs})
        index = {r.rid: i for i, r in enumerate(reqs)}
        for req in reqs:
            self.groups[req.rid] = group
        try:
            for req in reqs:
                if not self.to_worker.send(req):
                    raise unavailable("the worker is not accepting requests (not connected, or its queue is full)")
            while group.unfinished:
                item = await group.queue.get()
                if isinstance(item, RequestError):
                    raise item
                if item.finished_reason is not None:
                    group.unfinished.discard(item.rid)
                yield dataclasses.replace(item, index=index[item.rid])
        finally:
            for rid in index:
                self.groups.pop(rid, None)
            for rid in group.unfinished:
                self.to_worker.send(AbortReq(rid=rid))

    def abort(self, rid: str) -> int:
        """Abort `rid`, or every request whose rid starts with `rid-` (all choices of one
        response id), or everything when `rid` is empty; returns how many were asked to stop."""
        rids = [r for r in self.groups if not rid or r == rid or r.startswith(rid + "-")]
        for r in rids:
            self.to_worker.send(AbortReq(rid=r))
        return len(rids)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(rid=self.new_rid("flush")))

    async def server_info(self) -> dict:
        reply = await self._control(GetServerInfoReq(rid=self.new_rid("info")))
        return reply.info

    async def _control(self, msg: FlushCacheReq | GetServerInfoReq) -> Message:
        self.require_ready()
        future = self.control[msg.rid] = asyncio.get_running_loop().create_future()
        try:
            if not self.to_worker.send(msg):
                raise unavailable("the worker is not connected")
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        except TimeoutError:
            message = f"the worker did not answer {type(msg).__name__} within {CONTROL_TIMEOUT_S:g} s"
            raise unavailable(message) from None
        finally:
            self.control.pop(msg.rid, None)

    # ----- the loops --------------------------------------------------------------------

    async def _recv_loop(self, receiver: AsyncReceiver) -> None:
        while True:
            msg = await receiver.recv()
            if not self.monitor.accept(msg) or isinstance(msg, (Hello, Heartbeat)):
                continue
            try:
                self._handle(msg)
            except Exception:  # one bad message must not stop the routing of all others
                logger.exception("dropped %s after an error handling it", type(msg).__name__)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, BatchStrOutput):
            self._route(msg)
        elif isinstance(msg, WorkerReady):
            self.worker_info = msg
            logger.info("worker ready: %s, context %d, %d KV tokens", msg.model_path, msg.context_length,
                        msg.max_total_tokens)
        elif isinstance(msg, (FlushCacheReqOutput, GetServerInfoReqOutput)):
            future = self.control.get(msg.rid)
            if future is not None and not future.done():
                future.set_result(msg)
        else:
            logger.warning("dropped a %s from %s: not a tokenizer message", type(msg).__name__, msg.sender or "?")

    def _route(self, batch: BatchStrOutput) -> None:
        for i, rid in enumerate(batch.rids):
            group = self.groups.get(rid)
            if group is None:
                continue  # its client left, or it belongs to a failed group
            group.queue.put_nowait(ReqOutput(
                index=0,
                rid=rid,
                text=batch.output_strs[i],
                output_ids=batch.output_ids[i],
                finished_reason=batch.finished_reasons[i],
                prompt_tokens=batch.prompt_tokens[i],
                completion_tokens=batch.completion_tokens[i],
                cached_tokens=batch.cached_tokens[i],
                logprobs=self._logprobs(batch, i),
            ))

    def _logprobs(self, batch: BatchStrOutput, i: int) -> tuple[TokenLogprob, ...]:
        values = batch.output_token_logprobs_val[i] if batch.output_token_logprobs_val else []
        if not values:
            return ()
        top_vals = batch.output_top_logprobs_val[i] if batch.output_top_logprobs_val else []
        top_ids = batch.output_top_logprobs_idx[i] if batch.output_top_logprobs_idx else []
        tops = [
            tuple(TokenLogprob(t, self._token_text(t), lp) for lp, t in zip(vals, ids))
            for vals, ids in zip(top_vals, top_ids)
        ] or [()] * len(values)
        return tuple(
            TokenLogprob(token_id, self._token_text(token_id), logprob, top)
            for token_id, logprob, top in zip(batch.output_ids[i], values, tops)
        )

    def _token_text(self, token_id: int) -> str:
        return str(token_id) if self.tokenizer is None else self.tokenizer.decode([token_id])

    async def _liveness_loop(self) -> None:
        """Heartbeats to the worker, and the peer deaths and restarts that fail requests."""
        while True:
            self.to_worker.heartbeat_if_due()
            for event in self.monitor.poll():
                self._on_peer_event(event)
            await asyncio.sleep(self.settings.heartbeat_interval / 2)

    def _on_peer_event(self, event: PeerEvent) -> None:
        logger.info("peer %s %s (epoch %s)", event.peer, event.kind, event.epoch)
        if event.kind == "up":
            if event.peer == "worker":
                self.to_worker.hello()
            return
        if event.peer == "worker" and event.kind == "restart":
            self.worker_info = None  # its new life announces its limits again
        verb = "stopped responding" if event.kind == "dead" else "restarted"
        self.fail_all(unavailable(f"the {event.peer} process {verb}; the request was lost, retry it"))

    def fail_all(self, err: RequestError) -> None:
        groups = {id(g): g for g in self.groups.values()}.values()
        if groups:
            logger.warning("failing %d in-flight request(s): %s", len(groups), err.message)
        for group in groups:
            group.queue.put_nowait(err)
        for future in self.control.values():
            if not future.done():
                future.set_exception(err)
        self.groups.clear()


@contextlib.asynccontextmanager
async def running_manager(
    settings: Settings, tokenizer: PreTrainedTokenizerBase | None
) -> AsyncIterator[TokenizerManager]:
    """A started manager, closed (tasks cancelled, sockets shut) on exit."""
    manager = TokenizerManager(settings, tokenizer)
    manager.start()
    try:
        yield manager
    finally:
        await manager.close()
