"""JSON-schema decoding on the offline Engine: unconstrained vs constrained vs jump-forward,
and the grammar's cost per token, side by side in one run.

Workload: the 20 schemas of testing/grammar_schemas.py with their prompts, greedy. Rows:
- "batch": all 20 submitted at once (throughput);
- "one by one": each request alone (latency; forward passes per request are what
  jump-forward saves).
The unconstrained row generates, per prompt, as many tokens as the constrained run did
(ignore_eos), so both decode the same amount. Each configuration lives in its own Engine,
warmed up with one batch first; the rows are measured in alternation.

Mask overhead per token: every constrained output is replayed through a fresh matcher,
timing the bitmask fill, the token accept, and applying the bitmask to a logits row.

Length-bounded strings (`--length-bounds`): mask time per token inside a string with
minLength 50 and maxLength 64, 1,024 and 32,767, with each library (xgrammar with the strict
JSON strings of engine/grammar/strict_json.py, and llguidance), over the first and the last
10 tokens of a 40-token string body, and the p99 over all; then one request of 40 tokens
under maxLength 32,767 against the same schema without bounds, per library. `--base DIR`
runs the same measurement on the checkout in DIR (a `git worktree` of the commit before)
first, in a subprocess, so both print side by side.

Mask table (`--mask-table`): mask time per token (mean and p99) under xgrammar, llguidance
and auto's choice, replaying a matching text through a fresh matcher: an ordinary schema,
strings bounded to maxLength 64 / 1,024 / 32,767, an enum of 2,000 values and the schema a
`tool_choice: "required"` over three tools builds.

Run from the repository root: .venv/bin/python -m benchmarks.grammar_bench [--dtype bfloat16]
[--length-bounds [--base /tmp/base]] [--mask-table]
Results are recorded in docs/benchmarks/grammar.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

import torch

from engine.api import Engine
from engine.grammar import GrammarBackend, allocate_vocab_mask
from engine.outputs import GenerateResult
from engine.sampling.vocab_mask import apply_vocab_mask
from testing.grammar_schemas import SCHEMAS

MODES = {
    "unconstrained": {},
    "json_schema": {"enable_jump_forward": False},
    "json_schema + jump-forward": {"enable_jump_forward": True},
}


class Pass(NamedTuple):
    seconds: float
    results: list[GenerateResult]
    forward_passes: int
    jump_forward_tokens: int


def run(engine: Engine, prompts: list[str], params: list[dict], one_by_one: bool) -> Pass:
    """One pass over the workload."""
    stats = engine.scheduler.stats
    passes, jumped = sum(stats.forward_modes.values()), stats.jump_forward_tokens
    start = time.perf_counter()
    if one_by_one:
        results = [engine.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    else:
        results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return Pass(
        seconds,
        results,
        sum(stats.forward_modes.values()) - passes,
        stats.jump_forward_tokens - jumped,
    )


def replay_us(
    backend: GrammarBackend, kind: str, source: str, ids: list[int]
) -> tuple[list[float], list[float], list[float]]:
    """Microseconds of the mask fill, the mask applied to a logits row, and the token
    accepted, per token of `ids` replayed through a fresh matcher of `source`."""
    pending = backend.submit(kind, source)
    pending.future.result()
    matcher = backend.new_matcher(pending, reasoning=False)
    logits = torch.zeros(1, backend.vocab_size)
    mask = allocate_vocab_mask(1, backend.vocab_size)
    fill, apply, accept = [], [], []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill_vocab_mask(mask, 0)
        t1 = time.perf_counter()
        apply_vocab_mask(logits, mask)
        t2 = time.perf_counter()
        assert matcher.accept_token(token), (backend.name, token)
        t3 = time.perf_counter()
        fill.append((t1 - t0) * 1e6)
        apply.append((t2 - t1) * 1e6)
        accept.append((t3 - t2) * 1e6)
    return fill, apply, accept


def mask_overhead_us(
    engine: Engine, outputs: list[list[int]], schemas: list[dict]
) -> dict[str, float]:
    """Per-token microseconds of fill, accept and apply, replaying the constrained outputs
    with the library that served them."""
    backend = engine.scheduler.grammar_backend
    assert backend is not None, "the embedded model has a tokenizer"
    fill: list[float] = []
    apply: list[float] = []
    accept: list[float] = []
    for ids, schema in zip(outputs, schemas):
        times = replay_us(backend, "json_schema", json.dumps(schema), ids)
        for total, part in zip((fill, apply, accept), times):
            total.extend(part)
    return {
        "tokens": len(fill),
        "fill": statistics.mean(fill),
        "apply": statistics.mean(apply),
        "accept": statistics.mean(accept),
    }


LENGTH_BOUNDS = (64, 1024, 32767)
BODY = "The quick brown fox jumps over the lazy dog, and then it runs away. " * 40
LIBRARIES = ("xgrammar", "llguidance")


def bounded_schema(max_length: int | None) -> dict:
    string: dict = {"type": "string"}
    if max_length is not None:
        string.update(minLength=50, maxLength=max_length)
    return {"type": "object", "properties": {"a": string}, "required": ["a"]}


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def length_bound_masks(dtype: str) -> None:
    """Mask time per token in a length-bounded string with each library (xgrammar with
    radixserve's strict JSON strings); then one request's end-to-end time with and
    without the bounds, per library."""
    engines = {
        library: Engine(
            dtype=dtype,
            max_total_tokens=4096,
            disable_overlap_schedule=True,
            grammar_backend=library,
        )
        for library in LIBRARIES
    }
    columns = ["maxLength", "library", "compile ms", "tokens in the string"]
    print("| " + " | ".join([*columns, "mask ms, first 10", "last 10", "p99"]) + " |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for max_length in LENGTH_BOUNDS:
        for library, engine in engines.items():
            backend = engine.scheduler.grammar_backend
            assert backend is not None, "the embedded model has a tokenizer"
            ids = backend.tokenizer.encode('{"a": "' + BODY, add_special_tokens=False)[:44]
            while len(backend.tokenizer.decode(ids[4:])) > max_length:
                ids = ids[:-1]  # '{"a": "' is 4 tokens, then up to 40 inside the string
            source = json.dumps(bounded_schema(max_length))
            start = time.perf_counter()
            backend.submit("json_schema", source).future.result()
            compile_ms = (time.perf_counter() - start) * 1e3
            fill, _, _ = replay_us(backend, "json_schema", source, ids)
            first, last = (statistics.mean(t) / 1e3 for t in (fill[4:14], fill[-10:]))
            print(
                f"| {max_length} | {library} | {compile_ms:.0f} | {len(ids) - 4} | "
                f"{first:.3f} | {last:.3f} | {p99(fill) / 1e3:.3f} |"
            )
    print("\n| schema | library | output tokens | seconds |")
    print("|---|---|---:|---:|")
    for bound in (32767, None):
        for library, engine in engines.items():
            params = {"temperature": 0, "max_new_tokens": 40, "json_schema": bounded_schema(bound)}
            engine.generate("Write a long sentence as JSON.", params)  # compile and warm up
            start = time.perf_counter()
            result = engine.generate("Write a long sentence as JSON.", params)[0]
            label = "no bounds" if bound is None else f"minLength 50, maxLength {bound}"
            seconds = time.perf_counter() - start
            print(f"| {label} | {library} | {len(result.output_ids)} | {seconds:.2f} |")
    for engine in engines.values():
        engine.shutdown()


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "unit"],
            },
        },
    }
    for name in ("get_weather", "get_forecast", "get_air_quality")
]
ENUM_VALUES = [f"value-{i:04d}" for i in range(2000)]


def mask_table_rows() -> dict[str, tuple[dict, str]]:
    """Each row's schema and a text it matches, replayed token by token."""
    from services.tokenizer.parsers import required_tools_schema, tool_specs

    ordinary = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
    }
    rows = {
        "ordinary schema": (ordinary, '{"name": "Ada Lovelace", "age": 36, "tags": ["math"]}'),
        "large enum (2,000 values)": ({"enum": ENUM_VALUES}, '"value-1777"'),
        "tool call (3 tools, tool_choice required)": (
            required_tools_schema(tool_specs(WEATHER_TOOLS), parallel_tool_calls=True),
            '[{"name": "get_forecast", "parameters": {"city": "Paris", "unit": "celsius", '
            '"days": 3}}]',
        ),
    }
    for max_length in LENGTH_BOUNDS:
        body = BODY[: min(max_length, 160)]
        rows[f"maxLength {max_length}"] = (bounded_schema(max_length), f'{{"a": "{body}"}}')
    return rows


def mask_table() -> None:
    """Mask time per token, mean and p99, for each row under xgrammar, llguidance and
    auto's choice: the fill of the bitmask only (what a step waits for)."""
    from engine.model.tokenizer_cache import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    vocab = len(tokenizer)
    backends = {
        name: GrammarBackend(tokenizer, vocab, backend=name, stop_token_ids=[2])
        for name in (*LIBRARIES, "auto")
    }
    print("| grammar | tokens | xgrammar mean / p99 ms | llguidance mean / p99 ms | auto |")
    print("|---|---:|---:|---:|---|")
    for name, (schema, text) in mask_table_rows().items():
        source = json.dumps(schema)
        ids = tokenizer.encode(text, add_special_tokens=False)
        cells = {}
        for library, backend in backends.items():
            fill = [us / 1e3 for us in replay_us(backend, "json_schema", source, ids)[0]]
            cells[library] = (statistics.mean(fill), p99(fill))
        chosen = backends["auto"].library_for("json_schema", source)
        mean, worst = cells["auto"]
        print(
            f"| {name} | {len(ids)} | "
            + " | ".join(f"{cells[lib][0]:.3f} / {cells[lib][1]:.3f}" for lib in LIBRARIES)
            + f" | {chosen}: p99 {worst:.3f} |"
        )
    for backend in backends.values():
        backend.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--length-bounds", action="store_true", help="mask cost in length-bounded strings"
    )
    parser.add_argument("--base", help="with --length-bounds: also measure this checkout, first")
    parser.add_argument(
        "--mask-table",
        action="store_true",
        help="mask time per token per library: ordinary schema, length bounds, enum, tool call",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured passes per row (after one warm-up)"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="overlap loop (default: the normal loop)"
    )
    args = parser.parse_args()
    if args.mask_table:
        mask_table()
    elif args.length_bounds:
        if args.base:
            print(f"## before: {args.base}", flush=True)
            env = {**os.environ, "PYTHONPATH": os.path.abspath(args.base)}
            command = [sys.executable, os.path.abspath(__file__), "--length-bounds"]
            subprocess.run([*command, "--dtype", args.dtype], env=env, check=True)
            print("\n## after: this checkout", flush=True)
        length_bound_masks(args.dtype)
    else:
        compare_modes(args)


def compare_modes(args: argparse.Namespace) -> None:
    """The main table: unconstrained, json_schema and jump-forward, in a batch and one by
    one; then whether jump-forward changed any output, and the grammar's cost per token."""
    names = list(SCHEMAS)
    prompts = [SCHEMAS[n][0] for n in names]
    schemas = [SCHEMAS[n][1] for n in names]
    grammar_params = [
        {"temperature": 0, "max_new_tokens": args.max_new_tokens, "json_schema": s} for s in schemas
    ]
    engines = {
        mode: Engine(
            dtype=args.dtype,
            max_total_tokens=16384,
            disable_overlap_schedule=not args.overlap,
            **opts,
        )
        for mode, opts in MODES.items()
    }
    # The constrained lengths fix how much the unconstrained row decodes.
    reference = run(engines["json_schema"], prompts, grammar_params, one_by_one=False).results
    lengths = [len(r.output_ids) for r in reference]
    params = {
        mode: grammar_params
        if mode != "unconstrained"
        else [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
        for mode in MODES
    }
    for mode, engine in engines.items():
        run(engine, prompts, params[mode], one_by_one=False)  # warm-up

    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; embedded SmolLM2-135M-Instruct in {args.dtype}; "
        f"{'overlap' if args.overlap else 'normal'} loop"
    )
    print(
        f"workload: {len(names)} JSON schemas, greedy, max_new_tokens {args.max_new_tokens}; "
        f"{sum(lengths)} output tokens in the constrained run; median of {args.repeats} passes\n"
    )
    print(
        "| rows | mode | seconds | output tok/s | forward passes | jump-forward tokens "
        "| valid JSON |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for one_by_one in (False, True):
        print_rows(engines, prompts, params, args.repeats, one_by_one)
    same = sum(
        _parsed(a.text) == _parsed(b.text)
        for a, b in zip(
            run(engines["json_schema"], prompts, grammar_params, False).results,
            run(engines["json_schema + jump-forward"], prompts, grammar_params, False).results,
        )
    )
    print(f"\nidentical parsed outputs with and without jump-forward: {same} of {len(names)}")
    cost = mask_overhead_us(engines["json_schema"], [r.output_ids for r in reference], schemas)
    print(
        f"grammar cost per token over {cost['tokens']} replayed tokens: "
        f"fill {cost['fill']:.1f} µs, "
        f"apply {cost['apply']:.1f} µs, accept {cost['accept']:.1f} µs"
    )
    for engine in engines.values():
        engine.shutdown()


def print_rows(
    engines: dict[str, Engine],
    prompts: list[str],
    params: Mapping[str, list[dict]],
    repeats: int,
    one_by_one: bool,
) -> None:
    """One table row per mode: the median of `repeats` passes, the modes in alternation."""
    measured: dict[str, list[Pass]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, engine in engines.items():
            measured[mode].append(run(engine, prompts, params[mode], one_by_one))
    for mode in MODES:
        seconds = statistics.median(p.seconds for p in measured[mode])
        last = measured[mode][-1]
        tokens = sum(len(r.output_ids) for r in last.results)
        valid = "—" if mode == "unconstrained" else sum(_parses(r.text) for r in last.results)
        print(
            f"| {'one by one' if one_by_one else 'batch'} | {mode} | {seconds:.2f} | "
            f"{tokens / seconds:.0f} | "
            f"{last.forward_passes} | {last.jump_forward_tokens} | {valid} |"
        )


def _parsed(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _parses(text: str) -> bool:
    return _parsed(text) is not None


if __name__ == "__main__":
    main()
