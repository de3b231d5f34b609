"""A service started alone (`python -m services.<role>`) refuses a model it cannot serve as
`radixserve serve` does: one line on stderr naming the file, no traceback, status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testing.launcher import REPO_ROOT, ROLES


@pytest.mark.parametrize("role", ROLES)
def test_a_service_started_alone_refuses_a_missing_model_in_one_line(role: str, tmp_path: Path):
    missing = tmp_path / "no-such-model.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", f"services.{role}", "--ipc-dir", str(tmp_path)]
        + ["--model-path", str(missing)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"python -m services.{role}: error: model '{missing}' does not exist (a model is a "
        "Hugging Face directory, a .gguf file, a Hub repo id, 'embedded' or 'gemma3-270m')"
    ]
