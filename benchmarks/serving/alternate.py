"""Single-stream requests alternated between servers that are already running, one request
to each in turn: on a host whose speed drifts by tens of percent within minutes, servers
measured one after the other (as compare.py runs its peers) can differ by the drift alone;
alternated request by request, they share it. Each request is a unique prompt of
`--prompt-len` random token ids, greedy, exactly `--output-len` tokens (`ignore_eos`),
not streamed; the figure is the median wall time per request and its output tok/s.

    python -m benchmarks.serving.alternate http://127.0.0.1:30000 http://127.0.0.1:8090
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from typing import Any


def complete(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        reply: dict[str, Any] = json.load(response)
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", nargs="+", help="base URLs of OpenAI-compatible servers")
    parser.add_argument("--rounds", type=int, default=8, help="requests to each server")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    def body(output_len: int) -> dict[str, Any]:
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        return {
            "model": args.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
        }

    for url in args.urls:  # warm-up
        complete(url, body(4))
    walls: dict[str, list[float]] = {url: [] for url in args.urls}
    for _ in range(args.rounds):
        for url in args.urls:
            start = time.perf_counter()
            reply = complete(url, body(args.output_len))
            walls[url].append(time.perf_counter() - start)
            tokens = reply["usage"]["completion_tokens"]
            assert tokens == args.output_len, f"{url} gave {tokens} tokens"
    for url, times in walls.items():
        median = statistics.median(times)
        print(
            f"{url}: median {median:.2f} s per request, {args.output_len / median:.1f} out tok/s "
            f"({' '.join(f'{t:.2f}' for t in times)})"
        )


if __name__ == "__main__":
    main()
