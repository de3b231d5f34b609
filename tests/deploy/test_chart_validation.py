"""The chart as CI checks it offline: `helm lint --strict`, every render through
`kubernetes-validate --strict`, the values schema, and the packaged chart's files."""

from __future__ import annotations

import json
import tarfile

import pytest
import yaml

from engine.cache.evict_policy import EVICTION_POLICIES
from engine.constants import GRAMMAR_BACKENDS, SCHEDULE_POLICIES
from services.settings import LOG_LEVELS
from tests.deploy.conftest import (
    ALL_ON_VALUES,
    CHART,
    CPU_VALUES,
    KEDA_VALUES,
    MULTINODE_VALUES,
    REPO,
    helm_template_error,
    run_tool,
)

VALUES_FILES = {
    "default": [],
    "cpu": [CPU_VALUES],
    "all_on": [ALL_ON_VALUES],
    "all_on_keda": [ALL_ON_VALUES, KEDA_VALUES],
    "multinode": [MULTINODE_VALUES],
}
# The oldest and newest Kubernetes that kubernetes-validate has schemas for; Chart.yaml says
# >= 1.25.
KUBERNETES_VERSIONS = ["1.25.0", "1.37.0"]
# Kinds of CRDs (Prometheus Operator, Gateway API and its Inference Extension, KEDA,
# LeaderWorkerSet): not in kubernetes-validate's schemas; test_chart_objects and
# test_chart_multinode check their structure (and the LeaderWorkerSet's pod templates are
# validated here as Pods).
CUSTOM_RESOURCES = {
    "ServiceMonitor",
    "PrometheusRule",
    "InferencePool",
    "HTTPRoute",
    "ScaledObject",
    "LeaderWorkerSet",
}
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize("values", VALUES_FILES)
def test_helm_lint_strict_passes(values):
    args = [arg for path in VALUES_FILES[values] for arg in ("--values", str(path))]
    result = run_tool("helm", "lint", "--strict", str(CHART), *args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUES_FILES)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_renders_pass_kubernetes_validate_strict(values, version, tmp_path, request):
    render = request.getfixturevalue(values)
    # kubernetes-validate has no schemas for custom resources; test_chart_objects checks those.
    builtin = [doc for doc in render.docs if doc["kind"] not in CUSTOM_RESOURCES]
    builtin += [group_pod(render.group_template(role), role) for role in group_roles(render)]
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump_all(builtin))
    result = run_tool(
        "kubernetes-validate", "--strict", "--kubernetes-version", version, str(manifest)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(builtin)


def group_roles(render) -> list[str]:
    return ["leader", "worker"] if "LeaderWorkerSet" in render.kinds() else []


def group_pod(template: dict, role: str) -> dict:
    """A LeaderWorkerSet pod template as the Pod it becomes, so its spec is validated."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": role},
        "spec": template["spec"],
    }


def test_kubernetes_validate_strict_rejects_an_unknown_field(tmp_path):
    manifest = tmp_path / "bad.yaml"
    manifest.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {portz: []}\n")
    assert run_tool("kubernetes-validate", "--strict", str(manifest)).returncode != 0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine.schedulePolicy": "shortest"}, "schedulePolicy"),
        ({"enigne": {}}, "enigne"),
        ({"worker.gpus": "1"}, "gpus"),
        ({"model.source": "s3"}, "source"),
        ({"model.source": "pvc"}, "claimName"),
        ({"model.source": "huggingface"}, "repoId"),
        ({"ports.http": 70000}, "http"),
        ({"engine.memFractionStatic": 1.5}, "memFractionStatic"),
        ({"kvEvents.blockSize": 0}, "kvEvents.blockSize"),
        ({"kvEvents.replayPort": 70000}, "kvEvents.replayPort"),
        ({"kvEvents.enabeld": True}, "enabeld"),
        # Server options are flags, identical in all three containers: no RADIXSERVE_* variable.
        ({"extraEnv": [{"name": "RADIXSERVE_PORT", "value": "1"}]}, "extraEnv.0.name"),
        ({"worker.env": [{"name": "RADIXSERVE_PORT", "value": "1"}]}, "worker.env.0.name"),
        ({"extraVolumeMounts": [{"name": "x"}]}, "mountPath"),
        ({"model.pvc.accessModes": ["ReadWrite"]}, "accessModes"),
        ({"inferencePool.enabled": True}, "endpointPicker.name"),
        ({"inferencePool.endpointPicker.failureMode": "FailSafe"}, "failureMode"),
        ({"httpRoute.enabled": True}, "parentRefs"),
        ({"httpRoute.timeouts.request": "1 hour"}, "timeouts.request"),
        ({"keda.enabled": True}, "serverAddress"),
        ({"keda.prometheus.serverAddress": "prometheus:9090"}, "serverAddress"),
        ({"multinode.nodes": 1}, "multinode.nodes"),
        ({"multinode.distInitPort": 70000}, "multinode.distInitPort"),
        ({"multinode.enabeld": True}, "enabeld"),
    ],
)
def test_the_values_schema_rejects_mistakes_with_their_name(values, message):
    assert message in helm_template_error(sets=values)


def test_the_schema_offers_exactly_the_servers_choices():
    engine = SCHEMA["properties"]["engine"]["properties"]
    assert engine["schedulePolicy"]["enum"] == list(SCHEDULE_POLICIES)
    assert engine["radixEvictionPolicy"]["enum"] == list(EVICTION_POLICIES)
    assert engine["grammarBackend"]["enum"] == list(GRAMMAR_BACKENDS)
    assert engine["logLevel"]["enum"] == list(LOG_LEVELS)


def test_every_schema_object_rejects_unknown_keys():
    """A typo in a values file must fail `helm template`, not be ignored: every object the
    schema describes says additionalProperties: false."""

    def objects(schema: dict, path: str):
        if schema.get("type") == "object" and "properties" in schema:
            yield path, schema
            for key, sub in schema["properties"].items():
                yield from objects(sub, f"{path}.{key}")

    loose = [
        path
        for path, schema in objects(SCHEMA, "values")
        if schema.get("additionalProperties") is not False
    ]
    assert loose == []


def test_the_observability_files_are_links_not_copies():
    for name, target in [
        ("radixserve.json", "observability/dashboards/radixserve.json"),
        ("radixserve.rules.yaml", "observability/alerts/radixserve.rules.yaml"),
    ]:
        link = CHART / "files" / name
        assert link.is_symlink()
        assert link.resolve() == (REPO / target).resolve()


def test_helm_package_follows_the_links(tmp_path):
    result = run_tool("helm", "package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (package,) = tmp_path.glob("radixserve-*.tgz")
    with tarfile.open(package) as archive:
        for name, source in [
            ("radixserve.json", "observability/dashboards/radixserve.json"),
            ("radixserve.rules.yaml", "observability/alerts/radixserve.rules.yaml"),
        ]:
            member = archive.extractfile(f"radixserve/files/{name}")
            assert member is not None and member.read() == (REPO / source).read_bytes()
        names = archive.getnames()
    assert "radixserve/values-cpu.yaml" in names and "radixserve/values.schema.json" in names
    assert not [n for n in names if n.startswith("radixserve/ci/")]
