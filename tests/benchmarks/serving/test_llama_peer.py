"""The llama-server peer's command line, without the binary (the comparison runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving.llama_peer import LlamaServer


def test_a_missing_binary_says_how_to_build_one(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="build-llama-server.sh"):
        LlamaServer(tmp_path / "llama-server")


def test_it_serves_the_embedded_gguf_on_loopback_without_repacking(tmp_path: Path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    argv = LlamaServer(binary).argv
    assert argv[argv.index("-m") + 1].endswith(".gguf")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--no-repack" in argv and argv[argv.index("-np") + 1] == "16"
