"""Schemathesis against a real server, from the server's own `/openapi.json`.

One server (the tiny Llama with SmolLM2's tokenizer, API key set, short answers) is fuzzed
by `schemathesis run` in positive mode: every body is generated from the document's schemas
alone, with no hand-written repair. Its HAR report is then counted per operation: how many
bodies the server accepted (2xx), refused (4xx) and failed on (5xx). The run passes when
schemathesis' checks pass (no 5xx, every status and body as the document declares, so every
4xx in OpenAI's error shape, checked here again), at least `--min-accepted` of the
requests are accepted, and the server still serves a completion afterwards.

Run: .venv/bin/python -m benchmarks.api_fuzz [--max-examples 50] [--seed 1]
Results are recorded in docs/benchmarks/api-fuzz.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

from testing.launcher import ServiceLauncher, cpu_flags
from testing.models import save_tiny_llama

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS_CAP = 8
"""Accepted requests generate a few tokens at most, so that thousands take minutes."""
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)
EXCLUDED_OPERATIONS = ("/health_generate",)
"""Probes one token through the worker with a 20 s budget of its own: nothing to fuzz."""


@dataclass
class Tally:
    """Answers to one operation, by status class."""

    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def count(self, low: int, high: int) -> int:
        return sum(n for status, n in self.statuses.items() if low <= status < high)


@dataclass
class FuzzResult:
    exit_code: int
    """schemathesis' own: 0 when every check passed."""
    operations: dict[str, Tally]
    bad_errors: list[str]
    """4xx and 5xx answers not in OpenAI's error shape."""
    alive_after: bool

    @property
    def requests(self) -> int:
        return sum(t.total for t in self.operations.values())

    def count(self, low: int, high: int) -> int:
        return sum(t.count(low, high) for t in self.operations.values())

    @property
    def accepted(self) -> float:
        return self.count(200, 300) / max(self.requests, 1)


def is_openai_error(text: str) -> bool:
    try:
        body = json.loads(text)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and isinstance(error["type"], str)
    )


def read_har(path: Path, templates: list[str]) -> tuple[dict[str, Tally], list[str]]:
    """Per operation ("POST /v1/completions", "GET /v1/models/{model_id}"), the statuses
    answered; and every error answer not in OpenAI's shape."""
    patterns = [
        (re.compile(re.sub(r"\\\{[^/]+?\\\}", ".+", re.escape(t)) + "$"), t) for t in templates
    ]
    operations: dict[str, Tally] = {}
    bad: list[str] = []
    for entry in json.loads(path.read_text())["log"]["entries"]:
        request, response = entry["request"], entry["response"]
        route = "/" + request["url"].split("/", 3)[3].split("?")[0]
        route = next((t for pattern, t in patterns if pattern.match(route)), route)
        operation = f"{request['method']} {route}"
        status = response["status"]
        operations.setdefault(operation, Tally()).statuses[status] += 1
        text = response.get("content", {}).get("text", "")
        if status >= 400 and status != 499 and not is_openai_error(text):
            bad.append(f"{operation} {status}: {text[:200]}")
    return operations, bad


def fuzz(
    url: str, work_dir: Path, max_examples: int, seed: int, max_time: int | None
) -> FuzzResult:
    """`schemathesis run` in positive mode against `url`; the tally of its HAR report."""
    har = work_dir / "fuzz.har"
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{url}/openapi.json",
        "--mode",
        "positive",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--checks",
        ",".join(CHECKS),
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--request-timeout",
        "60",
        "--workers",
        "2",
        "--no-shrink",
        "--suppress-health-check",
        "all",
        "--report",
        "har",
        "--report-har-path",
        str(har),
        *(arg for path in EXCLUDED_OPERATIONS for arg in ("--exclude-path", path)),
        *(["--max-time", str(max_time)] if max_time else []),
    ]
    print("$", " ".join(command), flush=True)
    exit_code = subprocess.run(command, cwd=work_dir).returncode
    templates = list(httpx2.get(f"{url}/openapi.json", headers=AUTH, timeout=10).json()["paths"])
    operations, bad = read_har(har, templates)
    return FuzzResult(exit_code, operations, bad, alive_after=serves_after(url))


def serves_after(url: str) -> bool:
    body = {"prompt": "The cat", "max_tokens": 2}
    try:
        health = httpx2.get(f"{url}/health", timeout=10).status_code
        answer = httpx2.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    except httpx2.HTTPError:
        return False
    return health == 200 and answer.status_code == 200


def server_flags(model_dir: Path) -> list[str]:
    return [
        *cpu_flags(4096, model_dir),
        "--api-key",
        API_KEY,
        "--max-tokens-cap",
        str(MAX_TOKENS_CAP),
        "--request-timeout",
        "60",
    ]


def run(max_examples: int, seed: int, max_time: int | None, work_dir: Path) -> FuzzResult:
    """A fresh server on the tiny model, fuzzed; stopped after."""
    model_dir = save_tiny_llama(work_dir / "model")
    logs = work_dir / "logs"
    logs.mkdir()
    launcher = ServiceLauncher(logs, show_logs=False)
    with launcher.serve(server_flags(model_dir)) as url:
        return fuzz(url, work_dir, max_examples, seed, max_time)


def report(result: FuzzResult) -> str:
    lines = [
        f"{'operation':<40} {'requests':>8} {'2xx':>6} {'4xx':>6} {'5xx':>5}",
        *(
            f"{op:<40} {t.total:>8} {t.count(200, 300):>6} {t.count(400, 500):>6} "
            f"{t.count(500, 600):>5}"
            for op, t in sorted(result.operations.items())
        ),
        f"{'all':<40} {result.requests:>8} {result.count(200, 300):>6} "
        f"{result.count(400, 500):>6} {result.count(500, 600):>5}",
        f"accepted: {result.accepted:.1%}; schemathesis exit {result.exit_code}; "
        f"errors not in OpenAI's shape: {len(result.bad_errors)}; "
        f"serving after: {result.alive_after}",
    ]
    return "\n".join(lines + result.bad_errors[:20])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=50, help="per operation")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-time", type=int, default=None, help="seconds for the whole run")
    parser.add_argument("--min-accepted", type=float, default=0.8)
    parser.add_argument(
        "--keep", type=Path, default=None, help="an empty folder to keep the HAR report and logs in"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp) if args.keep is None else args.keep
        work_dir.mkdir(parents=True, exist_ok=True)
        result = run(args.max_examples, args.seed, args.max_time, work_dir)
    print(report(result))
    ok = (
        result.exit_code == 0
        and not result.bad_errors
        and result.count(500, 600) == 0
        and result.accepted >= args.min_accepted
        and result.alive_after
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
