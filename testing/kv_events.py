"""A router's side of the KV-cache events: subscribe, decode with plain msgpack, and keep
the set of blocks a replica holds. Used by the event tests and the fleet benchmark's
precise-routing simulation; it reads only the wire format, never radixserve's types."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

END_OF_REPLAY = -1


def apply_events(events: list[list[Any]], blocks: set[int]) -> None:
    """Apply decoded events (`[tag, *fields]`, vLLM's array layout) to a replica's blocks."""
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            blocks.update(event[1])
        elif tag == "BlockRemoved":
            blocks.difference_update(event[1])
        elif tag == "AllBlocksCleared":
            blocks.clear()
        else:
            raise ValueError(f"unknown KV event {tag!r}")


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int | None]:
    """`[ts, events, dp_rank]` of one published payload."""
    ts, events, dp_rank = msgpack.unpackb(payload)
    return ts, events, dp_rank


class Subscriber:
    """A SUB socket on one replica's events, with the blocks they add up to."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.blocks: set[int] = set()
        self.batches: list[tuple[int, list[list[Any]]]] = []
        """(seq, events) of every batch received, in order."""

    def drain(self, timeout_s: float = 0.0) -> int:
        """Read every batch that arrives within `timeout_s` of the last; return how many."""
        received = 0
        while self.sub.poll(int(timeout_s * 1000)):
            _topic, seq, payload = self.sub.recv_multipart()
            _, events, _ = decode_batch(payload)
            self.batches.append((int.from_bytes(seq, "big"), events))
            apply_events(events, self.blocks)
            received += 1
        return received

    def replay(self, start: int, timeout_s: float = 5.0) -> list[tuple[int, list[list[Any]]]]:
        """Ask the replay socket for every buffered batch from `start` on."""
        if self.replay_endpoint is None:
            raise ValueError("no replay endpoint")
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replayed = []
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise TimeoutError("replay did not end")
                _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_OF_REPLAY:
                    return replayed
                replayed.append((seq, decode_batch(payload)[1]))
        finally:
            dealer.close()

    def close(self) -> None:
        self.context.destroy(linger=0)
