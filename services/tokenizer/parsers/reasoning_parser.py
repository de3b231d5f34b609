"""Reasoning parsers (`--reasoning-parser`, SGLang's and vLLM's names): they split a
thinking model's `<think>…</think>` section from its answer, into OpenAI-style
`reasoning_content` and `content`.

`deepseek_r1`: the chat template opens the section, so the output starts inside it, with or
without a `<think>` of its own, and everything up to `</think>` is reasoning. `qwen3`: the
model opens the section itself; an output that does not start with `<think>` has none. A
request that turns thinking off (`enable_thinking: false`) has no section either. The
reasoning is given without its surrounding whitespace, the answer without the whitespace
that follows `</think>`; an output cut off inside the section is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.tokenizer.parsers._text import held_back


@dataclass(frozen=True)
class ReasoningFormat:
    """A parser's markers, and whether outputs start inside the reasoning section."""

    think_start: str
    think_end: str
    starts_in_reasoning: bool


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
}
"""name -> format; `think_end` is where a grammar that constrains only the answer starts."""


class ReasoningParser:
    """Splits one output, whole (`parse`) or as it streams (`feed` each text delta, then
    `finish`); the streamed deltas concatenate to what `parse` returns. `starts_in_reasoning`
    overrides the format's default, as for a template that opens the section itself."""

    def __init__(
        self, name: str, starts_in_reasoning: bool | None = None, *, enable_thinking: bool = True
    ) -> None:
        try:
            fmt = REASONING_PARSERS[name]
        except KeyError:
            known = ", ".join(sorted(REASONING_PARSERS))
            raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
        self.name = name
        self.think_start, self.think_end = fmt.think_start, fmt.think_end
        self.starts_in_reasoning = (
            fmt.starts_in_reasoning if starts_in_reasoning is None else starts_in_reasoning
        )
        self.enable_thinking = enable_thinking
        self._state = "start" if enable_thinking else "content"
        self._buffer = ""
        self._reasoning_seen = False
        self._pending = ""
        self._strip_content = False

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output, None where empty; leaves this
        parser's stream as it was."""
        whole = ReasoningParser(
            self.name, self.starts_in_reasoning, enable_thinking=self.enable_thinking
        )
        reasoning, content = whole.feed(text)
        rest_reasoning, rest_content = whole.finish()
        return (reasoning + rest_reasoning) or None, (content + rest_content) or None

    def feed(self, delta: str) -> tuple[str, str]:
        """The (reasoning, content) text that `delta` settles, "" where none: text that may
        be the start of a marker waits for the next delta."""
        self._buffer += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) text still held back, once the output has ended."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, str]:
        """The states are `start` (an opening marker may still come), `reasoning` and
        `content`."""
        if self._state == "start":
            head = self._buffer.lstrip()
            if not final and self.think_start.startswith(head):
                return "", ""
            if head.startswith(self.think_start):
                self._buffer, self._state = head[len(self.think_start) :], "reasoning"
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "content"
        reasoning = ""
        if self._state == "reasoning":
            end = self._buffer.find(self.think_end)
            if end < 0:
                cut = len(self._buffer)
                if not final:
                    cut -= held_back(self._buffer, self.think_end)
                reasoning, self._buffer = self._reasoning(self._buffer[:cut]), self._buffer[cut:]
                return reasoning, ""
            reasoning = self._reasoning(self._buffer[:end])
            self._buffer = self._buffer[end + len(self.think_end) :]
            self._state, self._strip_content = "content", True
        if self._strip_content:
            self._buffer = self._buffer.lstrip()
            self._strip_content = not self._buffer
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def _reasoning(self, piece: str) -> str:
        """The reasoning text `piece` settles: whitespace before the first reasoning text is
        dropped, and trailing whitespace waits for more text, since at the section's end it
        is dropped too."""
        if not self._reasoning_seen:
            piece = piece.lstrip()
        body = piece.rstrip()
        if not body:
            self._pending += piece
            return ""
        self._reasoning_seen = True
        text, self._pending = self._pending + body, piece[len(body) :]
        return text
