"""Same request, same tokens? Thinking Machines' experiment ("Defeating Nondeterminism in
LLM Inference") on this engine: many identical seeded temperature-1 completions, sent at
several concurrencies among random neighbours (other prompts, other lengths, other
samplings), counted as distinct completions. A server whose every kernel reduces in an
order that depends only on the request's own data gives one.

The probe is one completion request with a fixed `seed`: its draws come from a counter-based
generator keyed by (seed, output position), so any difference between two of its answers
comes from the logits, that is from what else shared its batches and whether its prompt's
prefix came from the radix cache or was computed again.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.determinism \
        --modes default deterministic
    .venv/bin/python -m benchmarks.determinism --requests 200 --concurrency 1 8 -- --dtype bfloat16

With two modes, both servers run for the whole benchmark and take each wave in turns
(`--rounds` parts, the same neighbours for both, the order alternating), so their
throughputs are measured side by side on a host whose speed drifts.

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
from contextlib import ExitStack
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
MODES = {"default": [], "deterministic": ["--enable-deterministic-inference"]}
"""Each server's flags beside the shared ones."""
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
    parser.add_argument("--requests", type=int, default=1000, help="probes in all, per server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--seed", type=int, default=0, help="of the neighbours")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(MODES),
        default=["default"],
        help="servers to run side by side, each wave sent to one then the other with the "
        "same neighbours: default, and deterministic (--enable-deterministic-inference)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="turns each mode takes per wave (side by side)"
    )
    parser.add_argument("server_flags", nargs="*", help="after --: radixserve's flags")
    args = parser.parse_args()
    per_wave = args.requests // len(args.concurrency)
    report: dict[str, Any] = {"server_flags": args.server_flags, "modes": {}}
    with tempfile.TemporaryDirectory() as logs, ExitStack() as stack:
        clients = {}
        for mode in args.modes:
            (Path(logs) / mode).mkdir()
            launcher = ServiceLauncher(Path(logs) / mode, heartbeat_interval=None, show_logs=False)
            url = stack.enter_context(
                launcher.serve([*args.server_flags, *MODES[mode]], timeout=600)
            )
            clients[mode] = stack.enter_context(httpx2.Client(base_url=url, timeout=600))
            info = clients[mode].get("/get_server_info").json()
            report["modes"][mode] = {
                "enable_deterministic_inference": info["enable_deterministic_inference"],
                "cpu_isa": info["cpu_isa"],
                "waves": [],
            }
        texts: dict[str, Counter[str]] = {mode: Counter() for mode in args.modes}
        for concurrency in args.concurrency:
            waves = {mode: Counter[str]() for mode in clients}
            tokens = dict.fromkeys(clients, 0)
            seconds = dict.fromkeys(clients, 0.0)
            for part in range(args.rounds):  # the modes take turns, so drift hits both
                order = list(clients) if part % 2 == 0 else list(reversed(clients))
                for mode in order:
                    rng = random.Random(f"{args.seed}-{concurrency}-{part}")  # same jobs each
                    got = run_wave(clients[mode], per_wave // args.rounds, concurrency, rng)
                    waves[mode].update(got[0])
                    tokens[mode] += got[1]
                    seconds[mode] += got[2]
            for mode, counts in waves.items():
                texts[mode].update(counts)
                wave = {
                    "mode": mode,
                    "concurrency": concurrency,
                    "probes": sum(counts.values()),
                    "distinct": len(counts),
                    "output_tok_s": round(tokens[mode] / seconds[mode], 1),
                    "counts": counts,
                }
                report["modes"][mode]["waves"].append(wave)
                print(json.dumps({k: v for k, v in wave.items() if k != "counts"}), flush=True)
    for mode, all_texts in texts.items():
        completions = [text for text, _ in all_texts.most_common()]
        summary = report["modes"][mode]
        for wave in summary["waves"]:  # which completions each wave gave
            wave["counts"] = {completions.index(t): n for t, n in wave["counts"].most_common()}
        summary["probes"] = sum(all_texts.values())
        summary["distinct_completions"] = len(all_texts)
        summary["completions"] = completions
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
