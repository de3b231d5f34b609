"""What `--kv-events-config` holds, in a module of its own: the settings every process reads
parse the flag without importing the worker's ZMQ publisher
(`services/worker/kv_event_publisher.py`)."""

from __future__ import annotations

import json
from typing import Literal

import msgspec


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`--kv-events-config`: SGLang's and vLLM's JSON keys and defaults."""

    publisher: Literal["zmq", "null"] = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    """Where the PUB socket binds: loopback unless the flag names another address (the
    chart's `tcp://*:<port>`), the one worker socket that may leave loopback."""
    topic: str = ""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """ZMQ send high-water mark (messages per subscriber)."""
    max_queue_size: int = 100_000
    """Batches the scheduler may queue ahead of the sending thread."""
    replay_endpoint: str | None = None
    enable_kv_cache_events: bool = True
    """vLLM's switch; SGLang's configs leave it out."""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            config = msgspec.convert(json.loads(text), cls)
        except (ValueError, msgspec.ValidationError) as e:
            raise ValueError(f"--kv-events-config: {e}") from None
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be >= 1")
        return config

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq" and self.enable_kv_cache_events
