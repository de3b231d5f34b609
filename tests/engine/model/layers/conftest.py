"""The two CPU paths of a layer: torch ops, or the C++ kernels (`engine.kernels.cpu.build`)."""

from __future__ import annotations

import pytest

from engine.kernels.cpu import build as cpu_build


@pytest.fixture(params=["torch-ops", "kernel"])
def path(request, monkeypatch) -> str:
    """Runs a test once with the kernels switched off and once with them on."""
    if request.param == "torch-ops":
        monkeypatch.setattr(cpu_build, "enabled", lambda: False)
    else:
        assert cpu_build.enabled()
    return str(request.param)
