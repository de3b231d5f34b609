"""Why a request stopped: one definition for the engine and the wire. Torch-free, like the
wire's message types that carry it, so that the tokenizer and detokenizer decode it without
importing the engine's model code (torch reaches them only through transformers, and the
tokenizer's grammar checks; tests/services/test_service_imports.py); a msgspec struct, so
that the worker sends the engine's own value as is."""

from __future__ import annotations

import msgspec


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request stopped, in OpenAI's words: "stop", "length" or "abort"."""

    type: str
    matched: int | str | None = None
    """The stop token id or stop string that ended it."""
    message: str | None = None
    """For "abort": what went wrong, for the client."""
    status_code: int | None = None
    """For "abort": the HTTP status a server answers with (400 when the worker rejected the
    request at submission, e.g. it can never fit the KV pool; None: a server error, 500)."""


def text_ids(ids: list[int], reason: FinishReason | None) -> list[int]:
    """The ids whose text is shown, from the output's last ids: a matched stop token ended
    the output and is not part of its text (a matched stop string is, and is cut from the
    text by the detokenizer)."""
    return ids[:-1] if reason is not None and isinstance(reason.matched, int) and ids else ids
