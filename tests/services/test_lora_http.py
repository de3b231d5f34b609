"""Multi-LoRA serving over HTTP, on real processes: adapters given at start and loaded at run
time, picked by `model` (or `lora_path` on `/generate`), listed by `/v1/models`, kept apart
in the radix cache, refused with OpenAI's error body, and counted in the metrics. The
adapters are small random PEFT adapters of the tiny Llama (`testing/lora.py`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from testing.launcher import ServiceLauncher, cpu_flags
from testing.lora import make_adapter
from testing.net import assert_idle_and_whole, wait_until

API_KEY = "lora-user-key"
ADMIN_KEY = "lora-admin-key"
MODEL = "lora-base"
MAX_LORA_RANK = 8
PROMPT = "The quick brown fox jumps over the lazy dog and then it"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
NATIVE_GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
STREAM_TOKENS = 48
"""Long enough for the streams to outlast two loads and unloads of another adapter."""


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three good adapters under one root (a, b given at start; c loaded at run time) and
    one over the rank limit."""
    root = tmp_path_factory.mktemp("lora-root")
    specs = {
        "a": (4, 1, ["q_proj", "v_proj"]),
        "b": (8, 2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        "c": (2, 3, ["o_proj", "down_proj"]),
        "too-big": (4 * MAX_LORA_RANK, 4, ["q_proj"]),
    }
    return {
        name: make_adapter(tiny_llama_dir, root / name, rank, seed, targets)
        for name, (rank, seed, targets) in specs.items()
    }


@pytest.fixture(scope="module")
def base_url(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("lora-logs"))
    flags = [
        *cpu_flags(8192, tiny_llama_dir),
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--admin-api-key",
        ADMIN_KEY,
        "--lora-paths",
        f"a={adapters['a']},b={adapters['b']}",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--max-loras-per-batch",
        "2",
        "--enable-lora-runtime-update",
    ]
    with launcher.serve(flags, timeout=180) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx2.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx2.Client(base_url=base_url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def admin(base_url: str) -> Iterator[httpx2.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx2.Client(base_url=base_url, headers=headers, timeout=60) as client:
        yield client


def complete(
    http: httpx2.Client, model: str, prompt: str = PROMPT, max_tokens: int = 8
) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, **GREEDY, "max_tokens": max_tokens}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def assert_error(response: httpx2.Response, status: int, code: str, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]


def models(http: httpx2.Client) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


# ----- serving ---------------------------------------------------------------------------


def test_models_lists_each_adapter_with_the_base_model_as_parent(http: httpx2.Client):
    cards = models(http)
    assert set(cards) >= {MODEL, "a", "b"}
    assert cards["a"]["parent"] == cards["b"]["parent"] == MODEL
    assert "parent" not in cards[MODEL]
    assert http.get("/v1/models/a").json()["parent"] == MODEL


def test_a_request_picks_its_adapter_by_model_or_lora_path(http: httpx2.Client):
    base, a, b = (complete(http, m) for m in (MODEL, "a", "b"))
    assert len({text_of(base), text_of(a), text_of(b)}) == 3, "each adapter changes the output"
    assert a["model"] == "a" and base["model"] == MODEL
    assert text_of(complete(http, "a")) == text_of(a)
    native = http.post(
        "/generate",
        json={"text": PROMPT, "lora_path": "a", "sampling_params": NATIVE_GREEDY},
    )
    assert native.status_code == 200, native.text
    assert native.json()["text"] == text_of(a)


def test_an_unknown_adapter_is_a_404_model_not_found(http: httpx2.Client):
    unknown = http.post("/v1/completions", json={"model": "nope", "prompt": "hi", **GREEDY})
    assert_error(unknown, 404, "model_not_found", "model")
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert_error(chat, 404, "model_not_found", "model")
    native = http.post("/generate", json={"text": "hi", "lora_path": "nope"})
    assert_error(native, 404, "model_not_found", "lora_path")
    assert_error(http.get("/v1/models/nope"), 404, "model_not_found", "model")
    assert text_of(complete(http, "a"))  # still serving


def test_adapters_share_no_prefix_and_one_adapter_reuses_its_own(http: httpx2.Client):
    prompt = "Namespaces keep every adapter's prefixes to itself, however long the prompt"
    first = complete(http, "a", prompt)
    assert cached(complete(http, "b", prompt)) == 0
    assert cached(complete(http, MODEL, prompt)) == 0
    again = complete(http, "a", prompt)
    assert cached(again) >= first["usage"]["prompt_tokens"] - 1
    assert text_of(again) == text_of(first)


# ----- loading and unloading ------------------------------------------------------------


def test_load_serve_list_and_unload_at_run_time(
    http: httpx2.Client, admin: httpx2.Client, adapters: dict[str, Path]
):
    loaded = admin.post(
        "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}
    )
    assert loaded.status_code == 200 and loaded.json()["success"] is True, loaded.text
    assert models(http)["c"]["parent"] == MODEL
    c = complete(http, "c")
    assert text_of(c) != text_of(complete(http, MODEL))
    unloaded = admin.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert unloaded.status_code == 200, unloaded.text
    assert "c" not in models(http)
    gone = http.post("/v1/completions", json={"model": "c", "prompt": PROMPT, **GREEDY})
    assert_error(gone, 404, "model_not_found", "model")
    reloaded = admin.post(
        "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}
    )
    assert reloaded.status_code == 200, reloaded.text
    assert text_of(complete(http, "c")) == text_of(c)
    assert admin.post("/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert_idle_and_whole(admin)


def test_bad_loads_are_a_400_and_change_nothing(
    http: httpx2.Client, admin: httpx2.Client, adapters: dict[str, Path], tmp_path: Path
):
    before = text_of(complete(http, "a"))
    over_rank = {"lora_name": "big", "lora_path": str(adapters["too-big"])}
    outside_root = {"lora_name": "x", "lora_path": str(tmp_path)}
    missing = {"lora_name": "y", "lora_path": str(adapters["a"].parent / "missing")}
    for body in (over_rank, outside_root, missing):
        response = admin.post("/load_lora_adapter", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["message"]
    taken = admin.post(
        "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["c"])}
    )
    assert_error(taken, 400, "invalid_value", "lora_name")
    base_name = admin.post("/load_lora_adapter", json={"lora_name": MODEL, "lora_path": "x"})
    assert_error(base_name, 400, "invalid_value", "lora_name")
    unknown = admin.post("/unload_lora_adapter", json={"lora_name": "nope"})
    assert_error(unknown, 404, "model_not_found", "lora_name")
    assert set(models(http)) == {MODEL, "a", "b"}
    assert text_of(complete(http, "a")) == before


def test_loading_needs_the_admin_key(http: httpx2.Client, adapters: dict[str, Path]):
    body = {"lora_name": "c", "lora_path": str(adapters["c"])}
    assert_error(http.post("/load_lora_adapter", json=body), 403, "admin_key_required", None)
    denied = http.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert_error(denied, 403, "admin_key_required", None)
    assert "c" not in models(http) and "a" in models(http)


def test_unloading_an_adapter_in_use_is_a_409(http: httpx2.Client, admin: httpx2.Client):
    long = {"model": "a", "prompt": PROMPT, "temperature": 0, "max_tokens": 400, "ignore_eos": True}
    done = threading.Event()
    answers: list[httpx2.Response] = []

    def run() -> None:
        answers.append(http.post("/v1/completions", json=long))
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: _running(admin) > 0, 30, "the request to run")
    refused = admin.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert_error(refused, 409, "lora_adapter_in_use", "lora_name")
    thread.join(60)
    assert done.is_set() and answers[0].status_code == 200
    assert answers[0].json()["usage"]["completion_tokens"] == 400
    assert "a" in models(http)
    assert_idle_and_whole(admin)


def _running(admin: httpx2.Client) -> int:
    info = admin.get("/get_server_info").json()
    return int(info["num_running_reqs"] + info["num_waiting_reqs"])


def test_loading_and_unloading_a_third_adapter_leaves_16_streams_unchanged(
    http: httpx2.Client, admin: httpx2.Client, base_url: str, adapters: dict[str, Path]
):
    prompts = [f"{PROMPT} number {i}" for i in range(16)]
    names = ["a" if i % 2 else "b" for i in range(16)]
    expected = [text_of(complete(http, m, p, STREAM_TOKENS)) for m, p in zip(names, prompts)]
    got: dict[int, str] = {}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def stream(i: int) -> None:
        body = {"model": names[i], "prompt": prompts[i], "stream": True, **GREEDY}
        body["max_tokens"] = STREAM_TOKENS
        with httpx2.Client(base_url=base_url, headers=headers, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                got[i] = _streamed_text(response)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    c = {"lora_name": "c", "lora_path": str(adapters["c"])}
    for _ in range(2):
        assert admin.post("/load_lora_adapter", json=c).status_code == 200
        assert text_of(complete(http, "c"))
        assert admin.post("/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    for thread in threads:
        thread.join(120)
    assert sorted(got) == list(range(16))
    for i in range(16):
        assert got[i] == expected[i], (i, names[i], got[i], expected[i])
    assert_idle_and_whole(admin)


def _streamed_text(response: httpx2.Response) -> str:
    text = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            text.extend(choice["text"] for choice in event["choices"])
    return "".join(text)


# ----- metrics --------------------------------------------------------------------------


def test_metrics_show_the_adapter_sets_and_per_adapter_counts(http: httpx2.Client):
    complete(http, "b")
    text = http.get("/metrics").text
    info = [line for line in text.splitlines() if line.startswith("radixserve_lora_requests_info{")]
    assert len(info) == 1, text
    assert 'max_lora="2"' in info[0] and "running_lora_adapters=" in info[0]
    assert "waiting_lora_adapters=" in info[0]
    assert float(info[0].rsplit(" ", 1)[1]) > 1.7e9  # a unix time
    counts = {
        line.split('lora_name="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("radixserve_lora_requests_total{")
    }
    assert counts.get("a", 0) >= 1 and counts.get("b", 0) >= 1, counts
