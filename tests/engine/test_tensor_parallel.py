"""The offline Engine at tp_size=2 (two real processes over gloo) decides and generates as
at tp_size=1: radix reuse, chunked prefill, retraction under a tiny KV pool, seeded
sampling and a JSON schema, under the normal and the overlap loop in float32 and the normal
loop in float64. Every turn a follower
also checks its scheduler's numbers against rank 0's, so a rank out of step would fail
these runs, not just differ."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.api import Engine
from engine.args import EngineArgs
from engine.distributed import TPGroup
from engine.distributed.tp_ranks import rank_device
from engine.sched.tp_sync import InputSync
from services.launch import serve
from services.settings import Settings

OPTIONS: dict[str, Any] = dict(
    dtype="float32", device="cpu", max_total_tokens=320, chunked_prefill_size=32
)
"""A KV pool small enough that the retraction case overcommits it; chunks of 32 tokens."""
GREEDY = {"temperature": 0, "ignore_eos": True}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5000) for _ in range(length)]


SHARED = prompt(0, 40)
CASES: dict[str, tuple[list[list[int]], dict[str, Any]]] = {
    "radix_reuse": (
        [SHARED + prompt(1, 5), SHARED + prompt(2, 7)],
        {**GREEDY, "max_new_tokens": 6},
    ),
    "chunked_prefill": ([prompt(3, 100)], {**GREEDY, "max_new_tokens": 6}),
    "retraction": (
        [prompt(10 + i, 20) for i in range(5)],
        {**GREEDY, "max_new_tokens": 50},
    ),
    "seeded_sampling": (
        [prompt(4, 12), prompt(5, 9)],
        {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_new_tokens": 8, "ignore_eos": True},
    ),
    "json_schema": (
        [prompt(6, 10)],
        {"temperature": 0, "max_new_tokens": 16, "json_schema": SCHEMA},
    ),
    "bad_grammar": ([prompt(7, 10)], {"max_new_tokens": 4, "regex": "(unclosed"}),
}


def run_cases(engine: Engine) -> dict[str, Any]:
    """Each case's output ids and finish reasons (radix reuse: the first prompt once alone,
    so that the second batch hits the tree), then the scheduler's counters."""
    engine.generate(CASES["radix_reuse"][0][0], CASES["radix_reuse"][1])
    results: dict[str, Any] = {}
    for name, (prompts, params) in CASES.items():
        out = engine.generate(prompts, params)
        results[name] = [(r.output_ids, r.meta.finish_reason, r.meta.cached_tokens) for r in out]
    results["stats"] = engine.scheduler.stats.counters()
    cache = engine.scheduler.cache_manager
    cache.check_integrity()  # every KV slot accounted for once, the tree's ledgers right
    free = cache.allocator.available_size() + cache.tree_cache.evictable_size()
    results["kv_whole"] = free == engine.scheduler.max_total_tokens
    return results


@pytest.fixture(scope="module")
def tp1(tiny_llama_dir: Path) -> Callable[[str], dict[str, Any]]:
    """The cases' results at tp_size=1 in a dtype, each computed once."""
    results: dict[str, dict[str, Any]] = {}

    def of(dtype: str) -> dict[str, Any]:
        if dtype not in results:
            with Engine(str(tiny_llama_dir), **{**OPTIONS, "dtype": dtype}) as engine:
                results[dtype] = run_cases(engine)
        return results[dtype]

    return of


@pytest.fixture(
    scope="module",
    params=[("normal", "float32"), ("overlap", "float32"), ("normal", "float64")],
    ids=lambda param: "-".join(param),
)
def tp2(
    request: pytest.FixtureRequest,
    tiny_llama_dir: Path,
    tp1: Callable[[str], dict[str, Any]],
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(tp_size=1's results, tp_size=2's) for one loop and dtype; tp_size=1 runs first: one
    group per process at a time."""
    loop, dtype = request.param
    reference = tp1(dtype)
    overlap = loop == "overlap"
    options = {**OPTIONS, "dtype": dtype}
    with Engine(
        str(tiny_llama_dir), tp_size=2, disable_overlap_schedule=not overlap, **options
    ) as engine:
        assert engine.scheduler.overlap == overlap and engine.scheduler.tp_group.size == 2
        yield reference, run_cases(engine)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_generates_what_tp1_does(case: str, tp2: tuple[dict[str, Any], dict[str, Any]]):
    reference, results = tp2
    assert results[case] == reference[case]


@pytest.mark.timeout(180)
def test_the_cases_exercise_what_they_name(tp2: tuple[dict[str, Any], dict[str, Any]]):
    for results in tp2:
        assert results["radix_reuse"][1][2] >= len(SHARED)  # the shared prefix was a hit
        assert results["stats"]["num_retractions"] > 0
        assert results["json_schema"][0][1].type in ("stop", "length")
        assert results["bad_grammar"][0][1].status_code == 400
        assert results["kv_whole"]
    # The overlap loop builds a few more decode batches; every other counter agrees.
    counters = [{k: v for k, v in r["stats"].items() if k != "forward_modes"} for r in tp2]
    assert counters[0] == counters[1]


def test_a_follower_out_of_step_stops_naming_what_differs():
    sync = InputSync(TPGroup(rank=1, size=2))  # a follower's side: no keep-alive thread
    with pytest.raises(RuntimeError, match=r"rank 1 is out of step with rank 0.*free_kv \(8, 7\)"):
        sync.check_in_step({"free_kv": 8, "waiting": 1}, {"free_kv": 7, "waiting": 1})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(tp_size=0), "tp_size must be >= 1"),
        (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), r"multiple of nnodes \(2\)"),
        (dict(tp_size=2, nnodes=2), "nnodes > 1 needs dist_init_addr"),
        (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank must be in"),
        (dict(tp_size=2, dist_init_addr="nohost"), "dist_init_addr must be host:port"),
        (dict(tp_size=2, dist_init_timeout=0), "dist_init_timeout must be > 0 seconds"),
    ],
)
def test_a_bad_rank_layout_is_refused_before_anything_starts(options: dict, message: str):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


def test_a_bad_tp_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        Settings.from_cli(["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], env={})
    assert exited.value.code == 2
    assert "tp_size (3) must be a multiple of nnodes (2)" in capsys.readouterr().err


def test_more_ranks_per_node_than_gpus_is_refused():
    args = EngineArgs(tp_size=16, device="cuda")
    with pytest.raises(ValueError, match=r"runs 16 ranks on each, one per GPU, but this node sees"):
        rank_device(args, 0)


def test_the_engine_runs_rank_0_only():
    with pytest.raises(ValueError, match="node_rank > 0 runs worker ranks only"):
        Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


@pytest.mark.timeout(60)
def test_one_tensor_parallel_engine_a_process(
    tiny_llama_dir: Path, tp2: tuple[dict[str, Any], dict[str, Any]]
):
    """While the tp2 engine runs, a second one is refused before it spawns anything."""
    with pytest.raises(RuntimeError, match="already holds a tensor-parallel engine"):
        Engine(str(tiny_llama_dir), tp_size=2, **OPTIONS)


def test_radixserve_serve_runs_node_0_only(capsys: pytest.CaptureFixture[str]):
    argv = ["--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:1"]
    assert serve(argv) == 2
    assert "on node K > 0 run `python -m services.worker --node-rank K`" in capsys.readouterr().err
