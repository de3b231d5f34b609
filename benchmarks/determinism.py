"""Same request, same tokens? Thinking Machines' experiment ("Defeating Nondeterminism in
LLM Inference") on this engine: many identical seeded temperature-1 completions, sent at
several concurrencies among random neighbours (other prompts, other lengths, other
samplings), counted as distinct completions. A server whose every kernel reduces in an
order that depends only on the request's own data gives one.

The probe is one completion request with a fixed `seed`: its draws come from a counter-based
generator keyed by (seed, output position), so any difference between two of its answers
comes from the logits, that is from what else shared its batches and whether its prompt's
prefix came from the radix cache or was computed again.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.determinism
    .venv/bin/python -m benchmarks.determinism --requests 200 --concurrency 1 8 -- --dtype bfloat16

Flags after `--` go to the server (default: the embedded model as `radixserve serve` runs
it). Prints one JSON object; results are recorded in docs/benchmarks/determinism.md.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2

from testing.launcher import ServiceLauncher

PROBE = {
    "prompt": "Write one sentence about a lighthouse keeper who finds a message in a bottle.",
    "temperature": 1.0,
    "seed": 1234,
    "max_tokens": 24,
}
WORDS = "river stone lamp winter letter garden engine market violin harbour candle".split()


def neighbour(rng: random.Random) -> dict[str, Any]:
    """A random other request: its own prompt and length, greedy or sampled."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
    return {
        "prompt": f"Continue: {words}",
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "max_tokens": rng.randint(4, 48),
    }


def run_wave(
    client: httpx2.Client, probes: int, concurrency: int, rng: random.Random
) -> tuple[list[str], int, float]:
    """`probes` probe requests shuffled among as many neighbours, `concurrency` in flight;
    the probes' texts, the completion tokens of the wave, and its seconds."""
    jobs = [PROBE] * probes + [neighbour(rng) for _ in range(probes)]
    rng.shuffle(jobs)

    def send(body: dict[str, Any]) -> tuple[bool, str, int]:
        response = client.post("/v1/completions", json=body)
        response.raise_for_status()
        answer = response.json()
        return body is PROBE, answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, jobs))
    seconds = time.monotonic() - started
    return [text for is_probe, text, _ in results if is_probe], sum(r[2] for r in results), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="probes in all")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--seed", type=int, default=0, help="of the neighbours")
    parser.add_argument("server_flags", nargs="*", help="after --: radixserve's flags")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    per_wave = args.requests // len(args.concurrency)
    waves = []
    wave_texts: list[Counter[str]] = []
    all_texts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as logs:
        launcher = ServiceLauncher(Path(logs), heartbeat_interval=None, show_logs=False)
        with launcher.serve(args.server_flags, timeout=600) as url:
            with httpx2.Client(base_url=url, timeout=600) as client:
                for concurrency in args.concurrency:
                    texts, tokens, seconds = run_wave(client, per_wave, concurrency, rng)
                    counts = Counter(texts)
                    wave_texts.append(counts)
                    all_texts.update(counts)
                    waves.append(
                        {
                            "concurrency": concurrency,
                            "probes": len(texts),
                            "distinct": len(counts),
                            "most_common_share": counts.most_common(1)[0][1] / len(texts),
                            "output_tok_s": round(tokens / seconds, 1),
                        }
                    )
                    print(json.dumps(waves[-1]), flush=True)
    completions = [text for text, _ in all_texts.most_common()]
    for wave, counts in zip(waves, wave_texts):  # which completions each wave gave
        wave["counts"] = {completions.index(text): n for text, n in counts.most_common()}
    report = {
        "server_flags": args.server_flags,
        "probes": sum(all_texts.values()),
        "distinct_completions": len(all_texts),
        "waves": waves,
        "completions": completions,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
