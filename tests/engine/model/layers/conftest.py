"""The two CPU paths of a layer: torch ops, or the C++ kernels (`engine.model.cpu_kernels`)."""

from __future__ import annotations

import pytest

from engine.model import cpu_kernels


@pytest.fixture(params=["torch-ops", "kernel"])
def path(request, monkeypatch) -> str:
    """Runs a test once with the kernels switched off and once with them on."""
    if request.param == "torch-ops":
        monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)
    else:
        assert cpu_kernels.enabled()
    return str(request.param)
