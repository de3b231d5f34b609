"""Publishes the worker's KV-cache events over ZMQ, as vLLM and SGLang do.

Wire: a PUB socket sends multipart `[topic, seq, payload]`, `seq` an 8-byte big-endian
counter from 0 and `payload` a msgpack `EventBatch` (`engine/cache/kv_events.py`). A
subscriber that sees a gap in `seq` asks the optional ROUTER replay socket: it sends the
8-byte sequence to start from and gets every buffered `[seq, payload]` from there, then
`[-1, b""]`.

The scheduler only puts batches on a bounded queue; a thread encodes and sends them. A
full queue drops the batch and counts it; a subscriber past its high-water mark loses
batches at the socket (a PUB socket never waits for anyone) and sees the gap in `seq`.
Either way a slow or stuck router can never stall decoding.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import zmq

from engine.cache.kv_events import BlockEventRecorder, EventBatch, KVCacheEvent
from services.kv_events_config import KVEventsConfig

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05
"""How long the thread waits for a batch before it looks at the replay socket again."""


class ZmqEventPublisher:
    """The PUB (and replay) sockets and the thread that owns them."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.published = 0
        self.dropped = 0
        """Batches dropped because the queue was full (the sending thread fell behind)."""
        self._queue: queue.Queue[EventBatch] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode()
        self._seq = 0
        self._stop = threading.Event()
        # Bound here so that a bad endpoint fails the start-up; used only by the thread.
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot bind: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "publishing KV-cache events on %s (replay: %s)",
            config.endpoint,
            config.replay_endpoint or "off",
        )

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one turn's events; never blocks."""
        if not events:
            return
        batch = EventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            else:
                self._send(batch)
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay(self._replay, self._replay.recv_multipart())

    def _send(self, batch: EventBatch) -> None:
        payload = self._encoder.encode(batch)
        seq = self._seq.to_bytes(8, "big")
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self._pub.send_multipart([self._topic, seq, payload])  # PUB drops, never blocks
        self.published += 1

    def _serve_replay(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        """`[identity, b"", start]` (a REQ or DEALER client) → the buffered batches."""
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV-events replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        replay.send_multipart([identity, b"", END_OF_REPLAY, b""])


def start_kv_events(
    config: KVEventsConfig | None, block_size: int, scheduler: Scheduler
) -> tuple[BlockEventRecorder | None, ZmqEventPublisher | None]:
    """With `--kv-events-config`, record the tree's blocks and publish them; the first
    batch is the start-up `AllBlocksCleared`."""
    if config is None:
        return None, None
    publisher = ZmqEventPublisher(config)
    recorder = BlockEventRecorder(block_size)
    scheduler.attach_kv_events(recorder)
    publisher.publish(recorder.take())
    return recorder, publisher
