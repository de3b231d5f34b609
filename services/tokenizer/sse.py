"""Pre-encoded stream chunks: the per-token hot path of a streamed chat or completion.

Most events of a stream are a plain text delta of a choice already opened: a chunk whose
only varying part is the text. `DeltaEvents` encodes such a chunk once per choice through
the stream's own code (`_Stream.delta`, so the bytes are the slow path's by construction)
with a marker for the text, keeps what comes before and after it, and then frames each
delta as prefix + the JSON-escaped text + suffix: the id, model, object and field names
already sent are never encoded again.
"""

from __future__ import annotations

import json

from services.tokenizer.responses import ChatCompletionStream, CompletionStream

_MARKER = "rs-sse-text-marker-7f3a"
"""Stands for the text in the template chunk; plain ASCII, so JSON leaves it as is."""


def json_string_body(text: str) -> str:
    """`text` as the inside of a JSON string, escaped as pydantic's encoder escapes it
    (UTF-8 kept, control characters as \\u00XX)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class DeltaEvents:
    """Text-delta events of one stream's choices, from templates made once per choice."""

    def __init__(self, stream: ChatCompletionStream | CompletionStream):
        self.stream = stream
        self.templates: dict[int, tuple[str, str]] = {}

    def delta(self, index: int, text: str) -> list[str]:
        """The events of `stream.delta(index, text)` for a choice already opened, with no
        logprobs and no parsed message (the caller checks): one event, none for ""."""
        if not text:
            return []
        template = self.templates.get(index)
        if template is None:
            template = self.templates[index] = self._template(index)
        stream = self.stream
        stream.text_offsets[index] += len(text)
        return [template[0] + json_string_body(text) + template[1]]

    def _template(self, index: int) -> tuple[str, str]:
        stream = self.stream
        scratch = type(stream)(stream.header, n=stream.n, include_usage=stream.include_usage)
        scratch.text_offsets[index] = 0  # opened: no role chunk
        (event,) = scratch.delta(index, _MARKER)
        prefix, suffix = event.split(_MARKER)
        return prefix, suffix
