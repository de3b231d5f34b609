"""Every failure a client sees, as OpenAI's error body: what was wrong, the field it names
and a code, never a traceback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.tokenizer.protocol.common import ErrorInfo, ErrorResponse

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

_VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
    "unsupported": "unsupported_parameter",
}
"""OpenAI-style codes for the pydantic error types that have one of their own."""


class RequestError(Exception):
    """A failure the client should see: what OpenAI's error body needs, never a traceback."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = "invalid_value",
        status: int = 400,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def error_body(err: RequestError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`; `type` follows OpenAI's split
    between the client's fault and the server's."""
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return ErrorResponse(
        error=ErrorInfo(message=err.message, type=kind, param=err.param, code=err.code)
    ).model_dump()


def validation_error_body(exc: ValidationError | RequestValidationError) -> dict[str, Any]:
    """The first validation error as a 400 body naming the field (`messages[0].role`).

    FastAPI's errors are located under `body`; malformed JSON is located at a character
    offset, which names no field.
    """
    error = exc.errors()[0]
    loc = tuple(error["loc"])
    if loc[:1] == ("body",):
        loc = loc[1:]
    param = _dotted(loc) if loc and isinstance(loc[0], str) else None
    cause = (error.get("ctx") or {}).get("error")
    reason = str(cause) if error["type"] == "value_error" and cause is not None else error["msg"]
    code = _VALIDATION_CODES.get(error["type"]) or (
        "invalid_type" if error["type"].endswith("_type") else "invalid_value"
    )
    return error_body(
        RequestError(f"{param}: {reason}" if param else reason, param=param, code=code)
    )


def _dotted(loc: Sequence[str | int]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
