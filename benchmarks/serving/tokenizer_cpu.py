"""CPU time the tokenizer process spends per decode step on its side of the per-token path,
without HTTP: decode one `BatchStrOutput` of `--batch` streamed completions, route it to
the requests' groups, make each stream's chunks and frame them as SSE events. Process CPU
time, not wall time, so that other jobs on a shared machine move it less.

    python -m benchmarks.serving.tokenizer_cpu --batch 8

`benchmarks.serving.token_path --tokenizer-cpu` runs this file's source inside each tree
it compares (`_layout` finds the internals in the layout the tree has).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any


def _layout() -> tuple[Any, Any, Callable[[Any, list[Any]], str]]:
    """The accumulator, the completions endpoint and the edge's framing of one output's
    events: this tree's, or those of a tree from before the typed streams
    (`services.tokenizer.serving`, whose events were framed already)."""
    try:
        from services.tokenizer.serving_base import ChoiceAccumulator
        from services.tokenizer.serving_completions import CompletionsEndpoint
        from services.tokenizer.sse import frame
    except ModuleNotFoundError:
        from services.tokenizer.serving import (  # type: ignore[import-not-found,no-redef]
            ChoiceAccumulator,
            CompletionsEndpoint,
        )

        return ChoiceAccumulator, CompletionsEndpoint, lambda _, events: "".join(events)
    return ChoiceAccumulator, CompletionsEndpoint, lambda e, chunks: frame(chunks, e.deltas)


async def measure(batch: int, steps: int) -> float:
    """Microseconds of process CPU per step."""
    from services.io_struct import BatchStrOutput, decode, encode
    from services.tokenizer import manager as manager_module
    from services.tokenizer.protocol.completions import CompletionRequest

    ChoiceAccumulator, CompletionsEndpoint, framed = _layout()

    manager: Any = manager_module.TokenizerManager.__new__(manager_module.TokenizerManager)
    manager.tokenizer, manager.num_queued, manager.groups = None, 0, {}
    streams = []
    for _ in range(batch):
        body = CompletionRequest.model_validate(
            {"model": "m", "prompt": [1, 2, 3], "stream": True, "max_tokens": steps}
        )
        endpoint = CompletionsEndpoint(body, "m")
        rid = f"{endpoint.id}-0"
        fields: dict[str, Any] = {"unfinished": {rid}}
        if "index" in manager_module._Group.__dataclass_fields__:
            fields["index"] = {rid: 0}
        group = manager_module._Group(**fields)
        manager.groups[rid] = group
        streams.append((endpoint, group, ChoiceAccumulator(want_logprobs=False)))
    rids = list(manager.groups)
    wire = [
        encode(
            BatchStrOutput(
                rids=rids,
                output_ids=[[100 + i]] * batch,
                finished_reasons=[None] * batch,
                prompt_tokens=[3] * batch,
                completion_tokens=[i + 1] * batch,
                cached_tokens=[0] * batch,
                output_strs=[" token"] * batch,
            )
        )
        for i in range(steps)
    ]
    start = time.process_time()
    for data in wire:
        manager._route(decode(data))
        for endpoint, group, acc in streams:
            item = group.queue.get_nowait()
            for out in item if isinstance(item, list) else [dataclasses.replace(item, index=0)]:
                framed(endpoint, endpoint.events(out, acc.add(out), acc))
    return (time.process_time() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    print(f"{asyncio.run(measure(args.batch, args.steps)):.1f}")


if __name__ == "__main__":
    main()
