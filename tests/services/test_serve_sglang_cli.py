"""`radixserve serve` with SGLang's command line, on real processes: `--model-path` and
`--lora-paths a=<dir> b=<dir>` serve; a missing model, a missing adapter directory, an
unreadable GGUF file and an unsupported GGUF architecture are refused in one line on
stderr, with no traceback, before any process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.model.embedded import embedded_model_path
from testing.launcher import REPO_ROOT, cpu_flags, serving
from testing.lora import make_adapter

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.timeout(240)
def test_model_path_serves_the_embedded_gguf(tmp_path: Path):
    gguf_file = embedded_model_path()
    flags = cpu_flags(4096)
    with serving(["--model-path", str(gguf_file), *flags], tmp_path / "serve.log") as client:
        answer = client.chat.completions.create(
            model=str(gguf_file), messages=MESSAGES, max_tokens=16, temperature=0
        )
    assert "Paris" in answer.choices[0].message.content


@pytest.mark.timeout(240)
def test_lora_paths_as_several_values_serve_each_adapter(tiny_llama_dir: Path, tmp_path: Path):
    a = make_adapter(tiny_llama_dir, tmp_path / "a", rank=4, seed=1, targets=["q_proj"])
    b = make_adapter(tiny_llama_dir, tmp_path / "b", rank=8, seed=2, targets=["o_proj"])
    flags = [
        "--model-path",
        str(tiny_llama_dir),
        *cpu_flags(4096),
        "--lora-paths",
        f"a={a}",
        f"b={b}",
    ]
    with serving(flags, tmp_path / "serve.log") as client:
        models = {m.id for m in client.models.list()}
        texts = {
            name: client.completions.create(
                model=name, prompt="The quick brown fox", max_tokens=8, temperature=0
            )
            .choices[0]
            .text
            for name in (str(tiny_llama_dir), "a", "b")
        }
    assert {"a", "b"} <= models
    assert len(set(texts.values())) == 3  # each adapter changes the base model's answer


def write_gguf(path: Path, architecture: str) -> Path:
    """A GGUF file that declares `architecture`, with one tensor and a few keys."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refusal(flags: list[str]) -> str:
    """The stderr of `radixserve serve <flags>`, which must exit non-zero on its own."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.launch", "serve", *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "radixserve: started" not in proc.stdout  # no process was started
    return proc.stderr


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--model-path", "{tmp}/no-such-model.gguf"],
            "radixserve serve: error: model '{tmp}/no-such-model.gguf' does not exist "
            "(a model is a Hugging Face directory, a .gguf file, a Hub repo id, 'embedded' or "
            "'gemma3-270m')",
        ),
        (
            ["--model-path", "{tmp}/mamba.gguf"],
            "radixserve serve: error: {tmp}/mamba.gguf: GGUF architecture 'mamba' is not "
            "supported (supported: llama, qwen2, qwen3, gemma3)",
        ),
        (
            ["--model-path", "{tmp}/falcon.gguf"],
            "radixserve serve: error: {tmp}/falcon.gguf: GGUF architecture 'falcon' is not "
            "supported (supported: llama, qwen2, qwen3, gemma3)",
        ),
        (
            ["--model-path", "{tmp}/text.gguf"],
            "radixserve serve: error: {tmp}/text.gguf is not a readable GGUF file (GGUF magic "
            "invalid); supported: GGUF files of the architectures llama, qwen2, qwen3, gemma3",
        ),
        (
            ["--lora-paths", "a={tmp}", "b={tmp}/no-such-adapter"],
            "radixserve serve: error: LoRA adapter a={tmp}: no adapter_config.json in it (an "
            "adapter is a PEFT directory of adapter_config.json and adapter_model.safetensors)",
        ),
        (
            ["--lora-paths", "b={tmp}/no-such-adapter"],
            "radixserve serve: error: LoRA adapter b={tmp}/no-such-adapter: no such directory "
            "(an adapter is a PEFT directory of adapter_config.json and "
            "adapter_model.safetensors)",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(flags: list[str], line: str, tmp_path):
    write_gguf(tmp_path / "mamba.gguf", "mamba")
    write_gguf(tmp_path / "falcon.gguf", "falcon")
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    stderr = refusal([flag.format(tmp=tmp_path) for flag in flags])
    assert stderr.splitlines() == [line.format(tmp=tmp_path)]


def test_debug_logging_shows_the_refusals_traceback(tmp_path: Path):
    gguf_file = write_gguf(tmp_path / "mamba.gguf", "mamba")
    stderr = refusal(["--model-path", str(gguf_file), "--log-level", "debug"])
    assert "Traceback" in stderr
    assert stderr.splitlines()[-1].startswith("radixserve serve: error: ")
