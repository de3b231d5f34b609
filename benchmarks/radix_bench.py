"""Radix cache micro-benchmarks (CPU only, no model).

1. Longest-prefix match of two sequences sharing a 10,000-token prefix: the per-token
   Python loop of SGLang's first release against galloping + bisection, on list slices
   and on int64 memoryviews (what `RadixKey` stores). Comparison counts and wall time.
2. Insert, match and evict throughput on a tree of about 100,000 nodes.

Run: .venv/bin/python -m benchmarks.radix_bench [--nodes 100000] [--seed 0]
Results are recorded in docs/benchmarks/radix.md.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections.abc import Callable, Sequence

import torch

from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey, common_prefix_len
from testing.radix import simulated_cache, total_size


def per_token_match(a: Sequence[int], b: Sequence[int]) -> int:
    """The first release's `match`: one Python comparison per token."""
    i = 0
    for x, y in zip(a, b):
        if x != y:
            break
        i += 1
    return i


def best_time(fn: Callable[[], object], repeat: int = 7, number: int = 50) -> float:
    """Best mean seconds per call over `repeat` rounds of `number` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def bench_match(shared: int) -> list[tuple[str, int, float]]:
    a_list = list(range(shared)) + [1] * shared
    b_list = list(range(shared)) + [2] * shared
    a_key, b_key = RadixKey(a_list), RadixKey(b_list)
    rows = []
    for name, fn in [
        ("per-token loop (list)", lambda: per_token_match(a_list, b_list)),
        ("galloping (list slices)", lambda: common_prefix_len(a_list, b_list)),
        (
            "galloping (memoryview, RadixKey)",
            lambda: common_prefix_len(a_key.token_ids, b_key.token_ids),
        ),
    ]:
        result = fn()
        length, comparisons = (result, result + 1) if isinstance(result, int) else result
        assert length == shared
        rows.append((name, comparisons, best_time(fn)))
    return rows


def bench_tree(num_nodes: int, seed: int) -> list[tuple[str, int, float]]:
    """Requests = one of 1,000 shared 64-token system prompts + a 16-token unique suffix:
    each insert adds a leaf under a prompt node, so the tree grows to ~num_nodes nodes."""
    rng = random.Random(seed)
    vocab = 32_000
    prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(1_000)]
    requests = [
        rng.choice(prompts) + [rng.randrange(vocab) for _ in range(16)] for _ in range(num_nodes)
    ]
    keys = [RadixKey(r) for r in requests]
    slots_needed = len(prompts) * 64 + num_nodes * 16
    manager = simulated_cache(num_slots=slots_needed + 1, max_reqs=1, max_context_len=8)
    cache = manager.tree_cache
    assert isinstance(cache, RadixCache)

    rows = []
    start = time.perf_counter()
    for key in keys:
        value = manager.alloc_slots(len(key))
        manager.allocator.free(value[: cache.insert(key, value).prefix_len])
    elapsed = time.perf_counter() - start
    num_tree_nodes = sum(1 for _ in cache._nodes())
    rows.append((f"insert ({num_tree_nodes:,} nodes after)", len(keys), elapsed))

    queries = [
        keys[rng.randrange(len(keys))] if i % 2 else RadixKey(rng.choice(prompts) + [0] * 16)
        for i in range(20_000)
    ]
    start = time.perf_counter()
    for key in queries:
        cache.match_prefix(key)
    rows.append(
        (
            "match_prefix (half full hits, half prompt-only)",
            len(queries),
            time.perf_counter() - start,
        )
    )

    total = total_size(cache)
    start = time.perf_counter()
    calls = 0
    while cache.evict(1_000):
        calls += 1
    rows.append(
        (
            f"evict, nodes ({total:,} tokens, {calls:,} calls of 1,000 tokens)",
            num_tree_nodes,
            time.perf_counter() - start,
        )
    )
    manager.check_integrity()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared", type=int, default=10_000, help="shared prefix length for the match benchmark"
    )
    parser.add_argument("--nodes", type=int, default=100_000, help="inserts for the tree benchmark")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(
        f"machine: {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, torch {torch.__version__}\n"
    )
    print(f"## Longest-prefix match, {args.shared:,}-token shared prefix\n")
    print("| method | comparisons | µs per match | speed-up vs per-token loop |")
    print("|---|---:|---:|---:|")
    match_rows = bench_match(args.shared)
    baseline = match_rows[0][2]
    for name, comparisons, seconds in match_rows:
        print(f"| {name} | {comparisons:,} | {seconds * 1e6:,.1f} | {baseline / seconds:.1f}× |")

    print(f"\n## Tree operations, {args.nodes:,} inserts\n")
    print("| operation | ops | seconds | ops/s |")
    print("|---|---:|---:|---:|")
    for name, ops, seconds in bench_tree(args.nodes, args.seed):
        print(f"| {name} | {ops:,} | {seconds:.2f} | {ops / seconds:,.0f} |")


if __name__ == "__main__":
    main()
