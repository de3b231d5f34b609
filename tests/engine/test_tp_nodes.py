"""Two nodes of one tensor-parallel rank each, on one machine: node 1 is `python -m
services.worker --node-rank 1` (ranks only, no sockets), node 0 the offline Engine. They
generate what tp_size=1 does, and rank 0's shutdown stops node 1 cleanly; without node 1,
node 0 fails its start naming rank 1 once the start-up timeout has passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import Engine
from engine.distributed import get_tp_group
from testing.launcher import REPO_ROOT
from testing.net import free_port

OPTIONS = dict(dtype="float32", device="cpu", max_total_tokens=512, chunked_prefill_size=16)
PROMPTS = [list(range(100, 140)), list(range(7, 12))]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.mark.timeout(180)
def test_two_nodes_of_one_rank_each_generate_what_tp1_does(tiny_llama_dir: Path):
    with Engine(str(tiny_llama_dir), **OPTIONS) as engine:
        expected = [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]
    layout = dict(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**OPTIONS, **layout}.items()]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "services.worker", f"--model={tiny_llama_dir}", *flags]
        + ["--node-rank=1"],
        cwd=REPO_ROOT,
    )
    try:
        with Engine(str(tiny_llama_dir), **OPTIONS, **layout) as engine:
            assert engine.core.ranks is not None and not engine.core.ranks.procs  # one rank a node
            assert [r.output_ids for r in engine.generate(PROMPTS, GREEDY)] == expected
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_an_engine_whose_other_node_never_joins_fails_the_start_naming_the_rank(
    tiny_llama_dir: Path,
):
    layout = dict(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}")
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) 1 of 2 did not join .* timeout of 1 s \(dist_init_timeout\)"
    ):
        Engine(str(tiny_llama_dir), dist_init_timeout=1, **OPTIONS, **layout)
    assert get_tp_group().size == 1
