"""The chart's pod: three containers of one image, agreeing on every flag, the GPU on the
worker alone, probes on each process's own endpoint, a read-only root, a graceful drain."""

from __future__ import annotations

import pytest
import yaml

from services.settings import PORT_FIELDS, Settings
from tests.deploy.conftest import (
    ALL_ON_VALUES,
    CHART,
    CONTAINERS,
    CPU_VALUES,
    FULLNAME,
    helm_template,
)

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def flag(args: list[str], name: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given {len(values)} times"
    return values[0] if values else None


def test_the_pod_runs_tokenizer_worker_and_detokenizer_from_one_image(render):
    containers = render.containers
    assert list(containers) == list(CONTAINERS)
    assert len({c["image"] for c in containers.values()}) == 1
    for name, container in containers.items():
        assert container["command"] == ["python", "-m", f"services.{name}"]


def test_all_three_processes_get_identical_flags(render):
    args = [c["args"] for c in render.containers.values()]
    assert args[0] == args[1] == args[2]
    # Flags only: no RADIXSERVE_* variable could make one container disagree (the keys from
    # Secrets, which only the tokenizer reads, are variables so as to stay out of `ps`).
    secrets = {"RADIXSERVE_API_KEY", "RADIXSERVE_ADMIN_API_KEY"}
    for name in CONTAINERS:
        assert not [v for v in render.env(name) if v.startswith("RADIXSERVE_") and v not in secrets]


@pytest.mark.parametrize(
    ("values", "model", "served"),
    [
        ({}, "embedded", "embedded"),
        (
            {
                "model.source": "pvc",
                "model.pvc.claimName": "models",
                "model.path": "Qwen2.5-7B-Instruct",
            },
            "/models/Qwen2.5-7B-Instruct",
            "Qwen2.5-7B-Instruct",
        ),
        (
            {
                "model.source": "hostPath",
                "model.hostPath.path": "/data/llm",
                "model.path": "smol.gguf",
                "model.servedModelName": "smol",
            },
            "/models/smol.gguf",
            "smol",
        ),
        (
            {"model.source": "huggingface", "model.huggingface.repoId": "Qwen/Qwen3-8B"},
            "/models/Qwen/Qwen3-8B",
            "Qwen/Qwen3-8B",
        ),
    ],
)
def test_every_container_gets_the_same_model(values, model, served):
    render = helm_template(sets=values)
    for container in render.containers.values():
        assert flag(container["args"], "model") == model
        assert flag(container["args"], "served-model-name") == served


def test_the_zmq_ports_are_the_same_flags_in_every_container_and_never_exposed():
    zmq = {"worker": 31010, "detokenizer": 31011, "tokenizer": 31012, "tokenizerControl": 31013}
    render = helm_template(sets={"ports.zmq": zmq})
    expected = {
        "worker-port": "31010",
        "detokenizer-port": "31011",
        "tokenizer-port": "31012",
        "tokenizer-control-port": "31013",
    }
    for container in render.containers.values():
        assert {name: flag(container["args"], name) for name in expected} == expected
        # ZMQ binds 127.0.0.1: no container port, no Service port may name it.
        assert not {p["containerPort"] for p in container.get("ports", [])} & set(zmq.values())
    assert not {p["port"] for p in render.one("Service")["spec"]["ports"]} & set(zmq.values())


def test_each_process_exposes_its_own_port():
    render = helm_template()
    ports = {
        name: [(p["name"], p["containerPort"]) for p in c["ports"]]
        for name, c in render.containers.items()
    }
    assert ports == {
        "tokenizer": [("http", 30000)],
        "worker": [("worker-metrics", 30001)],
        "detokenizer": [("detok-metrics", 30002)],
    }
    args = render.containers["worker"]["args"]
    assert (
        flag(args, "port"),
        flag(args, "worker-metrics-port"),
        flag(args, "detokenizer-metrics-port"),
    ) == ("30000", "30001", "30002")
    # The API port is the server's default. The others have none (`radixserve serve` makes
    # ipc:// sockets and picks free metrics ports), so the chart sets every one: the probes
    # and the ServiceMonitor need fixed ports.
    assert Settings().port == 30000
    for name in PORT_FIELDS:
        assert flag(args, name.replace("_", "-")) is not None, name


def test_the_rendered_flags_are_accepted_by_the_servers_settings(render):
    settings = Settings.from_cli(render.containers["worker"]["args"], env={})
    assert settings.host == "0.0.0.0"


def test_engine_values_become_flags(all_on):
    args = all_on.containers["worker"]["args"]
    assert flag(args, "schedule-policy") == "lpm"
    assert flag(args, "schedule-conservativeness") == "1.3"
    assert flag(args, "chunked-prefill-size") == "none"
    assert flag(args, "radix-eviction-policy") == "slru"
    assert flag(args, "max-total-tokens") == "1000000"  # not 1e+06
    assert flag(args, "context-length") == "32768"
    assert "--no-disable-overlap-schedule" in args
    assert "--enable-mixed-chunk" in args
    settings = Settings.from_cli(args, env={})
    assert (settings.chunked_prefill_size, settings.disable_overlap_schedule) == (None, False)


def test_overlap_is_left_to_the_server_unless_set(default):
    assert not [a for a in default.containers["worker"]["args"] if "overlap" in a]


def test_only_the_worker_requests_gpus(default, cpu):
    containers = default.containers
    assert containers["worker"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for name in ("tokenizer", "detokenizer"):
        assert "nvidia.com/gpu" not in str(containers[name]["resources"])
    assert "nvidia.com/gpu" not in str(cpu.pod)
    assert (
        helm_template(sets={"worker.gpus": 4}).containers["worker"]["resources"]["limits"][
            "nvidia.com/gpu"
        ]
        == 4
    )


def test_containers_without_a_gpu_see_none(render):
    # An image or a runtime defaulting to NVIDIA_VISIBLE_DEVICES=all would hand them every GPU.
    assert render.env("tokenizer")["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert render.env("detokenizer")["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "NVIDIA_VISIBLE_DEVICES" not in render.env("worker")
    others = [*render.pod.get("initContainers", []), *render.one("Pod")["spec"]["containers"]]
    for container in others:
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"], container[
            "name"
        ]


def probe(container: dict, kind: str) -> tuple[str, int]:
    get = container[kind]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return get["path"], ports[get["port"]]


def test_probes_hit_each_processs_own_endpoint(render):
    tokenizer, worker, detokenizer = (render.containers[name] for name in CONTAINERS)
    assert probe(tokenizer, "readinessProbe") == ("/health", 30000)
    assert probe(tokenizer, "livenessProbe") == ("/healthz", 30000)
    assert probe(worker, "livenessProbe") == ("/healthz", 30001)
    assert probe(detokenizer, "livenessProbe") == ("/healthz", 30002)
    # Only the tokenizer decides readiness: the others are ready once started.
    assert "readinessProbe" not in worker and "readinessProbe" not in detokenizer


def test_the_worker_has_a_startup_probe_long_enough_for_a_slow_model_load(default):
    worker = default.containers["worker"]
    assert probe(worker, "startupProbe") == ("/healthz", 30001)
    budget = worker["startupProbe"]["periodSeconds"] * worker["startupProbe"]["failureThreshold"]
    assert budget >= 15 * 60


def test_service_links_are_off(render):
    # A Service named radixserve would otherwise set RADIXSERVE_PORT=tcp://..., read as --port.
    assert render.pod["enableServiceLinks"] is False
    assert render.one("Pod")["spec"]["enableServiceLinks"] is False


def test_every_container_runs_unprivileged_on_a_read_only_root(render):
    pod = render.pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    test_pod = render.one("Pod")["spec"]
    for container in [*pod["containers"], *pod.get("initContainers", []), *test_pod["containers"]]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["privileged"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]


def test_writable_paths_are_emptydirs_in_every_container(render):
    volumes = {v["name"]: v for v in render.pod["volumes"]}
    for container in render.containers.values():
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for path in ("/home/radixserve", "/var/cache/radixserve", "/tmp", "/dev/shm"):
            assert "emptyDir" in volumes[mounts[path]], path
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_the_embedded_model_needs_no_volume(default):
    assert "model" not in {v["name"] for v in default.pod["volumes"]}


@pytest.mark.parametrize(
    ("values", "volume"),
    [
        (
            {"model.source": "pvc", "model.pvc.claimName": "models"},
            {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        ),
        (
            {"model.source": "hostPath", "model.hostPath.path": "/data/llm"},
            {"hostPath": {"path": "/data/llm"}},
        ),
    ],
)
def test_a_model_volume_is_mounted_read_only_in_all_three(values, volume):
    render = helm_template(sets=values)
    assert {"name": "model", **volume} in render.pod["volumes"]
    for container in render.containers.values():
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container[
            "volumeMounts"
        ]


def test_a_hub_model_is_downloaded_by_an_init_container_with_the_token_secret(all_on):
    (init,) = all_on.pod["initContainers"]
    assert init["image"] == all_on.containers["worker"]["image"]
    assert init["command"][-3:] == [
        "Qwen/Qwen2.5-0.5B-Instruct",
        "main",
        "/models/Qwen/Qwen2.5-0.5B-Instruct",
    ]
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    } in init["env"]
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]  # writable here only
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "radixserve-models"},
    } in all_on.pod["volumes"]
    emptydir = helm_template(
        sets={"model.source": "huggingface", "model.huggingface.repoId": "a/b"}
    )
    assert {"name": "model", "emptyDir": {"sizeLimit": "50Gi"}} in emptydir.pod["volumes"]
    assert "HF_TOKEN" not in str(emptydir.pod["initContainers"][0]["env"])  # anonymous download


def test_graceful_drain_keeps_worker_and_detokenizer_up_while_the_tokenizer_drains(render):
    def pre_stop_sleep(name: str) -> int:
        command = render.containers[name]["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        return int(command[1])

    drain = VALUES["gracefulShutdown"]
    tokenizer = pre_stop_sleep("tokenizer")
    assert tokenizer == drain["endpointDelaySeconds"]
    for name in ("worker", "detokenizer"):
        assert pre_stop_sleep(name) == tokenizer + drain["streamDrainSeconds"]
    assert (
        render.pod["terminationGracePeriodSeconds"]
        == pre_stop_sleep("worker") + drain["exitSeconds"]
    )


def test_the_tokenizer_drains_streams_for_as_long_as_the_others_wait_for_it(default):
    drain = VALUES["gracefulShutdown"]["streamDrainSeconds"]
    args = default.containers["tokenizer"]["args"]
    assert f"--graceful-shutdown-timeout={drain}" in args


def test_one_gpu_cannot_surge_so_the_default_strategy_is_recreate(default, cpu):
    assert default.one("Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert default.one("Deployment")["spec"]["replicas"] == 1


def test_scheduling_values_reach_the_pod(default, cpu, all_on):
    assert default.pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert "tolerations" not in cpu.pod
    pod = all_on.pod
    all_on_values = yaml.safe_load(ALL_ON_VALUES.read_text())
    assert pod["nodeSelector"] == all_on_values["nodeSelector"]
    assert pod["affinity"] == all_on_values["affinity"]
    assert (pod["runtimeClassName"], pod["priorityClassName"]) == ("nvidia", "gpu-inference")
    assert pod["imagePullSecrets"] == [{"name": "registry"}]


def test_the_image_tag_follows_the_variant(default, cpu):
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert default.containers["worker"]["image"] == f"radixserve:{app_version}-cuda"
    assert cpu.containers["worker"]["image"] == f"radixserve:{app_version}-cpu"


def test_the_cpu_values_run_the_embedded_model_without_a_gpu(cpu):
    assert flag(cpu.containers["worker"]["args"], "model") == "embedded"
    assert "nvidia.com/gpu" not in str(cpu.docs)
    assert yaml.safe_load(CPU_VALUES.read_text())["image"]["variant"] == "cpu"


def test_the_api_key_comes_from_a_secret(default, all_on):
    secret = {"secretKeyRef": {"name": "radixserve-api-key", "key": "api-key"}}
    assert all_on.env("tokenizer")["RADIXSERVE_API_KEY"] == secret
    test_env = {
        e["name"]: e.get("valueFrom") for e in all_on.one("Pod")["spec"]["containers"][0]["env"]
    }
    assert test_env["API_KEY"] == secret
    assert "RADIXSERVE_API_KEY" not in default.env("tokenizer")


def test_the_service_selects_the_server_pods_only(render):
    selector = render.one("Service")["spec"]["selector"]
    labels = render.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert not selector.items() <= render.one("Pod")["metadata"]["labels"].items()
    assert render.one("Service")["metadata"]["name"] == FULLNAME


# ----- the authenticated wire and the key Secrets -------------------------------------------------


def wire_volume(render) -> dict:
    return next(v for v in render.pod["volumes"] if v["name"] == "wire-keys")


def test_by_default_an_init_container_makes_fresh_wire_keys_in_memory_that_all_three_read(default):
    init = {c["name"]: c for c in default.pod["initContainers"]}["wire-keys"]
    keys_dir = flag(default.containers["worker"]["args"], "ipc-keys-dir")
    assert init["command"] == ["radixserve", "keys", keys_dir]
    assert {"name": "wire-keys", "mountPath": "/etc/radixserve/wire"} in init["volumeMounts"]
    assert keys_dir.startswith("/etc/radixserve/wire/")  # a subdirectory it can make 0700
    assert wire_volume(default)["emptyDir"]["medium"] == "Memory"
    for name in CONTAINERS:
        mounts = default.containers[name]["volumeMounts"]
        assert {
            "name": "wire-keys",
            "mountPath": "/etc/radixserve/wire",
            "readOnly": True,
        } in mounts


def test_wire_keys_from_a_secret_replace_the_init_container(all_on):
    assert "wire-keys" not in [c["name"] for c in all_on.pod.get("initContainers", [])]
    assert wire_volume(all_on)["secret"] == {"secretName": "radixserve-wire", "defaultMode": 0o440}
    assert flag(all_on.containers["worker"]["args"], "ipc-keys-dir") == "/etc/radixserve/wire"
    only_secret = helm_template(sets={"wire.keysSecret": "w"})
    assert "initContainers" not in only_secret.pod


def test_the_api_key_file_and_the_admin_key_come_from_their_secrets(default, all_on):
    args = all_on.containers["tokenizer"]["args"]
    assert flag(args, "api-key-file") == "/etc/radixserve/auth/api-keys"
    volume = next(v for v in all_on.pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "radixserve-api-keys", "defaultMode": 0o440}
    mount = {"name": "api-keys", "mountPath": "/etc/radixserve/auth", "readOnly": True}
    assert mount in all_on.containers["tokenizer"]["volumeMounts"]
    admin = {"secretKeyRef": {"name": "radixserve-admin-key", "key": "admin-api-key"}}
    assert all_on.env("tokenizer")["RADIXSERVE_ADMIN_API_KEY"] == admin
    assert "RADIXSERVE_ADMIN_API_KEY" not in all_on.env("worker")
    assert flag(default.containers["tokenizer"]["args"], "api-key-file") is None
    assert "RADIXSERVE_ADMIN_API_KEY" not in default.env("tokenizer")
