"""Precise prefix routing, simulated: what a router fed by the replicas' KV-cache events
(llm-d's precise prefix scorer, Dynamo) would do with the same requests.

A `KvEventIndex` subscribes to every replica's ZMQ PUB socket and keeps, per replica, the
set of block hashes it holds (BlockStored adds, BlockRemoved takes away, AllBlocksCleared
empties), decoding each batch with a plain msgpack decoder. `choose` sends a prompt to the
replica holding the longest stored prefix of its hash chain, ties to the one with fewest
requests assigned. The run sends one request at a time and waits until the chosen
replica's events show the prompt's blocks before the next, so every choice sees the
fleet as it is: the best a precise router can do, the benchmark's upper reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from testing.kv_events import apply_events, decode_batch

POLL_MS = 50


@dataclass
class ReplicaBlocks:
    """What one replica's events say it holds, and how its stream went."""

    hashes: set[int] = field(default_factory=set)
    batches: int = 0
    last_seq: int | None = None
    gaps: int = 0
    """Batches missed (a jump in the sequence): the set may then be wrong."""


def matched_blocks(chain: Sequence[int], blocks: set[int]) -> int:
    """How many blocks of `chain`, from its start, `blocks` holds."""
    n = 0
    for h in chain:
        if h not in blocks:
            break
        n += 1
    return n


def choose(chain: Sequence[int], replicas: Sequence[set[int]], assigned: Sequence[int]) -> int:
    """The replica holding the longest prefix of `chain`; ties to the fewest `assigned`
    requests, then to the first."""
    return max(
        range(len(replicas)),
        key=lambda r: (matched_blocks(chain, replicas[r]), -assigned[r], -r),
    )


class KvEventIndex:
    """Subscribes to `endpoints` (one per replica) on a thread of its own."""

    def __init__(self, endpoints: Sequence[str], topic: str):
        self.replicas = [ReplicaBlocks() for _ in endpoints]
        self.lock = threading.Condition()
        self.context = zmq.Context()
        self.sockets = []
        for endpoint in endpoints:
            socket = self.context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
            socket.connect(endpoint)
            self.sockets.append(socket)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-event-index", daemon=True)

    def __enter__(self) -> KvEventIndex:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()
        for socket in self.sockets:
            socket.close(linger=0)
        self.context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for socket in self.sockets:
            poller.register(socket, zmq.POLLIN)
        while not self.stopped.is_set():
            for socket, _ in poller.poll(POLL_MS):
                i = self.sockets.index(socket)
                while True:
                    try:
                        _topic, seq_bytes, payload = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._apply(i, int.from_bytes(seq_bytes, "big", signed=True), payload)

    def _apply(self, i: int, seq: int, payload: bytes) -> None:
        _ts, events, _rank = decode_batch(payload)
        with self.lock:
            replica = self.replicas[i]
            if replica.last_seq is not None and seq != replica.last_seq + 1:
                replica.gaps += 1
            replica.last_seq = seq
            replica.batches += 1
            apply_events(events, replica.hashes)
            self.lock.notify_all()

    def snapshot(self) -> list[set[int]]:
        with self.lock:
            return [set(r.hashes) for r in self.replicas]

    def wait_for(self, i: int, chain: Sequence[int], timeout: float) -> bool:
        """Until replica `i` holds every block of `chain`; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while matched_blocks(chain, self.replicas[i].hashes) < len(chain):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
        return True

    def wait_cleared(self, timeout: float) -> bool:
        """Until every replica's set is empty (after a flush of them all)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while any(r.hashes for r in self.replicas):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
        return True
