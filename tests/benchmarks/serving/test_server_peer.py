"""radixserve as a peer, end to end on the services' tiny model: it starts on free ports,
the client's counts agree with what the server did, and a flush empties the radix tree
between cells."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.serving import client
from benchmarks.serving.server_peer import RadixServer
from benchmarks.serving.workloads import BenchRequest
from testing.launcher import cpu_flags

SHARED = list(range(1000, 1064))


def run(server: RadixServer, requests: list[BenchRequest]) -> client.RunResult:
    return asyncio.run(
        client.run(
            server.base_url,
            requests,
            [r.prompt for r in requests],
            concurrency=1,
            metrics_urls=server.metrics_urls,
        )
    )


def test_the_client_measures_radixserve_and_a_flush_starts_the_next_cell_cold(
    tiny_llama_dir: Path, tmp_path: Path
):
    requests = [BenchRequest(SHARED + [2000 + i] * 4, 6) for i in range(3)]
    flags = cpu_flags(4096, tiny_llama_dir)
    with RadixServer(flags, log_dir=tmp_path) as server:
        first = run(server, requests)
        assert [r.error for r in first.results] == [None] * 3, server.log_tail()
        assert [r.output_len for r in first.results] == [6] * 3  # ignore_eos honoured
        assert [r.prompt_len for r in first.results] == [68] * 3
        cached = [r.cached_tokens for r in first.results]
        assert cached[0] == 0 and all(c >= 64 for c in cached[1:])
        assert all(r.ttft is not None and r.ttft <= r.latency for r in first.results)
        server.flush_cache()
        assert run(server, requests).results[0].cached_tokens == 0
    assert server.proc is not None and server.proc.poll() is not None


def test_a_forced_kernel_path_reaches_the_server_and_its_kernel_reads_what_it_runs_as(
    tiny_llama_dir: Path, tmp_path: Path
):
    from engine.kernels.cpu.isa import PATHS, machine_path, read_flags

    if PATHS.index(machine_path(read_flags())) < PATHS.index("avx2"):
        pytest.skip("this CPU has no AVX2 kernel path to force")
    env = {"RADIXSERVE_CPU_ISA": "avx2"}
    with RadixServer(cpu_flags(4096, tiny_llama_dir), log_dir=tmp_path, env=env) as server:
        kernel = server.kernel()
    assert kernel["cpu_isa"] == "avx2", server.log_tail()
    assert kernel["dtype"] == kernel["dtype_setting"] == "float32"
    assert "avx2" in kernel["cpu_flags"] and kernel["weights"]
