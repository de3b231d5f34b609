"""Suite-wide settings: Triton's interpreter on machines without a GPU, and the hypothesis profile."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it decorates a kernel, and transformers imports
# triton.language early: without a GPU, the Triton kernels run under the interpreter only if
# this is set before anything imports Triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "radixserve",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("radixserve")
