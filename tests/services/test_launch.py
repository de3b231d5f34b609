import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from services.settings import ENV_PREFIX, LAUNCH_ID_HEADER, Settings
from testing.launcher import REPO_ROOT
from testing.net import free_port


def _radixserve() -> str:
    return shutil.which("radixserve") or str(Path(sys.executable).parent / "radixserve")


def test_console_script_reports_its_version_and_runs_the_radix_demo():
    script = _radixserve()
    assert subprocess.run(
        [script, "--version"], capture_output=True, text=True, check=True
    ).stdout.startswith("radixserve 0.1.0")
    demo = subprocess.run([script, "radix-demo"], capture_output=True, text=True, check=True).stdout
    assert "lock_ref=1" in demo and "protected: 5" in demo


def test_keys_makes_a_private_directory_that_every_role_can_load(tmp_path: Path):
    from services.ipc import WIRE_ROLES, WireKeys

    script = _radixserve()
    keys_dir = tmp_path / "wire" / "keys"
    out = subprocess.run(
        [script, "keys", str(keys_dir)], capture_output=True, text=True, check=True
    ).stdout
    assert str(keys_dir) in out
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    loaded = [WireKeys.load(keys_dir, role) for role in WIRE_ROLES]
    assert len({keys.secret for keys in loaded}) == len(WIRE_ROLES)
    # A rerun (an init container run again) keeps what running processes loaded; a role
    # whose files are gone gets new ones.
    (keys_dir / "worker.key_secret").unlink()
    subprocess.run([script, "keys", str(keys_dir)], capture_output=True, check=True)
    again = {role: WireKeys.load(keys_dir, role) for role in WIRE_ROLES}
    for before in loaded:
        if before.role == "worker":
            assert again["worker"].secret != before.secret
        else:
            assert again[before.role].secret == before.secret


# ----- starting next to another server ------------------------------------------------------


def _without_radixserve_settings() -> dict[str, str]:
    """This environment less any RADIXSERVE_* setting that would change what is tested."""
    return {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}


@pytest.mark.parametrize(
    ("flag", "host"),
    [
        ("--port", "0.0.0.0"),
        ("--worker-port", "127.0.0.1"),
        ("--detokenizer-metrics-port", "0.0.0.0"),
    ],
)
def test_a_taken_port_refuses_the_start_with_one_line_naming_the_port_and_its_flag(
    flag: str, host: str
):
    with socket.socket() as holder:  # another server's listening socket, on loopback only
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        flags = (
            [flag, str(port)] if flag == "--port" else ["--port", str(free_port()), flag, str(port)]
        )
        result = subprocess.run(
            [_radixserve(), "serve", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env=_without_radixserve_settings(),
        )
    assert result.returncode != 0
    assert result.stdout == ""  # nothing was started
    assert result.stderr.splitlines() == [
        f"radixserve serve: error: port {port} ({flag}) is already in use on {host}: "
        f"stop what holds it, or pick another {flag}"
    ]
    assert "://" not in result.stderr


def test_a_service_started_alone_without_zmq_addresses_exits_naming_the_flag():
    result = subprocess.run(
        [sys.executable, "-m", "services.detokenizer"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_without_radixserve_settings(),
    )
    assert result.returncode == 2
    assert "--worker-port is unset and so is --ipc-dir" in result.stderr


def test_the_settings_address_unset_zmq_ports_in_the_ipc_dir_and_set_ones_on_loopback():
    settings = Settings(ipc_dir="/run/rs", worker_port=41000)
    assert settings.zmq_address("worker_port") == "tcp://127.0.0.1:41000"
    assert settings.zmq_address("tokenizer_control_port") == "ipc:///run/rs/tokenizer_control"
    assert settings.zmq_role(41000) == "worker"
    assert settings.zmq_role("ipc:///run/rs/detokenizer") == "detokenizer"
    with pytest.raises(ValueError, match="too long for a Unix socket path"):
        Settings(ipc_dir="/" + "d" * 100)


# ----- a start a person can follow ----------------------------------------------------------


def test_a_first_start_on_this_cpu_says_the_kernels_compile_before_they_do(tmp_path: Path):
    code = (
        "import logging; logging.basicConfig(level='INFO'); "
        "from engine.kernels.cpu import build; print(build.available())"
    )
    # A cold cache, and a compiler that fails at once: the line must come before the build.
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": str(tmp_path), "CXX": "false"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.stdout.strip() == "False", result.stderr
    lines = result.stderr.splitlines()
    compiling = [
        i
        for i, line in enumerate(lines)
        if "CPU kernels: compiling for this CPU (first start on this CPU, about a minute" in line
    ]
    failed = [i for i, line in enumerate(lines) if "CPU kernels unavailable" in line]
    assert len(compiling) == 1 and len(failed) == 1 and compiling[0] < failed[0], lines


class _Health(BaseHTTPRequestHandler):
    """Another server's /health: 200, with the launch id of `server.launch_id` if any."""

    def do_GET(self) -> None:
        self.send_response(200)
        launch_id = getattr(self.server, "launch_id", None)
        if launch_id is not None:
            self.send_header(LAUNCH_ID_HEADER, launch_id)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("answered", "ours"), [(None, False), ("other-run", False), ("ours", True)]
)
def test_serve_counts_as_its_own_only_a_health_answer_with_its_launch_id(answered, ours):
    from services.launch import _answers_as

    with ThreadingHTTPServer(("127.0.0.1", 0), _Health) as server:
        server.launch_id = answered
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            assert _answers_as(f"http://127.0.0.1:{server.server_address[1]}", "ours") is ours
        finally:
            server.shutdown()
