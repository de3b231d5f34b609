"""Scanning helpers shared by the parsers, which read text that arrives in pieces."""

from __future__ import annotations

import json
from typing import Any

JSON_WHITESPACE = " \t\n\r"
"""The whitespace JSON allows between tokens (`str.isspace` admits more)."""


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: a streaming
    parser keeps them until the next piece says whether the marker follows."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def skip_json_whitespace(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in JSON_WHITESPACE:
        pos += 1
    return pos


def compact_json(value: Any) -> str | None:
    """`value` as compact, strict JSON (no NaN or Infinity), or None where it has none.

    Non-ASCII text is kept as is, unless it holds lone surrogates, which UTF-8 cannot carry:
    those are escaped.
    """
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text
