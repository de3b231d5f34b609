"""The llm-d router configuration in docs/operations.md, checked against what it describes.

The router ships only as a container image, so the block is checked structurally: the
metric names and labels it maps are the worker's, the KV-event block size and port are the
chart's, and the engine type is the label the chart puts on the pod.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client import CollectorRegistry

from observability.worker_metrics import WorkerMetrics, WorkerSample
from services.settings import Settings
from tests.deploy.conftest import CHART, REPO, helm_template

OPERATIONS = REPO / "docs" / "operations.md"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
FENCED_YAML = re.compile(r"^```yaml\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# llm-d's metric spec: a name, optionally with label matchers, "queue_size{status=waiting}".
METRIC_SPEC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?")
SPEC_FIELDS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")


def kubernetes_section() -> str:
    text = OPERATIONS.read_text()
    return text.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    blocks = [yaml.safe_load(block) for block in FENCED_YAML.findall(kubernetes_section())]
    configs = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "EndpointPickerConfig"]
    assert len(configs) == 1, f"expected one EndpointPickerConfig block, found {len(configs)}"
    return configs[0]


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [p for p in config["plugins"] if p["type"] == kind]
    return found.get("parameters", {})


@pytest.fixture(scope="module")
def engine(config) -> dict[str, Any]:
    (entry,) = [
        e
        for e in plugin(config, "core-metrics-extractor")["engineConfigs"]
        if e["name"] == "radixserve"
    ]
    return entry


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """The worker's metric families, by name, with the labels of their samples."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, model_name="m")
    sample = WorkerSample(**{f.name: 0 for f in fields(WorkerSample) if f.name != "swa"})
    metrics.publish(sample)  # a one-pool model's: no sliding-window series
    families: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = families.setdefault(family.name, set())
        for sample in family.samples:
            labels.update(sample.labels)
    return families


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    match = METRIC_SPEC.fullmatch(spec)
    assert match, spec
    matchers = dict(m.split("=", 1) for m in match[2].split(",")) if match[2] else {}
    return match[1], matchers


def test_the_block_is_one_endpoint_picker_config_whose_references_resolve(config):
    assert config["apiVersion"].startswith("llm-d.ai/")
    names = [p.get("name", p["type"]) for p in config["plugins"]]
    assert len(names) == len(set(names))
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in config["dataLayer"]["sources"]:
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    assert "precise-prefix-cache-scorer" in refs
    assert set(refs) <= set(names), set(refs) - set(names)


def test_the_engine_entry_is_the_engine_type_the_chart_labels_the_pod_with(config, engine):
    key = plugin(config, "core-metrics-extractor")["engineLabelKey"]
    assert key == "llm-d.ai/engine-type"
    labels = helm_template().one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert engine["name"] == labels[key] == "radixserve"


def test_the_router_reads_radixserves_names_for_its_signals(engine):
    assert {field: engine[field] for field in SPEC_FIELDS} == {
        "queuedRequestsSpec": "radixserve_num_requests_waiting",
        "runningRequestsSpec": "radixserve_num_requests_running",
        "kvUsageSpec": "radixserve_kv_usage_ratio",
        "cacheInfoSpec": "radixserve_cache_config_info",
    }
    assert (engine["cacheBlockSizeLabelName"], engine["cacheNumBlocksLabelName"]) == (
        "page_size",
        "num_pages",
    )


def test_every_metric_the_router_maps_is_one_the_worker_exports(config, engine, exported):
    for field in SPEC_FIELDS:
        name, matchers = parse_spec(engine[field])
        assert name in exported, (field, name)
        assert set(matchers) <= exported[name], (field, matchers)
    cache_info, _ = parse_spec(engine["cacheInfoSpec"])
    for field in ("cacheBlockSizeLabelName", "cacheNumBlocksLabelName"):
        assert engine[field] in exported[cache_info], field
    # And no radixserve_* name anywhere in the block is one the worker lacks.
    named = set(re.findall(r"\bradixserve_[a-z0-9_]+", yaml.safe_dump(config)))
    assert named and named <= set(exported), named - set(exported)


def test_the_kv_usage_the_router_reads_is_a_ratio():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, model_name="m")
    sample = {f.name: 0 for f in fields(WorkerSample) if f.name != "swa"}
    metrics.publish(WorkerSample(**{**sample, "total_tokens": 100}))  # all of it held
    assert (
        registry.get_sample_value("radixserve_kv_usage_ratio", {"model_name": "m", "tp_rank": "0"})
        == 1
    )


def test_the_router_cuts_prompts_into_the_blocks_the_worker_publishes(config):
    tokens = plugin(config, "precise-prefix-cache-scorer")["tokenProcessorConfig"]
    assert tokens["blockSizeTokens"] == VALUES["kvEvents"]["blockSize"] == 16
    # The chart's default is the server's own, so `radixserve serve` publishes the same blocks.
    assert Settings().kv_events_block_size == tokens["blockSizeTokens"]
    assert tokens.get("blockSize", 16) == 16  # the field's older name, if given
    args = helm_template(sets={"kvEvents.enabled": True}).containers["worker"]["args"]
    assert f"--kv-events-block-size={tokens['blockSizeTokens']}" in args


def test_the_router_subscribes_where_the_worker_publishes(config):
    events = plugin(config, "precise-prefix-cache-scorer")["kvEventsConfig"]
    assert events["discoverPods"] is True
    assert events["engineType"] == "vllm"  # radixserve's events are in vLLM's layout
    render = helm_template(
        sets={
            "kvEvents.enabled": True,
            "inferencePool.enabled": True,
            "inferencePool.endpointPicker.name": "epp",
        }
    )
    worker = render.containers["worker"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert events["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    assert events["podDiscoveryConfig"]["socketPort"] == VALUES["kvEvents"]["port"]
    # The topic after the kubelet's expansion, read the way llm-d reads it: kv@<pod>@<model>,
    # the pod being the endpoint's "<IP>:<target port>".
    (config_arg,) = [a for a in worker["args"] if a.startswith("--kv-events-config=")]
    topic = yaml.safe_load(config_arg.split("=", 1)[1])["topic"].replace("$(POD_IP)", "10.0.0.7")
    assert topic.startswith(events["topicFilter"])
    _, pod, model = topic.split("@")
    (target,) = render.one("InferencePool")["spec"]["targetPorts"]
    assert pod == f"10.0.0.7:{target['number']}"
    assert model == "embedded"  # the served model name, as requests name it


def test_the_router_scrapes_and_tokenizes_through_the_api_port(config):
    source = plugin(config, "metrics-data-source")
    assert (source["scheme"], source["path"]) == ("http", "/metrics")
    render = urlparse(plugin(config, "token-producer")["vllm"]["http"])
    assert (render.scheme, render.port, render.path) == ("http", VALUES["service"]["port"], "")
