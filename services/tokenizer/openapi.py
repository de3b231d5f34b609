"""The API's OpenAPI document (`/openapi.json`, rendered at `/docs`), typed from the same
pydantic models the handlers validate with.

The handlers parse their bodies themselves (`serving_base.parse_body`: strict JSON, OpenAI's
error body), so FastAPI sees no body parameter; each route declares its body with
`request_body` instead, and `document` adds the models' schemas to the components. Every
route answers errors in OpenAI's shape (`ERROR_RESPONSES`)."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.settings import Settings
from services.tokenizer.protocol.common import ErrorResponse

_COMPONENTS = "#/components/schemas/{model}"
_REQUEST_MODELS: dict[str, type[BaseModel]] = {}
"""Every model a route declared as its body, by component name."""

_ERROR_BODY = {"application/json": {"schema": {"$ref": _COMPONENTS.format(model="ErrorResponse")}}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {
        "description": "The request is refused; `param` names the field",
        "content": _ERROR_BODY,
    },
    "5XX": {"description": "The server or one of its processes failed", "content": _ERROR_BODY},
}
"""What every route may answer besides its success: OpenAI's error body (JSON, whatever
the route's own media type)."""


def answers(model: type[BaseModel] | None, description: str) -> dict[int | str, Any]:
    """A generation route's success: `model` as JSON, or server-sent events (`stream`)."""
    events: dict[str, Any] = {"text/event-stream": {}}
    return {200: {"description": description, "content": events, "model": model}}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: a JSON body of one of `models` (in validation mode: what
    the handler accepts, not what it would send)."""
    for model in models:
        _REQUEST_MODELS[model.__name__] = model
    refs = [{"$ref": _COMPONENTS.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


LORA_UPDATE_PATHS = (
    "/load_lora_adapter",
    "/v1/load_lora_adapter",
    "/unload_lora_adapter",
    "/v1/unload_lora_adapter",
)
"""Served only with `--enable-lora-runtime-update`; without it they refuse every body."""


def document(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's document of `app` with the request bodies' schemas added (built once),
    describing this server as configured: without run-time LoRA updates their routes are
    left out, and the model ids are the fixed set it serves."""
    if app.openapi_schema is None:
        openapi = get_openapi(
            title=app.title,
            version=version("radixserve"),
            summary="OpenAI-compatible and SGLang-native LLM serving (docs/api.md)",
            routes=app.routes,
        )
        models = [(model, "validation") for model in (*_REQUEST_MODELS.values(), ErrorResponse)]
        _, defs = models_json_schema(models, ref_template=_COMPONENTS)  # type: ignore[arg-type]
        schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs.get("$defs", {}))
        if not settings.enable_lora_runtime_update:
            for path in LORA_UPDATE_PATHS:
                openapi["paths"].pop(path, None)
            card = openapi["paths"]["/v1/models/{model_id}"]["get"]
            (model_id,) = card["parameters"]
            model_id["schema"]["enum"] = [settings.model_id, *settings.lora_entries()]
        app.openapi_schema = openapi
    return app.openapi_schema
