"""`/healthz` latency while the tokenizer handles prompts of many megabytes.

One server (the tiny Llama with SmolLM2's tokenizer, `--max-prompt-chars` between the two
sizes below) is probed back to back on `/healthz` from one thread, in three phases: idle;
while 15,000,000-character chat prompts are refused by the prompt limit (the body is read
and parsed, then refused before templating); and while 12 MiB chat prompts are templated
and tokenized (about 2.8 million tokens each, then refused for the model's context), and
as large as the default limit admits (1 MiB, refused for the context too). Each
phase prints the probes' p50, p99 and max latency in milliseconds. The aim is 100 ms.

Run: .venv/bin/python benchmarks/healthz_bench.py [--repeats 2]
Results are recorded in docs/benchmarks/healthz.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx2

from testing.launcher import ServiceLauncher, cpu_flags
from testing.models import save_tiny_llama

TOKENIZED_CHARS = 12 * 2**20
DEFAULT_LIMIT_CHARS = 2**20
"""The largest prompt `--max-prompt-chars` admits by default."""
REFUSED_CHARS = 15_000_000
PROMPT_LIMIT = 13_000_000


def chat_body(chars: int) -> bytes:
    text = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()


def probe_while(url: str, load: threading.Thread | None, idle_s: float) -> list[float]:
    """`/healthz` latencies (ms), back to back, until `load` ends (or for `idle_s`)."""
    latencies: list[float] = []
    deadline = time.monotonic() + idle_s
    with httpx2.Client(base_url=url, timeout=120) as client:
        if load is not None:
            load.start()
        while load.is_alive() if load is not None else time.monotonic() < deadline:
            start = time.perf_counter()
            status = client.get("/healthz").status_code
            latencies.append((time.perf_counter() - start) * 1e3)
            assert status == 200, status
    return latencies


def post_all(url: str, body: bytes, repeats: int) -> threading.Thread:
    def run() -> None:
        for _ in range(repeats):
            response = httpx2.post(
                f"{url}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=600,
            )
            assert response.status_code == 400, response.text[:300]

    return threading.Thread(target=run)


def report(phase: str, latencies: list[float]) -> None:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    print(
        f"{phase:<44} probes {len(ordered):>5}  p50 {statistics.median(ordered):7.1f} ms  "
        f"p99 {p99:7.1f} ms  max {ordered[-1]:7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="big prompts per phase")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_llama(Path(tmp) / "model")
        launcher = ServiceLauncher(Path(tmp), show_logs=False)
        flags = [*cpu_flags(8192, model), "--max-prompt-chars", str(PROMPT_LIMIT)]
        with launcher.serve(flags) as url:
            report("idle", probe_while(url, None, idle_s=5.0))
            refused = post_all(url, chat_body(REFUSED_CHARS), args.repeats)
            report(f"{REFUSED_CHARS:,} chars refused by the limit", probe_while(url, refused, 0))
            for chars in (DEFAULT_LIMIT_CHARS, TOKENIZED_CHARS):
                tokenized = post_all(url, chat_body(chars), args.repeats)
                report(f"{chars:,} chars templated + tokenized", probe_while(url, tokenized, 0))


if __name__ == "__main__":
    main()
