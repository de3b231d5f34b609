"""Tensor parallelism in the chart: `--tp-size` from the GPUs, and with `multinode` a
LeaderWorkerSet whose leader is the Deployment's pod and whose other pods run the worker's
ranks alone, placed in the group by the environment the LeaderWorkerSet gives each pod."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml

from services.settings import Settings
from tests.deploy.conftest import (
    CONTAINERS,
    FULLNAME,
    MULTINODE_VALUES,
    helm_template,
)
from tests.deploy.test_chart_pod import flag

MULTINODE = yaml.safe_load(MULTINODE_VALUES.read_text())
GROUP_FLAGS = ("tp-size", "nnodes", "node-rank", "dist-init-addr")
GROUP = f"{FULLNAME}-group"
# What the LeaderWorkerSet puts in each container's environment (its leader has index 0): the
# leader's name under the headless Service its controller makes, named after it.
LEADER_ADDRESS = f"{GROUP}-0.{GROUP}.default"


def containers(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in template["spec"]["containers"]}


def without_group_flags(template: dict[str, Any]) -> dict[str, Any]:
    """A copy of the pod template without the flags that place a rank in its group."""
    template = copy.deepcopy(template)
    for container in template["spec"]["containers"]:
        container["args"] = [
            a
            for a in container["args"]
            if a.split("=", 1)[0] not in {f"--{f}" for f in GROUP_FLAGS}
        ]
    return template


def lws_environment(args: list[str], worker_index: int, nodes: int = 2) -> list[str]:
    """The arguments as the kubelet expands them in the pod of `worker_index`."""
    env = {
        "LWS_GROUP_SIZE": str(nodes),
        "LWS_WORKER_INDEX": str(worker_index),
        "LWS_LEADER_ADDRESS": LEADER_ADDRESS,
    }
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def selects(selector: dict[str, str], template: dict[str, Any]) -> bool:
    return selector.items() <= template["metadata"]["labels"].items()


def test_multinode_swaps_the_deployment_for_a_leader_worker_set(default, multinode):
    assert "LeaderWorkerSet" not in default.kinds()
    assert "Deployment" not in multinode.kinds()
    lws = multinode.one("LeaderWorkerSet")
    assert (lws["apiVersion"], lws["metadata"]["name"]) == ("leaderworkerset.x-k8s.io/v1", GROUP)
    # Its controller would take a Service of its name for its own headless one, and the
    # ranks could not resolve their leader.
    assert GROUP not in {s["metadata"]["name"] for s in multinode.all("Service")}
    on_defaults = helm_template(sets={"multinode.enabled": True})
    assert "Deployment" not in on_defaults.kinds()
    assert on_defaults.one("LeaderWorkerSet")["spec"]["replicas"] == 1


def test_a_group_is_restarted_whole_and_its_ranks_start_with_the_leader(multinode):
    spec = multinode.one("LeaderWorkerSet")["spec"]
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == MULTINODE["multinode"]["nodes"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LeaderReady would wait for a leader that is ready only once every rank has joined.
    assert spec["startupPolicy"] == "LeaderCreated"
    # KEDA owns the number of groups.
    assert "replicas" not in spec


def test_the_leader_is_the_deployments_pod():
    """The leader template is the single-node pod, but for the flags that place it in a group."""
    values = {"worker.gpus": 4, "networkPolicy.enabled": True}
    leader = helm_template(sets={**values, "multinode.enabled": True}).group_template("leader")
    deployment = helm_template(sets=values).one("Deployment")["spec"]["template"]
    assert list(containers(leader)) == list(CONTAINERS)
    assert without_group_flags(leader) == without_group_flags(deployment)


def test_the_other_pods_run_the_worker_alone_with_the_leaders_flags(multinode):
    leader, rank = (multinode.group_template(role) for role in ("leader", "worker"))
    (worker,) = rank["spec"]["containers"]
    leader_worker = containers(leader)["worker"]
    assert worker["command"] == ["python", "-m", "services.worker"]
    assert worker["args"] == leader_worker["args"]
    assert worker["resources"] == leader_worker["resources"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert worker["volumeMounts"] == leader_worker["volumeMounts"]
    assert rank["spec"]["volumes"] == leader["spec"]["volumes"]  # the model on every node
    # Rank 0 drains only while every rank still answers its collectives.
    assert worker["lifecycle"] == leader_worker["lifecycle"]
    assert (
        rank["spec"]["terminationGracePeriodSeconds"]
        == leader["spec"]["terminationGracePeriodSeconds"]
    )
    # It serves no API and no /healthz: no port, no probe that could fail the group.
    assert not {"ports", "startupProbe", "livenessProbe", "readinessProbe"} & worker.keys()
    assert "llm-d.ai/engine-type" not in rank["metadata"]["labels"]


def test_the_group_flags_come_from_the_leader_worker_set_environment(multinode):
    for template in (multinode.group_template(role) for role in ("leader", "worker")):
        for container in template["spec"]["containers"]:
            args = container["args"]
            assert flag(args, "nnodes") == "$(LWS_GROUP_SIZE)"
            assert flag(args, "node-rank") == "$(LWS_WORKER_INDEX)"
            assert flag(args, "dist-init-addr") == "$(LWS_LEADER_ADDRESS):20100"


@pytest.mark.parametrize("worker_index", [0, 1])
def test_the_server_accepts_the_expanded_flags_of_each_node(multinode, worker_index):
    role = "worker" if worker_index else "leader"
    args = containers(multinode.group_template(role))["worker"]["args"]
    settings = Settings.from_cli(lws_environment(args, worker_index), env={})
    assert (settings.tp_size, settings.nnodes, settings.node_rank) == (16, 2, worker_index)
    assert settings.dist_init_addr == f"{LEADER_ADDRESS}:20100"


@pytest.mark.parametrize(
    ("values", "tp_size"),
    [
        ({}, None),
        ({"worker.gpus": 0}, None),
        ({"worker.gpus": 2}, "2"),
        ({"multinode.enabled": True, "worker.gpus": 8}, "16"),
        ({"multinode.enabled": True, "multinode.nodes": 3, "worker.gpus": 1}, "3"),
        # On CPUs one rank per node.
        ({"multinode.enabled": True, "worker.gpus": 0}, "2"),
    ],
)
def test_tp_size_is_the_gpus_of_every_node_in_all_three_containers(values, tp_size):
    render = helm_template(sets=values)
    pod = (
        render.group_template("leader")
        if "multinode.enabled" in values
        else render.one("Deployment")["spec"]["template"]
    )
    args = [c["args"] for c in pod["spec"]["containers"]]
    assert args[0] == args[1] == args[2]
    assert flag(args[0], "tp-size") == tp_size
    nodes = values.get("multinode.nodes", 2)
    assert Settings.from_cli(lws_environment(args[0], 0, nodes), env={}).tp_size == int(
        tp_size or 1
    )


def test_services_and_autoscalers_reach_the_leaders_only(multinode):
    leader, rank = (multinode.group_template(role) for role in ("leader", "worker"))
    service = multinode.one("Service")
    selectors = [
        service["spec"]["selector"],
        multinode.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        multinode.one("InferencePool")["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selects(selector, leader) and not selects(selector, rank)
    monitor = multinode.one("ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert monitor.items() <= service["metadata"]["labels"].items()
    scaled = multinode.one("ScaledObject")["spec"]
    assert scaled["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": GROUP,
    }
    # The leaders are <name>-<group>; the other pods <name>-<group>-<index> serve no metrics.
    pods = re.search(r'pod=~"([^"]+)"', scaled["triggers"][0]["metadata"]["query"]).group(1)
    assert re.fullmatch(pods, f"{GROUP}-0") and re.fullmatch(pods, f"{GROUP}-12")
    assert not re.fullmatch(pods, f"{GROUP}-0-1")
    hpa = helm_template(
        MULTINODE_VALUES, sets={"keda.enabled": False, "autoscaling.enabled": True}
    ).one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == scaled["scaleTargetRef"]


GROUP_RULE = {
    "from": [{"podSelector": {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": GROUP}}}]
}


def test_only_the_group_reaches_its_ranks_and_the_rendezvous(multinode, all_on):
    policies = {p["metadata"]["name"]: p["spec"] for p in multinode.all("NetworkPolicy")}
    leader, rank = (multinode.group_template(role) for role in ("leader", "worker"))
    server, ranks = policies[FULLNAME], policies[f"{FULLNAME}-ranks"]
    assert selects(server["podSelector"]["matchLabels"], leader)
    assert not selects(server["podSelector"]["matchLabels"], rank)
    assert selects(ranks["podSelector"]["matchLabels"], rank)
    assert not selects(ranks["podSelector"]["matchLabels"], leader)
    # Every port (the rendezvous, then NCCL's and gloo's ephemeral ones) from the group only.
    assert GROUP_RULE in server["ingress"]
    assert ranks["ingress"] == [GROUP_RULE] and ranks["policyTypes"] == ["Ingress"]
    assert {"ports": [{"port": "http"}]} in server["ingress"]  # the API as before
    assert GROUP_RULE not in all_on.one("NetworkPolicy")["spec"]["ingress"]
