"""Server-sent events: the one place where a stream's typed chunks become text, last, at
the edge (`frame`).

Endpoints stream chunk values (`Chunk`): a pydantic chunk or a native answer, framed as
`data: <json>`; a `NamedEvent`, with its `event:` line (the Responses API's); or a
`TextDelta`, the per-token hot path. Most events of a stream are a plain text delta of a
choice already opened: a chunk whose only varying part is the text. `DeltaEvents` encodes
such a chunk once per choice through the stream's own code (so the bytes are the full
chunk's by construction) with a marker for the text, keeps what comes before and after it,
and then frames each delta as prefix + the JSON-escaped text + suffix: the id, model,
object and field names already sent are never encoded again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

from pydantic import BaseModel

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every OpenAI and native stream."""

_MARKER = "rs-sse-text-marker-7f3a"
"""Stands for the text in the template chunk; plain ASCII, so JSON leaves it as is."""


@dataclass(slots=True)
class TextDelta:
    """New text of a choice its stream has already opened, with no logprobs and nothing
    parsed out of it: the full chunk its stream's `text_chunk` builds, carried as its two
    varying values. Made per token, so it is the cheapest class to make (not frozen)."""

    index: int
    text: str


@dataclass(frozen=True)
class NamedEvent:
    """An event named on a line of its own (`event: <name>`), as the Responses API sends
    them. `data` is not changed once the event is made."""

    name: str
    data: dict[str, Any]


Chunk = BaseModel | dict[str, Any] | TextDelta | NamedEvent
"""What an endpoint streams, before framing."""


def sse_event(obj: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: `data: <json>` and a blank line. NaN and infinities are
    refused (ValueError), as in a JSON response: they are not JSON."""
    return f"data: {_json(obj)}\n\n"


def _json(obj: BaseModel | dict[str, Any]) -> str:
    if isinstance(obj, BaseModel):
        return obj.model_dump_json()
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def json_string_body(text: str) -> str:
    """`text` as the inside of a JSON string, escaped as pydantic's encoder escapes it
    (UTF-8 kept, control characters as \\u00XX): `json.dumps(text, ensure_ascii=False)`'s
    own escaping, without the encoder it builds per call."""
    return encode_basestring(text)[1:-1]


class DeltaEvents:
    """The events of one stream's `TextDelta`s, from templates made once per choice out of
    `text_chunk` (the stream's full chunk for a delta)."""

    def __init__(self, text_chunk: Callable[[TextDelta], BaseModel]):
        self.text_chunk = text_chunk
        self.templates: dict[int, tuple[str, str]] = {}

    def encode(self, delta: TextDelta) -> str:
        """`sse_event(text_chunk(delta))`, without encoding the chunk."""
        template = self.templates.get(delta.index)
        if template is None:
            event = sse_event(self.text_chunk(TextDelta(delta.index, _MARKER)))
            prefix, suffix = event.split(_MARKER)
            template = self.templates[delta.index] = (prefix, suffix)
        return template[0] + json_string_body(delta.text) + template[1]


def frame(chunks: Sequence[Chunk], deltas: DeltaEvents | None = None) -> str:
    """`chunks` as the text of their events, written together; `deltas` encodes the
    `TextDelta`s of a stream that has them."""
    if len(chunks) == 1 and isinstance(chunks[0], TextDelta):  # the per-token hot path
        assert deltas is not None, "a stream of text deltas has their encoder"
        return deltas.encode(chunks[0])
    events: list[str] = []
    for chunk in chunks:
        if isinstance(chunk, TextDelta):
            assert deltas is not None, "a stream of text deltas has their encoder"
            events.append(deltas.encode(chunk))
        elif isinstance(chunk, NamedEvent):
            events.append(f"event: {chunk.name}\ndata: {_json(chunk.data)}\n\n")
        else:
            events.append(sse_event(chunk))
    return "".join(events)
