"""JSONSchemaBench through the server: the 240 schemas of ../shared/jsonschemabench-dev (30
from each of 8 subsets, byte for byte) sent as `response_format` json_schema to the three
real processes on the embedded model, with the official `openai` client, once per
`--grammar-backend`. Per subset: declared coverage (answered, not refused with a 400),
compliance of the finished answers (`finish_reason: "stop"`, valid under the `jsonschema`
package's validator for the schema's own draft), answers cut at max_tokens, 5xx and
timeouts. The paper's metrics (Geng et al., arXiv 2501.10868).

    .venv/bin/python -m benchmarks.schema_compliance [--backends auto xgrammar llguidance]
        [--max-tokens 256] [--concurrency 4] [--limit N] [--only SUBSET/FILE ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai

from benchmarks.schema_coverage import DEFAULT_DIR
from testing.launcher import ServiceLauncher, cpu_flags

PROMPT = "Answer with one JSON value that follows this JSON schema.\n\n{schema}"
OUTCOMES = ("refused", "valid", "invalid", "length", "error_finish", "5xx", "timeout")


def ask(client: openai.OpenAI, schema_text: str, max_tokens: int) -> tuple[str, str]:
    """One schema's outcome and a detail for the log."""
    schema = json.loads(schema_text)
    try:
        answer = client.chat.completions.create(
            model="embedded",
            messages=[{"role": "user", "content": PROMPT.format(schema=schema_text[:4000])}],
            temperature=0,
            max_tokens=max_tokens,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        )
    except openai.BadRequestError as e:
        # A grammar too costly to follow ends its request with a 400 too: not a refusal.
        return ("error_finish" if "too costly" in str(e) else "refused"), str(e)[:160]
    except openai.APITimeoutError:
        return "timeout", ""
    except openai.InternalServerError as e:
        return "5xx", str(e)[:160]
    choice = answer.choices[0]
    if choice.finish_reason == "length":
        return "length", ""
    if choice.finish_reason != "stop":
        return "error_finish", str(choice.finish_reason)
    try:
        value = json.loads(choice.message.content or "")
        jsonschema.validators.validator_for(schema)(schema).validate(value)
    except (ValueError, jsonschema.ValidationError) as e:
        return "invalid", str(e)[:160]
    return "valid", ""


def run_backend(
    backend: str, files: list[Path], args: argparse.Namespace
) -> dict[str, collections.Counter[str]]:
    """Each subset's outcome counts under one `--grammar-backend`."""
    logs = Path(tempfile.mkdtemp(prefix=f"schema-compliance-{backend}-"))
    launcher = ServiceLauncher(logs, show_logs=False)
    flags = [*cpu_flags(16384), "--grammar-backend", backend]
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with launcher.serve(flags, timeout=180) as url:
        client = openai.OpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.timeout
        )
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = pool.map(lambda f: ask(client, f.read_text(), args.max_tokens), files)
            for path, (outcome, detail) in zip(files, outcomes):
                counts[path.parent.name][outcome] += 1
                if outcome != "valid" and outcome != "length":
                    print(f"  {backend} {path.parent.name}/{path.name}: {outcome} {detail}")
        print(f"  {backend}: {time.monotonic() - started:.0f} s, logs in {logs}", flush=True)
    return counts


def print_table(backend: str, counts: dict[str, collections.Counter[str]]) -> None:
    print(f"\n### {backend}\n")
    columns = "coverage | finished | compliance | cut at max_tokens | 5xx | timeouts"
    print(f"| subset | schemas | {columns} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    total: collections.Counter[str] = collections.Counter()
    for subset in sorted(counts):
        total.update(counts[subset])
        print(_row(subset, counts[subset]))
    print(_row("all", total))


def _row(name: str, c: collections.Counter[str]) -> str:
    schemas = sum(c.values())
    finished = c["valid"] + c["invalid"]
    compliance = f"{c['valid'] / finished:.3f}" if finished else "-"
    coverage = (schemas - c["refused"]) / schemas
    return (
        f"| {name} | {schemas} | {coverage:.1%} | {finished} | {compliance} | "
        f"{c['length']} | {c['5xx']} | {c['timeout']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--backends", nargs="+", default=["auto", "xgrammar", "llguidance"])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--limit", type=int, help="the first N schemas of each subset")
    parser.add_argument("--only", nargs="+", help="these schemas only (SUBSET/FILE)")
    args = parser.parse_args()
    subsets = sorted(p for p in args.dir.iterdir() if p.is_dir())
    files = [f for s in subsets for f in sorted(s.glob("*.json"))[: args.limit]]
    if args.only:
        files = [f for f in files if f"{f.parent.name}/{f.name}" in args.only]
    results: dict[str, Any] = {b: run_backend(b, files, args) for b in args.backends}
    for backend, counts in results.items():
        print_table(backend, counts)


if __name__ == "__main__":
    main()
