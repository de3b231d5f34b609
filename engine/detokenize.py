"""Incremental detokenization with stop-string trimming (shared by the detokenizer service
and the offline Engine).

Decoding token by token breaks multi-byte characters and merges; instead each step
decodes a short window (`prefix_offset:`) and emits only what extends the text decoded so
far, holding back an incomplete UTF-8 sequence ("\\ufffd") until the next token completes it.
Text that could still become a stop string is held back too, so a stream never shows a
stop string that the final text trims. Neither the decoding nor the stop-string search
goes back over the output already sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    """What is read of a Hugging Face tokenizer. Its `decode` is typed for a batch of id
    lists too (hence `list[str]`); a flat id list decodes to one string."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def decode_text(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """`tokenizer.decode` of one flat id list: one string."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "a flat id list decodes to one string"
    return text


class StopStringMatcher:
    """Finds which of a request's stop strings its output now contains, the scheduler's
    stop check after each token. Only the decoded tail is searched: a stop string of n
    characters spans at most n tokens, plus one whose bytes only complete a character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def match(
        self, output_ids: list[int], stop: Sequence[str], skip_special_tokens: bool, then: str = ""
    ) -> str | None:
        """The first of `stop` found in the output's decoded tail followed by `then` (text
        about to be appended, e.g. a grammar's forced text), if any."""
        tail = output_ids[-(max(len(s) for s in stop) + 1) :]
        text = decode_text(self.tokenizer, tail, skip_special_tokens) + then
        return next((s for s in stop if s in text), None)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        """All text decoded so far (stop strings not yet trimmed)."""
        self.sent = 0
        """How much of `text` has been emitted."""

    def add_tokens(self, new_ids: Sequence[int], finished: bool = False) -> str:
        """Append tokens; return the text that is now safe to emit."""
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._emit(finished)

    def rollback(self, num_tokens: int) -> None:
        """Drop the last `num_tokens` ids: a grammar jump-forward re-encoded them together
        with the forced text. Their replacements decode to the same text and more, so what
        was already emitted stays a prefix of the output; the text is rebuilt from the ids
        that remain (jump-forward only rolls back to a character boundary)."""
        del self.token_ids[len(self.token_ids) - num_tokens :]
        if self.read_offset > len(self.token_ids):
            self.prefix_offset = self.read_offset = len(self.token_ids)
            self.text = self._decode(self.token_ids)

    def _emit(self, finished: bool) -> str:
        end = len(self.text)
        for stop in self.stop:
            # Only the text from the end of what was sent can hold a stop string for the
            # first time: a stop reaching into sent text would have been held back whole.
            hit = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if hit != -1:
                end = min(end, hit)
                finished = True
        if not finished:
            end = min(end, self._safe_end())
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def final_text(self) -> str:
        """The whole output with the first stop string and what follows it removed."""
        cuts = [i for i in (self.text.find(s) for s in self.stop) if i != -1]
        return self.text[: min(cuts)] if cuts else self.text

    def _safe_end(self) -> int:
        """Hold back the longest tail that is a proper prefix of some stop string."""
        end = len(self.text)
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:n]):
                    end = min(end, len(self.text) - n)
                    break
        return end

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids, self.skip_special_tokens)
