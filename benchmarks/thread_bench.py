"""Decode speed under OpenMP settings, with and without a competing process, side by side.

The worker shares the machine's cores with the tokenizer, the detokenizer and clients. With
OpenMP's default wait policy, torch's idle threads spin, and when another process holds a
core the spinning thread and the one doing the work fight over it. Each row runs the same
greedy decode (embedded SmolLM2-135M-Instruct, bf16, one request) in a fresh process with
its own environment; "busy" rows add a process that spins on one core for the duration.

Run: .venv/bin/python benchmarks/thread_bench.py [--tokens 64]
Results are recorded in docs/benchmarks/model.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys

SETTINGS = {
    "libgomp default (spins 300000 turns, then sleeps)": {
        "OMP_WAIT_POLICY": "",
        "GOMP_SPINCOUNT": "",
    },
    "OMP_WAIT_POLICY=PASSIVE (sleeps at once)": {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "",
    },
    "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=10000 (the engine's default)": {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "10000",
    },
    "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=100000": {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "100000",
    },
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
}
DECODE = """
import time
from engine.api import Engine
engine = Engine(max_total_tokens=4096)
engine.generate("warm up", {{"max_new_tokens": 4}})
start = time.perf_counter()
params = {{"max_new_tokens": {tokens}, "ignore_eos": True, "temperature": 0}}
engine.generate("Tell me a story", params)
print((time.perf_counter() - start) / {tokens} * 1000)
"""


def spin() -> None:
    while True:
        pass


def ms_per_token(env: dict[str, str], tokens: int, busy: bool) -> float:
    competitor = multiprocessing.Process(target=spin, daemon=True) if busy else None
    if competitor is not None:
        competitor.start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", DECODE.format(tokens=tokens)],
            env={**os.environ, **env},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        if competitor is not None:
            competitor.terminate()
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; greedy decode of {args.tokens} tokens, one request, bf16\n")
    print("| setting | ms/token, quiet | ms/token, one core busy |")
    print("|---|---:|---:|")
    for name, env in SETTINGS.items():
        quiet, busy = (ms_per_token(env, args.tokens, busy) for busy in (False, True))
        print(f"| {name} | {quiet:.1f} | {busy:.1f} |")


if __name__ == "__main__":
    main()
