"""What NGRAM speculative decoding buys, side by side: two servers, one plain and one with
`--speculative-algorithm NGRAM`, take the same requests in turns, on three workloads:

- `repeat`: the output repeats the input — rewrite a ~300-token code snippet with one
  name changed, or summarise a passage quoting its sentences;
- `json`: extract fields from a passage as JSON under a schema (`response_format`);
- `random`: open questions (a story, an explanation, tips) whose answers are new text:
  little to repeat, so adaptive drafting's off-switch is what is measured.

Output tok/s counts completion tokens over the whole time of the requests (prefill
included), at concurrency 1 (single stream) and 8. Every round uses prompts not seen
before (the trie learns the traffic, as in production, but never the answer to the same
request); the servers alternate which goes first.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.speculative
    .venv/bin/python -m benchmarks.speculative --rounds 2 -- --speculative-num-draft-tokens 6

Flags after `--` go to the speculative server only. Prints one JSON line per (workload,
concurrency) and a summary; results are recorded in docs/benchmarks/speculative.md.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx2

from testing.launcher import ServiceLauncher

FUNCTIONS = [
    ("parse_config", "path", "settings"),
    ("merge_intervals", "intervals", "merged"),
    ("word_counts", "text", "counts"),
    ("moving_average", "values", "window"),
    ("flatten", "nested", "flat"),
    ("retry", "attempts", "delay"),
    ("chunked", "items", "size"),
    ("top_k", "scores", "k"),
]
CITIES = ["Lisbon", "Osaka", "Nairobi", "Quito", "Tallinn", "Perth", "Montreal", "Cusco"]
JOBS = ["marine biologist", "bridge engineer", "violin maker", "air traffic controller"]
NAMES = ["Ana Souza", "Kenji Mori", "Wanjiru Kamau", "Diego Paredes", "Liis Tamm", "Noah Reid"]
WORDS = "river stone lamp winter letter garden engine market violin harbour candle".split()
SUBJECTS = ["a retired sailor", "a young chemist", "a stray cat", "two rival bakers", "a robot"]
ASKS = [
    "Write a short story about {subject} in {place}.",
    "Explain to a ten-year-old why the sky changes colour at sunset, mentioning a {word}.",
    "Give three tips for someone moving to {place} for the first time.",
    "Describe a day in the life of {subject}.",
    "Write a poem about a {word} and {subject}.",
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "years_of_experience": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "city", "occupation", "years_of_experience", "languages"],
}


def code_snippet(rng: random.Random, name: str, arg: str, out: str) -> str:
    """A ~300-token Python module: a documented function and a small test of it."""
    step = rng.randint(2, 9)
    return f'''import logging
from collections import defaultdict

logger = logging.getLogger(__name__)


def {name}({arg}, limit=None):
    """Process {arg} and return {out}.

    Each element of {arg} is visited once; elements that fail validation are
    logged and skipped, so one bad element never stops the whole run.
    """
    {out} = defaultdict(list)
    for index, element in enumerate({arg}):
        if limit is not None and index >= limit:
            logger.info("stopping after %d elements", limit)
            break
        if element is None:
            logger.warning("element %d is empty, skipped", index)
            continue
        key = index % {step}
        {out}[key].append(element)
    return dict({out})


def test_{name}():
    {arg} = [1, 2, None, 4, 5, 6, 7]
    {out} = {name}({arg}, limit=6)
    assert sum(len(group) for group in {out}.values()) == 5
    assert {name}([], limit=3) == {{}}
'''


def repeat_request(rng: random.Random) -> dict[str, Any]:
    name, arg, out = rng.choice(FUNCTIONS)
    code = code_snippet(rng, name, arg, out)
    if rng.random() < 0.5:
        new = f"{name}_{rng.choice(['v2', 'fast', 'safe', 'new'])}"
        ask = f"Rewrite this code exactly as it is, but rename `{name}` to `{new}`:\n\n{code}"
    else:
        ask = (
            "Summarise what this code does in a few sentences, quoting the docstring and the "
            f"log messages word for word:\n\n{code}"
        )
    return {"messages": [{"role": "user", "content": ask}]}


def json_request(rng: random.Random) -> dict[str, Any]:
    name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
    years = rng.randint(2, 30)
    languages = rng.sample(["English", "Spanish", "Japanese", "Swahili", "Estonian"], 2)
    passage = (
        f"{name} has worked as a {job} in {city} for {years} years. Colleagues in {city} "
        f"describe {name} as patient and precise. {name} speaks {languages[0]} and "
        f"{languages[1]}, and still keeps notes from the first year as a {job}."
    )
    ask = (
        "Extract the person described below as JSON with the fields name, city, occupation, "
        f"years_of_experience and languages.\n\nText: {passage}"
    )
    return {
        "messages": [{"role": "user", "content": ask}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        },
    }


def random_request(rng: random.Random) -> dict[str, Any]:
    """An open question whose answer is new text: little of it repeats the prompt."""
    ask = rng.choice(ASKS).format(
        subject=rng.choice(SUBJECTS), place=rng.choice(CITIES), word=rng.choice(WORDS)
    )
    return {"messages": [{"role": "user", "content": ask}]}


WORKLOADS = {"repeat": repeat_request, "json": json_request, "random": random_request}


def run_wave(
    client: httpx2.Client, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[int, float]:
    """Completion tokens of the wave and its seconds."""

    def send(body: dict[str, Any]) -> int:
        response = client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(send, bodies))
    return tokens, time.monotonic() - started


def spec_counters(client: httpx2.Client) -> dict[str, int]:
    stats = client.get("/get_server_info").json()["scheduler_stats"]
    return {k: stats.get(k, 0) for k in ("spec_verify_steps", "spec_accepted_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=8, help="per wave")
    parser.add_argument("--rounds", type=int, default=3, help="waves per (workload, concurrency)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("spec_flags", nargs="*", help="after --: the speculative server's flags")
    args = parser.parse_args()
    modes = {"plain": [], "ngram": ["--speculative-algorithm", "NGRAM", *args.spec_flags]}
    report: dict[str, Any] = {"spec_flags": modes["ngram"], "results": []}
    with tempfile.TemporaryDirectory() as logs, ExitStack() as stack:
        clients = {}
        for mode, flags in modes.items():
            (Path(logs) / mode).mkdir()
            launcher = ServiceLauncher(Path(logs) / mode, heartbeat_interval=None, show_logs=False)
            url = stack.enter_context(launcher.serve(flags, timeout=600))
            clients[mode] = stack.enter_context(httpx2.Client(base_url=url, timeout=900))
        info = clients["ngram"].get("/get_server_info").json()
        report["cpu_isa"], report["cpu_flags"] = info["cpu_isa"], info["cpu_flags"]
        for workload in args.workloads:
            for concurrency in args.concurrency:
                tokens = dict.fromkeys(clients, 0)
                seconds = dict.fromkeys(clients, 0.0)
                before = spec_counters(clients["ngram"])
                for part in range(args.rounds):
                    rng = random.Random(f"{args.seed}-{workload}-{concurrency}-{part}")
                    bodies = [
                        {
                            **WORKLOADS[workload](rng),
                            "temperature": 0,
                            "max_tokens": args.max_tokens,
                        }
                        for _ in range(args.requests)
                    ]
                    order = list(clients) if part % 2 == 0 else list(reversed(clients))
                    for mode in order:
                        got, took = run_wave(clients[mode], bodies, concurrency)
                        tokens[mode] += got
                        seconds[mode] += took
                after = spec_counters(clients["ngram"])
                steps = after["spec_verify_steps"] - before["spec_verify_steps"]
                accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                rates = {mode: tokens[mode] / seconds[mode] for mode in clients}
                row = {
                    "workload": workload,
                    "concurrency": concurrency,
                    "plain_tok_s": round(rates["plain"], 1),
                    "ngram_tok_s": round(rates["ngram"], 1),
                    "speedup": round(rates["ngram"] / rates["plain"], 2),
                    "accept_length": round(1 + accepted / steps, 2) if steps else None,
                    "verify_steps": steps,
                    "tokens": tokens,
                }
                report["results"].append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
