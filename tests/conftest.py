"""Suite-wide settings: the hypothesis profile and the rule for missing tools."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it decorates a kernel, and transformers imports
# triton.language early: without a GPU, the Triton kernels run under the interpreter only if
# this is set before anything imports Triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

IN_CI = bool(os.environ.get("CI"))

settings.register_profile(
    "radixserve",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("radixserve")


def _require_tool(available: bool, what: str) -> None:
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing in CI; .ci/run must install it")
    pytest.skip(f"{what} is not installed")


@pytest.fixture
def require_tool():
    """`require_tool(available, what)`: skip a test whose tool is missing on a developer
    machine, fail it in CI, where `.ci/run` installs every tool and a skip would hide a
    broken install."""
    return _require_tool
