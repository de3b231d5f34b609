"""SGLang's gateway (`smg launch`, PyPI `smg`) in front of the fleet, as users run it:
HTTP workers given by URL, one routing policy.

In `cache_aware` mode smg keeps its own approximate radix tree of the text it routed to
each worker and sends a request to the worker whose tree matches the longest share of it
(at least `--cache-threshold`), else to the one with the smallest tree; past a load
imbalance it falls back to the least loaded worker. `round_robin` ignores content.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx2

from testing.net import free_ports, wait_until

POLICIES = ("cache_aware", "round_robin")
STOP_TIMEOUT_S = 10.0


def smg_binary() -> str:
    """The `smg` beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "smg"
    if beside.exists():
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise RuntimeError("smg is not installed: pip install smg==1.13.0 (the test extra)")
    return found


def registered_workers(base_url: str) -> dict[str, bool]:
    """url -> healthy, from smg's /workers ({} while it does not answer)."""
    try:
        response = httpx2.get(f"{base_url}/workers", timeout=5.0, trust_env=False)
    except httpx2.TransportError:
        return {}
    if response.status_code != 200:
        return {}
    return {w["url"]: bool(w.get("is_healthy")) for w in response.json().get("workers", [])}


@contextmanager
def smg_gateway(
    worker_urls: Sequence[str],
    policy: str,
    log_path: Path,
    extra_flags: Sequence[str] = (),
    timeout: float = 60.0,
) -> Iterator[str]:
    """`smg launch` routing to `worker_urls` by `policy`; yields its base URL once every
    worker is registered and healthy (smg probes each one's /health before it routes to
    it), and stops it after."""
    port, prometheus_port = free_ports(2)
    argv = [
        smg_binary(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--log-level",
        "warn",
        # Stopped only once every request came back: nothing to drain, and the default
        # grace costs 5 s per start.
        "--shutdown-grace-period-secs",
        "0",
        *extra_flags,
    ]
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"smg exited ({proc.returncode}); log in {log_path}"
            workers = registered_workers(base_url)
            return all(workers.get(url, False) for url in worker_urls)

        wait_until(ready, timeout, f"smg at {base_url} to register {len(worker_urls)} workers")
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
