"""The tokenizer's side of the wire: request state, ZMQ I/O and peer liveness.

`TokenizerManager` pushes tokenized requests to the worker, pulls text outputs from the
detokenizer and control replies from the worker, and routes each output to the request
group waiting for it. A group is what one HTTP request became (`n` samples of each prompt);
leaving it early (client gone) aborts its unfinished requests in the worker. A dead or
restarted peer fails every in-flight group with a 503 instead of leaving it waiting.
Load shedding happens here too: past `--max-queued-requests` requests waiting for their
first token a new one gets a 429, and a request unfinished after `--request-timeout`
seconds is aborted (504) and its KV freed.
It also times each request as the client sees it (TTFT, inter-token, end to end) and puts
the current trace context into each request it sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

import zmq
import zmq.asyncio

from observability.metrics import RequestTimer, TokenizerMetrics
from observability.tracing import Tracing
from services.io_struct import (
    AbortReq,
    BatchStrOutput,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    Heartbeat,
    Hello,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    Message,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    WorkerReady,
    new_epoch,
)
from services.ipc import (
    AsyncReceiver,
    Connections,
    PeerEvent,
    PeerMonitor,
    Sender,
    WireAuthenticator,
    bind_pull,
    connect_push,
    load_wire_keys,
)
from services.settings import Settings
from services.tokenizer.choice_output import REQUESTED_ABORT_STATUS, TokenLogprob
from services.tokenizer.errors import RequestError
from services.tokenizer.logprob_text import (
    RawLogprobs,
    decoded,
    output_logprobs,
    prompt_logprobs,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PEERS = ("worker", "detokenizer")
"""Processes a request needs alive from submission to its last token."""
CONTROL_TIMEOUT_S = 10.0
"""How long a control request (flush, server info) waits for the worker's reply."""

ControlReq = FlushCacheReq | GetServerInfoReq | LoadLoRAAdapterReq | UnloadLoRAAdapterReq
ControlReply = FlushCacheReqOutput | GetServerInfoReqOutput | LoRAAdapterReqOutput
ReplyT = TypeVar("ReplyT", FlushCacheReqOutput, GetServerInfoReqOutput, LoRAAdapterReqOutput)


def unavailable(message: str) -> RequestError:
    return RequestError(message, code="service_unavailable", status=503)


def overloaded(message: str) -> RequestError:
    return RequestError(message, code="too_many_requests", status=429)


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
    rollback: int = 0
    """How many ids of the previous outputs `output_ids` replaces (grammar jump-forward)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """One entry per prompt position from `logprob_start_len` on, in the one output that
    brings them (the first after the prefill; () in every other): the prompt token, its
    logprob and its `prompt_top_logprobs_num` alternatives. None at prompt position 0,
    which nothing predicts."""
    spec_verify_ct: int | None = None
    """Speculative verify passes the request took part in so far; None when the worker
    runs without speculative decoding."""
    spec_accept_length: float | None = None
    """Its tokens per verify pass so far (1 + drafts accepted per pass); None likewise."""


REQUESTED_ABORT = FinishReason(
    "abort", message="the request was aborted (/abort_request)", status_code=REQUESTED_ABORT_STATUS
)


def requested_abort(reason: FinishReason | None, asked: bool) -> FinishReason | None:
    """`REQUESTED_ABORT` for the worker's abort of a request `asked` to stop, else `reason`."""
    return REQUESTED_ABORT if asked and reason is not None and reason.type == "abort" else reason


@dataclass
class _Group:
    queue: asyncio.Queue[list[ReqOutput] | RequestError] = field(default_factory=asyncio.Queue)
    """One entry per output batch that brought the group anything: the group's waiter wakes
    once per batch, however many of its requests advanced."""
    index: dict[str, int] = field(default_factory=dict)
    """Rid → the request's position in the group (OpenAI's choice index)."""
    unfinished: set[str] = field(default_factory=set)
    queued: set[str] = field(default_factory=set)
    """Rids with no output yet: waiting in the worker, compiling a grammar or prefilling."""
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)
    """Rid → its prompt ids from `logprob_start_len` on, for those that ask prompt logprobs
    (the worker sends back the logprobs only)."""
    undecoded: dict[str, RawLogprobs] = field(default_factory=dict)
    """Rid → prompt logprobs that arrived, still without their tokens' texts: the group's own
    coroutine decodes them (`logprob_text.decoded`), not the receiving loop."""
    aborted: set[str] = field(default_factory=set)
    """Rids stopped through `abort` (`/abort_request`): their abort is asked for, not a
    server error (`REQUESTED_ABORT`)."""

    @classmethod
    def of(cls, reqs: Sequence[TokenizedGenerateReqInput]) -> _Group:
        """The group of `reqs` as submitted: none finished, none with an output yet."""
        rids = {r.rid for r in reqs}
        return cls(
            index={r.rid: i for i, r in enumerate(reqs)},
            unfinished=set(rids),
            queued=set(rids),
            prompt_ids={
                r.rid: r.input_ids[r.sampling_params.logprob_start_len :]
                for r in reqs
                if r.sampling_params.logprob_start_len >= 0
            },
        )


class TokenizerManager:
    """Owns the sockets; create it inside the running event loop and `start()` it."""

    def __init__(
        self,
        settings: Settings,
        tokenizer: PreTrainedTokenizerBase | None,
        metrics: TokenizerMetrics | None = None,
        tracing: Tracing | None = None,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.tracing = tracing
        self.epoch = new_epoch()
        self.keys = load_wire_keys(settings.ipc_keys_dir, "tokenizer")
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context()
        if self.keys is not None:
            WireAuthenticator(self.actx, self.keys).start()
        self.to_worker = Sender(
            connect_push(
                self.ctx, settings.zmq_address("worker_port"), keys=self.keys, server="worker"
            ),
            "tokenizer",
            self.epoch,
            settings.heartbeat_interval,
        )
        self.receivers = [
            AsyncReceiver(
                self._bind_pull(settings.zmq_address("tokenizer_port")), "tokenizer-outputs"
            ),
            AsyncReceiver(
                self._bind_pull(settings.zmq_address("tokenizer_control_port")),
                "tokenizer-control",
            ),
        ]
        self.connections = {
            peer: Connections(receiver.sock)
            for peer, receiver in zip(("detokenizer", "worker"), self.receivers)
        }
        """Each peer's connections into its PULL socket: none left is the sign it exited."""
        self.monitor = PeerMonitor(settings.heartbeat_interval, timeout=settings.peer_timeout)
        self.live_peers: set[str] = set()
        """Peers heard from and not since judged dead (`_on_peer_event`): requests are admitted
        on this verdict, never on the time since a peer's last message, which a busy event
        loop makes look long while the peer's heartbeats wait unread in the socket."""
        self.responsive_since = time.monotonic()
        """When this event loop last came back from a stall (`_liveness_loop`)."""
        self.worker_info: WorkerReady | None = None
        """The worker's limits; None until it announces itself (and after it restarts)."""
        self.lora_adapters: dict[str, str] = {}
        """Name → path of the worker's LoRA adapters, as of its latest word on them."""
        self.groups: dict[str, _Group] = {}
        """rid → the group waiting for its outputs, from submission until it finishes."""
        self.num_queued = 0
        """Requests submitted that have had no output yet (the sum of the groups' `queued`)."""
        self.control: dict[str, asyncio.Future[ControlReply]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def _bind_pull(self, address: str) -> zmq.asyncio.Socket:
        # `bind_pull` is typed for any context; on an asyncio one it makes an asyncio socket.
        return cast(zmq.asyncio.Socket, bind_pull(self.actx, address, keys=self.keys))

    # ----- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._recv_loop(r)) for r in self.receivers]
        self.tasks.append(asyncio.create_task(self._liveness_loop()))
        self.to_worker.hello()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for connections in self.connections.values():
            connections.close()
        self.ctx.destroy(linger=100)
        self.actx.destroy(linger=0)

    # ----- state ------------------------------------------------------------------------

    def require_ready(self, peers: Sequence[str] = PEERS) -> WorkerReady:
        """The worker's limits, or a 503 unless it is loaded and every one of `peers` is alive."""
        if self.worker_info is None:
            raise unavailable("the model is still loading; retry when /health answers 200")
        dead = [p for p in peers if p not in self.live_peers]
        if dead:
            raise unavailable(f"the {' and '.join(dead)} process is not responding; retry later")
        if not self.to_worker.sock.poll(0, zmq.POLLOUT):
            # A restarted worker is heard (and announces itself) before this side's
            # reconnection to it is up; or its queue is full.
            raise unavailable("not connected to the worker yet, or its queue is full; retry later")
        return self.worker_info

    def num_in_flight(self) -> int:
        return len(self.groups)

    def check_capacity(self, num_reqs: int) -> None:
        """Load shedding (`--max-queued-requests`): refuse, with a 429, `num_reqs` more
        requests when they would leave more than the limit waiting for their first token.

        Counted here rather than in the worker so that a stream is refused with a real 429
        before its response starts. Requests count from `generate`'s first step, so a burst
        checked in the same instant can overshoot the limit by its own size; never
        reserving ahead means that a client gone before its stream started cannot leak
        capacity."""
        limit = self.settings.max_queued_requests
        if limit is None:
            return
        if num_reqs > limit:
            raise RequestError(
                f"this request fans out into {num_reqs} sequences (prompts × n); "
                f"at most {limit} may wait at once on this server (--max-queued-requests)",
                param="n",
            )
        if self.num_queued + num_reqs > limit:
            raise overloaded(
                f"the server is overloaded: {self.num_queued} request(s) are already waiting "
                f"for their first token (--max-queued-requests {limit}); retry later"
            )

    # ----- requests ---------------------------------------------------------------------

    @staticmethod
    def new_rid(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def generate(
        self, reqs: Sequence[TokenizedGenerateReqInput], observed: bool = True
    ) -> AsyncGenerator[ReqOutput, None]:
        """Submit `reqs` as one group and yield their outputs as they arrive, until all have
        finished. Raises `RequestError`: 503 if a peer dies meanwhile, 504 past
        `--request-timeout`. Leaving the loop early aborts the requests that have not
        finished. `observed=False` (probes) keeps them out of the metrics and traces.
        Readiness (`require_ready`, whose limits the caller needs anyway) and load shedding
        (`check_capacity`) are the caller's, before a stream's response starts."""
        group = _Group.of(reqs)
        timeout = self.settings.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        metrics = self.metrics if observed else None
        if observed and self.tracing is not None:
            context = self.tracing.carrier()
            for req in reqs:
                req.trace_context = context
        now = time.monotonic()
        timers = {r.rid: RequestTimer(metrics, now) for r in reqs} if metrics else {}
        for req in reqs:
            self.groups[req.rid] = group
        self.num_queued += len(group.queued)
        try:
            self._submit(reqs)
            while group.unfinished:
                items = await self._next_outputs(group, deadline)
                if isinstance(items, RequestError):
                    raise items
                for item in items:
                    raw = group.undecoded.pop(item.rid, None)
                    if raw is not None:
                        item = replace(item, prompt_logprobs=await decoded(self.tokenizer, raw))
                    if item.finished_reason is not None:
                        group.unfinished.discard(item.rid)
                        if item.finished_reason.type == "abort":
                            # An abort may come from the detokenizer (its decode of the row
                            # failed) while the worker still runs the request: free its KV now.
                            self.to_worker.send(AbortReq(rid=item.rid))
                    if metrics is not None:
                        self._observe(metrics, timers[item.rid], item)
                    yield item
        finally:
            self.num_queued -= len(group.queued)
            group.queued.clear()
            for rid in group.index:
                self.groups.pop(rid, None)
            for rid in group.unfinished:
                self.to_worker.send(AbortReq(rid=rid))
            if metrics is not None and group.unfinished:
                metrics.aborted.inc(len(group.unfinished))  # the client left, or a peer failed

    def _submit(self, reqs: Sequence[TokenizedGenerateReqInput]) -> None:
        for req in reqs:
            try:
                sent = self.to_worker.send(req)
            except OverflowError:  # a safety net: the request mapper checks the known fields
                raise RequestError("a number in the request does not fit in 64 bits") from None
            if not sent:
                raise unavailable(
                    "the worker is not accepting requests (not connected, or its queue is full)"
                )

    async def _next_outputs(
        self, group: _Group, deadline: float | None
    ) -> list[ReqOutput] | RequestError:
        if deadline is None:
            return await group.queue.get()
        try:
            return await asyncio.wait_for(group.queue.get(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            message = (
                f"the request did not finish within {self.settings.request_timeout:g} s "
                "(--request-timeout); it was aborted"
            )
            raise RequestError(message, code="request_timeout", status=504) from None

    @staticmethod
    def _observe(metrics: TokenizerMetrics, timer: RequestTimer, out: ReqOutput) -> None:
        now = time.monotonic()
        timer.tokens(now, len(out.output_ids))
        reason = out.finished_reason
        if reason is None:
            return
        if reason.type == "abort":
            metrics.aborted.inc()
        else:
            timer.finish(now, out.prompt_tokens, out.completion_tokens)

    def abort(self, rid: str) -> int:
        """Abort `rid`, or every request whose rid is `rid-<choice number>` (all choices of
        one response id; a bare prefix such as "cmpl" matches nothing), or everything when
        `rid` is empty; returns how many were asked to stop."""

        def matches(r: str) -> bool:
            return not rid or r == rid or (r.startswith(rid + "-") and r[len(rid) + 1 :].isdigit())

        rids = [r for r in self.groups if matches(r)]
        for r in rids:
            self.groups[r].aborted.add(r)
            self.to_worker.send(AbortReq(rid=r))
        return len(rids)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(rid=self.new_rid("flush")), FlushCacheReqOutput)

    async def server_info(self, check_integrity: bool = False) -> dict[str, Any]:
        request = GetServerInfoReq(rid=self.new_rid("info"), check_integrity=check_integrity)
        reply = await self._control(request, GetServerInfoReqOutput)
        return reply.info

    async def load_lora_adapter(self, name: str, path: str) -> LoRAAdapterReqOutput:
        request = LoadLoRAAdapterReq(name=name, path=path, rid=self.new_rid("lora"))
        return await self._control(request, LoRAAdapterReqOutput)

    async def unload_lora_adapter(self, name: str) -> LoRAAdapterReqOutput:
        request = UnloadLoRAAdapterReq(name=name, rid=self.new_rid("lora"))
        return await self._control(request, LoRAAdapterReqOutput)

    async def _control(self, msg: ControlReq, reply_type: type[ReplyT]) -> ReplyT:
        """The worker's reply to `msg`; a 503 if it sends none in time, or another kind."""
        self.require_ready(peers=("worker",))  # answered by the worker alone
        future = self.control[msg.rid] = asyncio.get_running_loop().create_future()
        try:
            if not self.to_worker.send(msg):
                raise unavailable("the worker is not connected")
            reply = await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
            if not isinstance(reply, reply_type):
                raise unavailable(
                    f"the worker answered {type(msg).__name__} with a {type(reply).__name__}"
                )
            return reply
        except TimeoutError:
            message = (
                f"the worker did not answer {type(msg).__name__} within {CONTROL_TIMEOUT_S:g} s"
            )
            raise unavailable(message) from None
        finally:
            self.control.pop(msg.rid, None)

    # ----- the loops --------------------------------------------------------------------

    async def _recv_loop(self, receiver: AsyncReceiver) -> None:
        while True:
            msg = await receiver.recv()
            accepted = self.monitor.accept(msg)
            # A peer's restart is acted on before the first message of its new life (its
            # WorkerReady must not be undone by a restart handled later).
            for event in self.monitor.poll(check_deaths=False):
                self._on_peer_event(event)
            if not accepted or isinstance(msg, (Hello, Heartbeat)):
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
            self.lora_adapters = msg.lora_adapters
            logger.info(
                "worker ready: %s, context %d, %d KV tokens",
                msg.model_path,
                msg.context_length,
                msg.max_total_tokens,
            )
        elif isinstance(msg, (FlushCacheReqOutput, GetServerInfoReqOutput, LoRAAdapterReqOutput)):
            if isinstance(msg, LoRAAdapterReqOutput):
                self.lora_adapters = msg.lora_adapters
            future = self.control.get(msg.rid)
            if future is not None and not future.done():
                future.set_result(msg)
        else:
            logger.warning(
                "dropped a %s from %s: not a tokenizer message",
                type(msg).__name__,
                msg.sender or "?",
            )

    def _route(self, batch: BatchStrOutput) -> None:
        """Each group gets one queue entry with all of its rows of the batch (one wake-up)."""
        delivered: dict[int, tuple[_Group, list[ReqOutput]]] = {}
        for i, rid in enumerate(batch.rids):
            group = self.groups.get(rid)
            if group is None:
                continue  # its client left, or it belongs to a failed group
            if rid in group.queued:
                group.queued.discard(rid)
                self.num_queued -= 1
            entry = delivered.get(id(group))
            if entry is None:
                entry = delivered[id(group)] = (group, [])
            entry[1].append(
                ReqOutput(
                    index=group.index[rid],
                    rid=rid,
                    text=batch.output_strs[i],
                    output_ids=batch.output_ids[i],
                    finished_reason=requested_abort(
                        batch.finished_reasons[i], rid in group.aborted
                    ),
                    prompt_tokens=batch.prompt_tokens[i],
                    completion_tokens=batch.completion_tokens[i],
                    cached_tokens=batch.cached_tokens[i],
                    logprobs=output_logprobs(self.tokenizer, batch, i),
                    rollback=batch.rollbacks[i] if batch.rollbacks else 0,
                    spec_verify_ct=(
                        None if batch.spec_verify_ct is None else batch.spec_verify_ct[i]
                    ),
                    spec_accept_length=(
                        None if batch.spec_accept_length is None else batch.spec_accept_length[i]
                    ),
                )
            )
            raw = prompt_logprobs(batch, i, group.prompt_ids)
            if raw is not None:
                group.undecoded[rid] = raw
        for group, outputs in delivered.values():
            group.queue.put_nowait(outputs)

    async def _liveness_loop(self) -> None:
        """Heartbeats to the worker, and the peer deaths that fail requests."""
        interval = self.settings.heartbeat_interval
        last_tick = time.monotonic()
        while True:
            self.to_worker.heartbeat_if_due()
            now = time.monotonic()
            if now - last_tick > interval:
                self.responsive_since = now
            last_tick = now
            for peer, connections in self.connections.items():
                self.monitor.connections(connections.count(), peer)
            for event in self.monitor.poll(check_deaths=self._can_judge_deaths(now)):
                self._on_peer_event(event)
            await asyncio.sleep(interval / 2)

    def _can_judge_deaths(self, now: float) -> bool:
        """Whether a peer's silence is its own: only once this loop has run without a stall
        (ticks at most an interval apart) for as long as a death takes, so that the peer's
        heartbeats could have been read. A stall (a process-wide pause, or a bug that blocks
        the loop) delays the verdict by that long; it never makes one."""
        return now - self.responsive_since >= self.monitor.misses * self.settings.heartbeat_interval

    def _on_peer_event(self, event: PeerEvent) -> None:
        logger.info("peer %s %s (epoch %s)", event.peer, event.kind, event.epoch)
        if event.kind == "dead":
            self.live_peers.discard(event.peer)
        else:
            self.live_peers.add(event.peer)
        if event.kind == "up":
            if event.peer == "worker":
                self.to_worker.hello()
            return
        if event.peer == "worker" and event.kind == "restart":
            if self.worker_info is not None and self.worker_info.epoch != event.epoch:
                self.worker_info = None  # its new life announces its limits again
        verb = "stopped responding" if event.kind == "dead" else "restarted"
        self.fail_all(
            unavailable(f"the {event.peer} process {verb}; the request was lost, retry it")
        )

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
    settings: Settings,
    tokenizer: PreTrainedTokenizerBase | None,
    metrics: TokenizerMetrics | None = None,
    tracing: Tracing | None = None,
) -> AsyncIterator[TokenizerManager]:
    """A started manager, closed (tasks cancelled, sockets shut) on exit."""
    manager = TokenizerManager(settings, tokenizer, metrics, tracing)
    manager.start()
    try:
        yield manager
    finally:
        await manager.close()
