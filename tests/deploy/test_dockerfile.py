"""The Dockerfile: clean under hadolint, and agreeing with the chart on the user and on which
paths are writable (the chart mounts emptyDirs there over a read-only root)."""

from __future__ import annotations

import re
import shlex

from tests.deploy.conftest import REPO, run_tool

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(
            line
            for line in DOCKERFILE.read_text().splitlines()
            if not line.lstrip().startswith("#")
        ),
    )
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in text.splitlines()
        if line.strip()
    ]


def runtime_env() -> dict[str, str]:
    ops = instructions()
    final_stage = ops[max(i for i, (op, _) in enumerate(ops) if op == "FROM") :]
    env = {}
    for op, args in final_stage:
        if op == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args))
    return env


def test_hadolint_finds_nothing():
    result = run_tool("hadolint", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_base_image_is_a_build_argument_of_both_stages():
    ops = instructions()
    assert ops[0][0] == "ARG" and ops[0][1].startswith("BASE_IMAGE=")
    froms = [args for op, args in ops if op == "FROM"]
    assert len(froms) == 2 and all(args.startswith("${BASE_IMAGE}") for args in froms)


def test_the_image_runs_as_the_chart_user(default):
    (user,) = [args for op, args in instructions() if op == "USER"]
    context = default.pod["securityContext"]
    assert user == f"{context['runAsUser']}:{context['runAsGroup']}"


def test_every_cache_the_libraries_write_lies_on_a_writable_mount(default):
    env = runtime_env()
    writable = [
        m["mountPath"]
        for m in default.containers["worker"]["volumeMounts"]
        if not m.get("readOnly")
    ]
    for name in (
        "HOME",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
    ):
        assert any(env[name] == path or env[name].startswith(path + "/") for path in writable), name
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # no .pyc beside read-only sources


def test_the_default_command_serves_all_three_and_the_chart_picks_one(default):
    (cmd,) = [args for op, args in instructions() if op == "CMD"]
    assert cmd == '["radixserve", "serve"]'
    assert all(c["command"][:2] == ["python", "-m"] for c in default.containers.values())


def test_the_build_context_holds_what_the_dockerfile_copies():
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for op, args in instructions():
        if op == "COPY" and not args.startswith("--from"):
            copied.update(args.split()[:-1])
    assert copied == allowed
