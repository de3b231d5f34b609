"""How long one scheduler turn can hold the loop: the longest forward while a prompt of the
model's full context is prefilled next to a running stream, and how many decode steps that
stream gets meanwhile. Everything a loop does between turns (new requests, aborts of
dropped ones, the running requests' next tokens) waits for the turn in flight.

    python -m benchmarks.turn_bench                            # the defaults (chunk derived)
    python -m benchmarks.turn_bench --chunked-prefill-size 4096

Only the offline Engine's public surface is used, so the same file measures an older tree
side by side: `PYTHONPATH=/tmp/base python /work/main/benchmarks/turn_bench.py` from the
other tree's root.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

from engine.api import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req


class TurnRecorder:
    """A scheduler observer that keeps every forward's mode and seconds."""

    def __init__(self) -> None:
        self.forwards: list[tuple[str, float]] = []

    def on_admit(self, req: Req) -> None:
        pass

    def on_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        self.forwards.append((mode, seconds))

    def on_progress(self) -> None:
        pass


def measure(options: dict[str, Any], prompt_len: int | None) -> dict[str, Any]:
    started = time.monotonic()
    with Engine(**options) as engine:
        ready_s = time.monotonic() - started
        sched = engine.scheduler
        length = prompt_len or sched.context_len - 2
        recorder = TurnRecorder()
        sched.stats.observer = recorder
        greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4000}
        stream = engine._submit([1, 2, 3, 4], SamplingParams.from_dict(greedy))
        while not stream.output_ids:
            engine.scheduler.run_event_loop(should_stop=lambda: bool(stream.output_ids))
        recorder.forwards.clear()
        before = len(stream.output_ids)
        prompt = [100 + (7919 * i) % 20000 for i in range(length)]
        prefill_started = time.monotonic()
        engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1})
        prefill_s = time.monotonic() - prefill_started
        engine.scheduler.abort_request(stream.rid)
        turns = [seconds for _, seconds in recorder.forwards]
        return {
            "options": options,
            "chunked_prefill_size": getattr(sched, "chunked_prefill_size", None)
            or sched.args.chunked_prefill_size,
            "engine_ready_s": round(ready_s, 1),
            "prompt_tokens": length,
            "prefill_s": round(prefill_s, 2),
            "turns": len(turns),
            "longest_turn_s": round(max(turns), 2),
            "stream_tokens_during_prefill": len(stream.output_ids) - before,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunked-prefill-size", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: the context")
    args = parser.parse_args()
    options: dict[str, Any] = {"dtype": args.dtype, "max_total_tokens": 12288}
    if args.chunked_prefill_size is not None:
        options["chunked_prefill_size"] = args.chunked_prefill_size
    result = measure(options, args.prompt_len)
    result["machine"] = platform.processor() or platform.machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
