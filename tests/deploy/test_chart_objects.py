"""The chart's optional objects: each switch adds or removes its object, and each object
says what Prometheus, Grafana, the Ingress controller, the Gateway and its endpoint picker,
and the autoscaler need."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.conftest import (
    ALL_ON_VALUES,
    CHART,
    CONTAINERS,
    FULLNAME,
    REPO,
    Render,
    helm_template,
    helm_template_error,
)

RULES = REPO / "observability" / "alerts" / "radixserve.rules.yaml"
DASHBOARD = REPO / "observability" / "dashboards" / "radixserve.json"

PICKER = {"inferencePool.endpointPicker.name": "epp"}
PROMETHEUS = {"keda.prometheus.serverAddress": "http://prometheus:9090"}
SWITCHES = [
    # (switch, the kind it adds, the values the object needs besides the switch)
    ("ingress.enabled", "Ingress", {}),
    ("metrics.serviceMonitor.enabled", "ServiceMonitor", {}),
    ("metrics.prometheusRule.enabled", "PrometheusRule", {}),
    ("metrics.grafanaDashboard.enabled", "ConfigMap", {}),
    ("autoscaling.enabled", "HorizontalPodAutoscaler", {}),
    ("keda.enabled", "ScaledObject", PROMETHEUS),
    ("networkPolicy.enabled", "NetworkPolicy", {}),
    ("multinode.enabled", "LeaderWorkerSet", {}),
    ("inferencePool.enabled", "InferencePool", PICKER),
    (
        "httpRoute.enabled",
        "HTTPRoute",
        {**PICKER, "inferencePool.enabled": True, "httpRoute.parentRefs": [{"name": "gw"}]},
    ),
    (
        "model.pvc.create",
        "PersistentVolumeClaim",
        {"model.source": "huggingface", "model.huggingface.repoId": "a/b"},
    ),
]


@pytest.mark.parametrize(("switch", "kind", "needs"), SWITCHES)
def test_each_switch_adds_and_removes_its_object(switch, kind, needs):
    assert kind not in helm_template().kinds()
    assert helm_template(sets={**needs, switch: True}).kinds().count(kind) == 1
    assert kind not in helm_template(sets={**needs, switch: False}).kinds()


def test_the_default_render_is_the_deployment_the_service_and_the_test_pod(default):
    assert sorted(default.kinds()) == ["Deployment", "Pod", "Service"]


def test_the_all_on_values_turn_every_object_on(all_on):
    assert sorted(all_on.kinds()) == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HTTPRoute",
            "HorizontalPodAutoscaler",
            "InferencePool",
            "Ingress",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "Pod",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Service",
            "ServiceMonitor",
        ]
    )


def test_the_keda_values_swap_the_hpa_for_a_scaled_object(all_on, all_on_keda):
    assert sorted(all_on_keda.kinds()) == sorted(
        [*(k for k in all_on.kinds() if k != "HorizontalPodAutoscaler"), "ScaledObject"]
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, False),
        ({"replicaCount": 2}, True),
        ({"replicaCount": 2, "podDisruptionBudget.enabled": False}, False),
        ({"autoscaling.enabled": True, "autoscaling.minReplicas": 1}, False),
        ({"autoscaling.enabled": True, "autoscaling.minReplicas": 2}, True),
        ({**PROMETHEUS, "keda.enabled": True, "keda.minReplicas": 1}, False),
        ({**PROMETHEUS, "keda.enabled": True, "keda.minReplicas": 2}, True),
        ({**PROMETHEUS, "keda.enabled": True, "keda.minReplicas": 0, "replicaCount": 3}, False),
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


def container_of_port(render: Render, name: str) -> str:
    """The container that declares the named port."""
    (owner,) = [
        c["name"] for c in render.containers.values() for p in c["ports"] if p["name"] == name
    ]
    return owner


def test_the_service_monitor_scrapes_every_series_once(all_on):
    """The tokenizer's /metrics serves the worker's series too: scraping the worker's own port
    as well would count every worker series twice in the dashboards and the alerts."""
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
    assert [e["port"] for e in endpoints] == ["http", "detok-metrics"]
    for endpoint in endpoints:
        assert endpoint["port"] in service_ports
        assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "15s")
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    scraped = [container_of_port(all_on, targets[e["port"]]) for e in endpoints]
    assert scraped == ["tokenizer", "detokenizer"]
    # The worker keeps its port for the kubelet's probes, off the Service.
    assert container_of_port(all_on, "worker-metrics") == "worker"
    assert "worker-metrics" not in service_ports


def test_dashboards_and_alerts_select_the_scrape_job_the_service_monitor_makes():
    """Prometheus names a ServiceMonitor's job after the Service: every job matcher of the
    dashboard and the rules must match that name, and none may name a worker-only job."""
    texts = {path.name: path.read_text() for path in (RULES, DASHBOARD)}
    matchers = [
        (name, op, value)
        for name, text in texts.items()
        for op, value in re.findall(r'\bjob\s*(=~|!=|=)\s*\\?"([^"\\]*)', text)
    ]
    assert ("radixserve.rules.yaml", "=~", ".*radixserve.*") in matchers
    for name, op, value in matchers:
        assert op == "=~" and re.fullmatch(value, FULLNAME), (name, op, value)
    for text in texts.values():
        assert "worker-metrics" not in text


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


def test_the_network_policy_admits_api_metrics_and_kv_event_traffic_from_the_configured_peers(
    all_on,
):
    policy = all_on.one("NetworkPolicy")["spec"]
    assert (
        policy["podSelector"]["matchLabels"]
        == all_on.one("Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert policy["policyTypes"] == ["Ingress"]
    api, metrics, kv_events = policy["ingress"]
    assert api["ports"] == [{"port": "http"}]
    assert (
        api["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        == "ingress-nginx"
    )
    # The worker's series are scraped on http; its own port answers the kubelet only.
    assert metrics["ports"] == [{"port": "detok-metrics"}]
    assert (
        metrics["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        == "monitoring"
    )
    assert kv_events["ports"] == [{"port": "kv-events"}, {"port": "kv-replay"}]
    assert kv_events["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-d"}}}
    ]
    # Every port the policy names is a port of the pod.
    named = {p["name"] for c in all_on.containers.values() for p in c["ports"]}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            assert port["port"] in named, port


def test_without_kv_events_the_network_policy_opens_no_event_port():
    policy = helm_template(sets={"networkPolicy.enabled": True}).one("NetworkPolicy")["spec"]
    assert [r["ports"] for r in policy["ingress"]] == [
        [{"port": "http"}],
        [{"port": "detok-metrics"}],
    ]


def test_the_router_namespace_defaults_to_the_releases():
    policy = helm_template(sets={"networkPolicy.enabled": True, "kvEvents.enabled": True}).one(
        "NetworkPolicy"
    )["spec"]
    kv_events = policy["ingress"][-1]
    assert kv_events["ports"] == [{"port": "kv-events"}]  # no replay socket by default
    # `helm template` renders into the namespace "default".
    assert kv_events["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}}}
    ]


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


def test_the_pod_says_its_engine_type_to_the_llm_d_router(render):
    deployment = render.one("Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == (
        "radixserve"
    )
    # Not a selector label: a Deployment's selector cannot change on upgrade.
    assert "llm-d.ai/engine-type" not in deployment["spec"]["selector"]["matchLabels"]


def test_the_inference_pool_is_the_server_pods_on_the_api_port(all_on):
    pool = all_on.one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == FULLNAME
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    selector = spec["selector"]["matchLabels"]
    assert selector == all_on.one("Deployment")["spec"]["selector"]["matchLabels"]
    assert (
        selector.items()
        <= all_on.one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )
    assert not selector.items() <= all_on.one("Pod")["metadata"]["labels"].items()  # helm test
    (api,) = [p for p in all_on.containers["tokenizer"]["ports"] if p["name"] == "http"]
    assert spec["targetPorts"] == [{"number": api["containerPort"]}]
    assert spec["endpointPickerRef"] == {
        "kind": "Service",
        "name": "radixserve-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }


def test_the_endpoint_picker_reference_defaults_to_fail_close_and_takes_a_group():
    ref = helm_template(sets={**PICKER, "inferencePool.enabled": True}).one("InferencePool")[
        "spec"
    ]["endpointPickerRef"]
    assert ref == {
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    ref = helm_template(
        sets={
            **PICKER,
            "inferencePool.enabled": True,
            "inferencePool.endpointPicker.group": "example.com",
            "inferencePool.endpointPicker.kind": "Picker",
        }
    ).one("InferencePool")["spec"]["endpointPickerRef"]
    assert (ref["group"], ref["kind"]) == ("example.com", "Picker")


def seconds(duration: str) -> float:
    """A Gateway API duration ("1h30m", "3600s", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([0-9]+)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def test_the_http_route_sends_the_api_to_the_pool_and_keeps_streams_open(all_on):
    route = all_on.one("HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert spec["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateway-system"}]
    assert spec["hostnames"] == ["llm.example.com"]
    (rule,) = spec["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": all_on.one("InferencePool")["metadata"]["name"],
        }
    ]
    # The OpenAI API only, as the Ingress: /metrics, /health* and the admin paths stay inside.
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    # Gateways default to seconds per request; a token stream takes minutes.
    assert seconds(rule["timeouts"]["request"]) >= 600
    assert seconds("1h30m") == 5400 and seconds("500ms") == 0.5


def test_an_http_route_without_the_pool_or_a_gateway_fails_with_a_reason():
    route = {"httpRoute.enabled": True, "httpRoute.parentRefs": [{"name": "gw"}]}
    assert "set inferencePool.enabled" in helm_template_error(sets=route)
    assert "parentRefs" in helm_template_error(
        sets={**PICKER, "inferencePool.enabled": True, "httpRoute.enabled": True}
    )


def test_the_scaled_object_scales_on_the_releases_waiting_requests(all_on_keda):
    assert "replicas" not in all_on_keda.one("Deployment")["spec"]
    scaled = all_on_keda.one("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": all_on_keda.one("Deployment")["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 8)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 600
    }
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values())  # KEDA's metadata is strings
    assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    assert metadata["threshold"] == "4"
    query = re.fullmatch(
        r'sum\(radixserve_num_requests_waiting\{namespace="([^"]*)", pod=~"([^"]*)"\}\)',
        metadata["query"],
    )
    assert query, metadata["query"]
    assert query[1] == "default"
    # Prometheus anchors label regexes: this release's pods, not a release named rs-radixserve-b.
    assert re.fullmatch(query[2], f"{FULLNAME}-7d9f8b6c5d-x2x4z")
    assert not re.fullmatch(query[2], f"{FULLNAME}-b-7d9f8b6c5d-x2x4z")
    assert not re.fullmatch(query[2], f"{FULLNAME}-test")  # the helm test pod


def test_a_query_of_ones_own_replaces_the_default():
    render = helm_template(
        sets={**PROMETHEUS, "keda.enabled": True, "keda.prometheus.query": "sum(x)"}
    )
    assert render.one("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"] == "sum(x)"


def test_keda_and_the_hpa_cannot_both_scale_the_deployment():
    error = helm_template_error(
        sets={**PROMETHEUS, "keda.enabled": True, "autoscaling.enabled": True}
    )
    assert "keda.enabled and autoscaling.enabled" in error


def test_every_container_gets_extra_env_then_its_own(all_on):
    values = yaml.safe_load(ALL_ON_VALUES.read_text())
    for name in CONTAINERS:
        env = all_on.containers[name]["env"]
        names = [e["name"] for e in env]
        assert env[-len(values[name]["env"]) :] == values[name]["env"], name
        for extra in values["extraEnv"]:
            assert extra in env, name
            assert names.index(extra["name"]) < names.index(values[name]["env"][0]["name"])
        others = [o for o in CONTAINERS if o != name]
        for other in others:
            for own in values[other]["env"]:
                if own not in values[name]["env"]:
                    assert own not in env, (name, own)


def test_a_container_without_variables_has_no_env(default):
    assert "env" not in default.containers["worker"]


def test_extra_volumes_are_mounted_in_all_three(all_on):
    values = yaml.safe_load(ALL_ON_VALUES.read_text())
    volumes = all_on.pod["volumes"]
    for volume in values["extraVolumes"]:
        assert volume in volumes
    for container in all_on.containers.values():
        for mount in values["extraVolumeMounts"]:
            assert mount in container["volumeMounts"], container["name"]
    # Every mount names a volume of the pod.
    names = {v["name"] for v in volumes}
    for container in all_on.containers.values():
        assert {m["name"] for m in container["volumeMounts"]} <= names


def test_the_created_claim_is_the_one_the_download_fills(all_on):
    claim = all_on.one("PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "radixserve-models"
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "premium-rwx",
        "resources": {"requests": {"storage": "200Gi"}},
    }
    volumes = {v["name"]: v for v in all_on.pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "radixserve-models"}
    (init,) = all_on.pod["initContainers"]
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]


def test_a_created_claim_serves_a_pvc_model_read_only():
    render = helm_template(
        sets={
            "model.source": "pvc",
            "model.pvc.create": True,
            "model.pvc.keep": False,
            "model.pvc.dataSource": {"kind": "PersistentVolumeClaim", "name": "seed"},
        }
    )
    claim = render.one("PersistentVolumeClaim")
    assert claim["metadata"]["name"] == f"{FULLNAME}-model"
    assert "annotations" not in claim["metadata"]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],  # the default class's, no storageClassName
        "dataSource": {"kind": "PersistentVolumeClaim", "name": "seed"},
        "resources": {"requests": {"storage": "100Gi"}},
    }
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": f"{FULLNAME}-model", "readOnly": True},
    } in render.pod["volumes"]


def test_storage_class_dash_means_no_class():
    claim = helm_template(
        sets={"model.source": "pvc", "model.pvc.create": True, "model.pvc.storageClassName": "-"}
    ).one("PersistentVolumeClaim")
    assert claim["spec"]["storageClassName"] == ""


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model.pvc.create": True}, "model.source pvc or huggingface"),
        (
            {
                "model.pvc.create": True,
                "model.source": "huggingface",
                "model.huggingface.repoId": "a/b",
                "model.huggingface.claimName": "other",
            },
            "set one",
        ),
    ],
)
def test_a_claim_nothing_would_use_fails_with_a_reason(values, message):
    assert message in helm_template_error(sets=values)


def kv_events_config(args: list[str]) -> dict:
    (arg,) = [a for a in args if a.startswith("--kv-events-config=")]
    return json.loads(arg.split("=", 1)[1])


def test_kv_events_bind_beyond_the_pod_through_their_flag_only(all_on):
    worker = all_on.containers["worker"]
    config = kv_events_config(worker["args"])
    # SGLang's and vLLM's keys, nothing else.
    assert set(config) == {
        "publisher",
        "endpoint",
        "topic",
        "buffer_steps",
        "hwm",
        "replay_endpoint",
    }
    assert (config["publisher"], config["endpoint"], config["replay_endpoint"]) == (
        "zmq",
        "tcp://*:5557",
        "tcp://*:5558",
    )
    assert (config["buffer_steps"], config["hwm"]) == (10000, 100000)
    assert "--kv-events-block-size=16" in worker["args"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    for name in ("tokenizer", "detokenizer"):
        assert not {"kv-events", "kv-replay"} & {
            p["name"] for p in all_on.containers[name]["ports"]
        }
    # No Service port: the router dials each pod.
    assert not {5557, 5558} & {p["port"] for p in all_on.one("Service")["spec"]["ports"]}


def test_the_kv_event_topic_names_the_pod_and_the_model_as_the_router_sees_them(all_on):
    """llm-d reads "kv@<pod>@<model>": the pod as its endpoint address (pod IP and API port),
    the model as clients name it."""
    config = kv_events_config(all_on.containers["worker"]["args"])
    assert config["topic"] == "kv@$(POD_IP):30000@Qwen/Qwen2.5-0.5B-Instruct"
    assert all_on.one("InferencePool")["spec"]["targetPorts"] == [{"number": 30000}]
    # The kubelet expands $(POD_IP) from the container's own environment, in all three alike.
    for name in CONTAINERS:
        assert all_on.env(name)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_kv_event_values_become_the_flags():
    render = helm_template(
        sets={
            "kvEvents.enabled": True,
            "kvEvents.port": 6000,
            "kvEvents.topic": "kv-events",
            "kvEvents.blockSize": 32,
        }
    )
    args = render.containers["worker"]["args"]
    config = kv_events_config(args)
    assert (config["endpoint"], config["topic"]) == ("tcp://*:6000", "kv-events")
    assert "replay_endpoint" not in config
    assert "--kv-events-block-size=32" in args
    assert [p["name"] for p in render.containers["worker"]["ports"]] == [
        "worker-metrics",
        "kv-events",
    ]


def test_kv_events_are_off_by_default(default):
    for name in CONTAINERS:
        assert not [a for a in default.containers[name]["args"] if a.startswith("--kv-events")]
        assert "POD_IP" not in default.env(name)
    assert [p["name"] for p in default.containers["worker"]["ports"]] == ["worker-metrics"]
