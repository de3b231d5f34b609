"""`benchmarks/graph_bench.py` is what a lent GPU runs (`gpu_checks.sh graph-bench`), where a
broken script costs scarce device minutes. Its CPU smoke runs the same code with graphs
"replayed" by calling the captured step again, through the real graph runner's static
buffers and padding: the plumbing works and greedy tokens from the graph path equal eager."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cpu_smoke_times_both_paths_and_graph_tokens_equal_eager(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "graph_bench.json"
    cmd = [sys.executable, "-m", "benchmarks.graph_bench", "--device", "cpu", "--smoke"]
    cmd += ["--model", str(tiny_llama_dir), "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert result["greedy_equal"] is True
    assert set(result["steps"]) == {"3", "6"}  # buckets 1, 2, 4, 6: batch 3 is padded to 4
    for step in result["steps"].values():
        assert step["eager"] > 0 and step["graph"] > 0
    assert result["launch_us"]["eager"] > 0
