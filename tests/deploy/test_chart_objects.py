"""The chart's optional objects: each switch adds or removes its object, and each object
says what Prometheus, Grafana, the Ingress controller and the autoscaler need."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.deploy.conftest import CHART, FULLNAME, REPO, helm_template

RULES = REPO / "observability" / "alerts" / "radixserve.rules.yaml"
DASHBOARD = REPO / "observability" / "dashboards" / "radixserve.json"

SWITCHES = [
    ("ingress.enabled", "Ingress"),
    ("metrics.serviceMonitor.enabled", "ServiceMonitor"),
    ("metrics.prometheusRule.enabled", "PrometheusRule"),
    ("metrics.grafanaDashboard.enabled", "ConfigMap"),
    ("autoscaling.enabled", "HorizontalPodAutoscaler"),
    ("networkPolicy.enabled", "NetworkPolicy"),
]


@pytest.mark.parametrize(("switch", "kind"), SWITCHES)
def test_each_switch_adds_and_removes_its_object(switch, kind):
    assert kind not in helm_template().kinds()
    assert helm_template(sets={switch: True}).kinds().count(kind) == 1
    assert kind not in helm_template(sets={switch: False}).kinds()


def test_the_default_render_is_the_deployment_the_service_and_the_test_pod(default):
    assert sorted(default.kinds()) == ["Deployment", "Pod", "Service"]


def test_the_all_on_values_turn_every_object_on(all_on):
    assert sorted(all_on.kinds()) == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "Ingress",
            "NetworkPolicy",
            "Pod",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Service",
            "ServiceMonitor",
        ]
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, False),
        ({"replicaCount": 2}, True),
        ({"replicaCount": 2, "podDisruptionBudget.enabled": False}, False),
        ({"autoscaling.enabled": True, "autoscaling.minReplicas": 1}, False),
        ({"autoscaling.enabled": True, "autoscaling.minReplicas": 2}, True),
    ],
)
def test_a_disruption_budget_exists_only_with_more_than_one_replica(values, expected):
    render = helm_template(sets=values)
    assert ("PodDisruptionBudget" in render.kinds()) == expected
    if expected:
        pdb = render.one("PodDisruptionBudget")["spec"]
        assert pdb["maxUnavailable"] == 1
        assert (
            pdb["selector"]["matchLabels"]
            == render.one("Deployment")["spec"]["selector"]["matchLabels"]
        )


def test_the_autoscaler_owns_the_replica_count_and_scales_on_waiting_requests(all_on):
    assert "replicas" not in all_on.one("Deployment")["spec"]
    hpa = all_on.one("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "radixserve_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "8"},
            },
        }
    ]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600


def test_the_ingress_keeps_streams_open_and_unbuffered(all_on):
    ingress = all_on.one("Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 600
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [
        {"secretName": "radixserve-tls", "hosts": ["llm.example.com"]}
    ]


def test_the_ingress_routes_the_api_and_nothing_else(all_on):
    (rule,) = all_on.one("Ingress")["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    paths = {(p["path"], p["pathType"]) for p in rule["http"]["paths"]}
    assert paths == {("/v1", "Prefix"), ("/generate", "Exact")}
    for path in rule["http"]["paths"]:
        assert path["backend"]["service"] == {"name": FULLNAME, "port": {"name": "http"}}
    for internal in (
        "/metrics",
        "/health",
        "/healthz",
        "/health_generate",
        "/flush_cache",
        "/get_server_info",
    ):
        assert not any(internal.startswith(p) for p, _ in paths), internal


def test_an_ingress_without_hosts_matches_any_host():
    (rule,) = helm_template(sets={"ingress.enabled": True}).one("Ingress")["spec"]["rules"]
    assert "host" not in rule


def test_the_service_monitor_scrapes_all_three_processes(all_on):
    monitor = all_on.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service = all_on.one("Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    # The scrape job is named after the Service; RadixserveTargetDown matches jobs containing
    # "radixserve".
    assert "radixserve" in service["metadata"]["name"]
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    endpoints = monitor["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == ["http", "worker-metrics", "detok-metrics"]
    for endpoint in endpoints:
        assert endpoint["port"] in service_ports
        assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "15s")


def test_the_prometheus_rule_carries_the_rule_file_verbatim(all_on):
    rule = all_on.one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for item in group["rules"]:
            assert ("alert" in item) != ("record" in item) and item["expr"]


def test_the_dashboard_configmap_is_labelled_for_grafanas_sidecar(all_on):
    configmap = all_on.one("ConfigMap")
    assert configmap["metadata"]["name"] == f"{FULLNAME}-dashboard"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["radixserve.json"]) == json.loads(DASHBOARD.read_text())


def test_the_network_policy_admits_api_and_metrics_traffic_from_the_configured_peers(all_on):
    policy = all_on.one("NetworkPolicy")["spec"]
    assert (
        policy["podSelector"]["matchLabels"]
        == all_on.one("Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert policy["policyTypes"] == ["Ingress"]
    api, metrics = policy["ingress"]
    assert api["ports"] == [{"port": "http"}]
    assert (
        api["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        == "ingress-nginx"
    )
    assert metrics["ports"] == [{"port": "worker-metrics"}, {"port": "detok-metrics"}]
    assert (
        metrics["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        == "monitoring"
    )


def test_the_helm_test_pod_lists_models_and_asks_for_one_token(render):
    pod = render.one("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["python", "-c"]
    assert container["command"][2] == (CHART / "files" / "smoke_test.py").read_text()
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["BASE_URL"] == f"http://{FULLNAME}:80"
    assert "MAX_TOKENS" not in env  # the script's default: one token
    assert pod["spec"]["restartPolicy"] == "Never"
