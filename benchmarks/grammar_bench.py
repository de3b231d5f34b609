"""JSON-schema decoding on the offline Engine: unconstrained vs constrained vs jump-forward,
and the grammar's cost per token, side by side in one run.

Workload: the 20 schemas of benchmarks/support/grammar_schemas.py with their prompts, greedy. Rows:
- "batch": all 20 submitted at once (throughput);
- "one by one": each request alone (latency; forward passes per request are what
  jump-forward saves).
The unconstrained row generates, per prompt, as many tokens as the constrained run did
(ignore_eos), so both decode the same amount. Each configuration lives in its own Engine,
warmed up with one batch first; the rows are measured in alternation.

Mask overhead per token: every constrained output is replayed through a fresh matcher,
timing the bitmask fill, the token accept, and applying the bitmask to a logits row.

Run from the repository root: .venv/bin/python -m benchmarks.grammar_bench [--dtype bfloat16]
Results are recorded in docs/benchmarks/grammar.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import NamedTuple

import torch
import xgrammar as xgr

from benchmarks.support.grammar_schemas import SCHEMAS
from engine.api import Engine
from engine.outputs import GenerateResult

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


def mask_overhead_us(
    engine: Engine, outputs: list[list[int]], schemas: list[dict]
) -> dict[str, float]:
    """Per-token microseconds of fill, accept and apply, replaying the constrained outputs."""
    backend = engine.scheduler.grammar_backend
    vocab = backend.vocab_size
    logits = torch.zeros(1, vocab)
    mask = xgr.allocate_token_bitmask(1, vocab)
    fill = accept = apply = 0.0
    tokens = 0
    for ids, schema in zip(outputs, schemas):
        compiled = backend.submit("json_schema", json.dumps(schema)).future.result()
        matcher = xgr.GrammarMatcher(compiled)
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, mask)
            t2 = time.perf_counter()
            matcher.accept_token(token)
            t3 = time.perf_counter()
            fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
            tokens += 1
    scale = 1e6 / tokens
    return {
        "tokens": tokens,
        "fill": fill * scale,
        "apply": apply * scale,
        "accept": accept * scale,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--repeats", type=int, default=2, help="measured passes per row (after one warm-up)"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="overlap loop (default: the normal loop)"
    )
    args = parser.parse_args()

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
        measured: dict[str, list[Pass]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
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


def _parsed(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _parses(text: str) -> bool:
    return _parsed(text) is not None


if __name__ == "__main__":
    main()
