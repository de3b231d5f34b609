"""Keeping the schedulers of a tensor-parallel group in step.

Every rank runs its own Scheduler over its own radix tree and pools (SGLang's layout), so
every rank must apply the same inputs in the same order: then each builds the same batch
and issues the same collectives. Rank 0 alone hears the outside world (requests, aborts,
flushes, and which grammar compiles are done: that depends on thread timing). It records
each input as it applies it and, at the start of every event-loop turn, broadcasts the
turn's record; a follower applies the record and runs the turn. One broadcast is one turn,
so the followers run exactly rank 0's turns. Each turn also carries a few of rank 0's
numbers (queue lengths, free KV slots, tokens generated): a follower that is out of step
stops at once with both sets in its error, instead of hanging in a collective of the
wrong shape later.

While rank 0 has no turns to run (an offline Engine between calls), a thread of its own
broadcasts keep-alives, so that the followers waiting for the next turn do not take the
silence for a dead rank when the group's timeout passes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import msgspec

from engine.cache.namespace import PrefixNamespace
from engine.distributed import DEFAULT_TIMEOUT_S, TPGroup
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import FinishReason, Req

logger = logging.getLogger(__name__)

KEEPALIVE_INTERVAL_S = DEFAULT_TIMEOUT_S / 6
"""Silence after which rank 0 broadcasts a keep-alive: well inside the group's timeout."""


class AddReq(msgspec.Struct, tag=True, array_like=True):
    """A request as rank 0 submitted it (a `ReqSpec`)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    extra_key: PrefixNamespace | None
    priority: int
    routing_key: str | None
    lora_name: str | None

    @classmethod
    def of(cls, req: Req) -> AddReq:
        return cls(
            req.rid,
            req.origin_input_ids,
            req.sampling_params,
            req.admission.extra_key,
            req.admission.priority,
            req.admission.routing_key,
            req.admission.lora_name,
        )


class Abort(msgspec.Struct, tag=True, array_like=True):
    rid: str
    reason: FinishReason


class LoadLoRA(msgspec.Struct, tag=True, array_like=True):
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag=True, array_like=True):
    name: str


class FlushCache(msgspec.Struct, tag=True, array_like=True):
    """Empty the prefix cache and the pools."""


class GrammarsDone(msgspec.Struct, tag=True, array_like=True):
    """The requests that left rank 0's grammar queue this turn: compiled (`ready`, in
    queue order) or failed with the reason rank 0 gave (a timeout is rank 0's to call)."""

    ready: list[str]
    failed: list[tuple[str, FinishReason]]


Input = AddReq | Abort | LoadLoRA | UnloadLoRA | FlushCache | GrammarsDone


class Turn(msgspec.Struct, tag=True, array_like=True):
    """Run one event-loop turn after applying `inputs` (each encoded when it was applied,
    before later turns could change the objects it came from)."""

    inputs: list[msgspec.Raw]
    state: dict[str, int]
    """Rank 0's `SchedulerSnapshot.in_step()` once the inputs are applied."""


class FollowedTurn(NamedTuple):
    """A turn as a follower applies it: rank 0's inputs, then rank 0's numbers to match."""

    inputs: list[Input]
    state: dict[str, int]


class KeepAlive(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 is alive and idle: no turn."""


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 shut its scheduler down: leave the loop."""


_input_decoder = msgspec.msgpack.Decoder(Input)
_message_decoder = msgspec.msgpack.Decoder(Turn | KeepAlive | Stop)


class InputSync:
    """Rank 0's side records and broadcasts; a follower's side receives and applies."""

    def __init__(self, group: TPGroup):
        self.group = group
        self.recording: list[msgspec.Raw] = []
        self.lock = threading.Lock()
        """Taken around each broadcast: the keep-alive thread's must not interleave."""
        self.last_sent = time.monotonic()
        self.closed = threading.Event()
        self.keepalive: threading.Thread | None = None
        if group.is_first_rank:
            self.keepalive = threading.Thread(
                target=self._keepalive_loop, name="tp-keepalive", daemon=True
            )
            self.keepalive.start()

    def record(self, item: Input) -> None:
        """Rank 0: remember an input it just applied (on a follower the same call comes
        from applying rank 0's record, and records nothing)."""
        if self.group.is_first_rank:
            self.recording.append(msgspec.Raw(msgspec.msgpack.encode(item)))

    def lead_turn(self, state: dict[str, int]) -> None:
        """Rank 0: broadcast the turn's record, with its `SchedulerSnapshot.in_step()`."""
        recording, self.recording = self.recording, []
        self._send(Turn(recording, state))

    def follow_turn(self) -> FollowedTurn | None:
        """A follower: wait for rank 0's next turn; None when rank 0 has stopped."""
        while True:
            message = _message_decoder.decode(self.group.broadcast_bytes(None))
            if isinstance(message, Stop):
                self.group.barrier()  # see `stop`
                return None
            if isinstance(message, Turn):
                inputs = [_input_decoder.decode(raw) for raw in message.inputs]
                return FollowedTurn(inputs, message.state)

    def check_in_step(self, leader: dict[str, int], own: dict[str, int]) -> None:
        """A follower, its turn's inputs applied: stop at once if its numbers are not rank
        0's, rather than hang in a collective of the wrong shape later."""
        if own != leader:
            differ = {k: (leader.get(k), own.get(k)) for k in leader.keys() | own.keys()}
            raise RuntimeError(
                f"tensor-parallel rank {self.group.rank} is out of step with rank 0; "
                "(rank 0, this rank): "
                + ", ".join(f"{k} {v}" for k, v in sorted(differ.items()) if v[0] != v[1])
            )

    def stop(self) -> None:
        """Rank 0: tell the followers to leave their loops; no broadcast after this one."""
        if self.group.is_first_rank and not self.closed.is_set():
            with self.lock:
                self.closed.set()
                self._broadcast(Stop())
            # Every rank has the stop before any leaves the group: a rank tearing its
            # connections down under another's pending receive can abort that process.
            self.group.barrier()

    def _send(self, message: Turn) -> None:
        with self.lock:
            if self.closed.is_set():
                raise RuntimeError("the tensor-parallel group was stopped")
            self._broadcast(message)

    def _broadcast(self, message: Turn | KeepAlive | Stop) -> None:
        self.group.broadcast_bytes(msgspec.msgpack.encode(message))
        self.last_sent = time.monotonic()

    def _keepalive_loop(self) -> None:
        while not self.closed.wait(KEEPALIVE_INTERVAL_S / 2):
            if time.monotonic() - self.last_sent < KEEPALIVE_INTERVAL_S:
                continue
            try:
                with self.lock:
                    if not self.closed.is_set():
                        self._broadcast(KeepAlive())
            except RuntimeError:  # a dead rank: the event loop's next broadcast raises too
                logger.warning("tensor-parallel keep-alive failed; stopping keep-alives")
                return
