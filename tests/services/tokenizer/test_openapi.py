"""The OpenAPI document (`/openapi.json`) and its explorer (`/docs`), from the app in
process: every body a handler parses is declared with the very model it validates with, and
every route declares OpenAI's error body for its 4xx and 5xx."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.routing import APIRoute

from services.settings import Settings
from services.tokenizer.protocol.chat import ChatCompletionRequest
from services.tokenizer.protocol.common import ErrorResponse
from services.tokenizer.routes import router
from tests.services.tokenizer.conftest import InProcessApp


@pytest.fixture
def app(make_app: Any) -> InProcessApp:
    """A server that serves every route, run-time LoRA updates included."""
    return make_app(Settings(model="m", enable_lora_runtime_update=True))


@pytest.fixture
def document(app: InProcessApp) -> dict[str, Any]:
    response = app.request("GET", "/openapi.json")
    assert response.status_code == 200
    return response.json()


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema["$ref"]
    assert ref.startswith("#/components/schemas/"), ref
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_every_post_route_declares_a_json_body_whose_schema_is_in_the_document(
    document: dict[str, Any],
):
    posts = [r for r in router.routes if isinstance(r, APIRoute) and "POST" in r.methods]
    bodiless = {"/flush_cache"}
    for route in posts:
        operation = document["paths"][route.path_format]["post"]
        if route.path in bodiless:
            assert "requestBody" not in operation
            continue
        body = operation["requestBody"]
        assert body["required"] is True, route.path
        schema = body["content"]["application/json"]["schema"]
        for ref in schema.get("anyOf", [schema]):
            assert _resolve(document, ref)["type"] == "object", route.path


def test_a_body_schema_is_the_handlers_model_with_its_refusals_and_role_rules(
    document: dict[str, Any],
):
    schema = _resolve(
        document,
        document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
            "application/json"
        ]["schema"],
    )
    assert schema["required"] == ["messages"]
    assert set(schema["properties"]) == set(ChatCompletionRequest.model_fields)
    assert schema["properties"]["best_of"]["enum"] == [None, 1]  # refused unless 1
    message = document["components"]["schemas"]["ChatCompletionMessageParam"]
    tool = next(v for v in message["anyOf"] if v["properties"]["role"].get("const") == "tool")
    assert tool["required"] == ["tool_call_id"]


def test_every_route_declares_openai_errors(document: dict[str, Any]):
    error = document["components"]["schemas"]["ErrorResponse"]
    info = _resolve(document, error["properties"]["error"])
    assert set(info["properties"]) == set(
        ErrorResponse.model_fields["error"].annotation.model_fields
    )  # type: ignore[union-attr]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status in ("4XX", "5XX"):
                schema = operation["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)


def test_streams_are_declared_beside_the_json_answer(document: dict[str, Any]):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path


def test_docs_serve_the_explorer_of_the_document(app: InProcessApp):
    response = app.request("GET", "/docs")
    assert response.status_code == 200 and "text/html" in response.headers["content-type"]
    assert "/openapi.json" in response.text


def test_disable_openapi_serves_neither(make_app: Any):
    app = make_app(Settings(model="m", disable_openapi=True))
    for path in ("/openapi.json", "/docs"):
        response = app.request("GET", path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_the_document_describes_this_server_lora_routes_and_model_ids_as_configured(
    make_app: Any,
):
    static = make_app(Settings(model="m", served_model_name="smol", lora_paths="a=/x/a"))
    document = static.request("GET", "/openapi.json").json()
    assert not {"/load_lora_adapter", "/v1/unload_lora_adapter"} & set(document["paths"])
    (model_id,) = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert model_id["schema"]["enum"] == ["smol", "a"]


def test_with_run_time_lora_updates_their_routes_are_declared_and_model_ids_open(
    document: dict[str, Any],
):
    assert {"/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(document["paths"])
    (model_id,) = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert "enum" not in model_id["schema"]
