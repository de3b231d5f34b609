"""JSON-schema grammars whose strings all parse as strict JSON.

Tool-call arguments are read with a strict parser (`json.loads`' default), which refuses a
raw control character (U+0000-U+001F) inside a string. xgrammar's schema conversion (0.2.9,
and its main branch as of 2026) writes such strings in two places:

- A string with `minLength` / `maxLength` (and no `pattern` or known `format`) repeats the
  class `[^"\\\\\\r\\n]`: every other control character, tab included, goes out raw, and no
  escape can be written at all. Its rule is rewritten here to a JSON character: an
  unescaped one, or one escape sequence (a surrogate pair's two escapes counting as the one
  character they decode to, as JSON Schema counts).
- A `pattern` is matched on the raw string body with `"`, `\\` and the control characters
  taken out of every character match, except where xgrammar gives up on that (the pattern
  has a character outside printable ASCII, or every match needs one of the taken-out
  characters) and expands it unfiltered: `^é.*$` then admits anything, `^a"$` ends the
  string early. Characters outside printable ASCII are written as regex escapes, which
  keeps them on the filtered path; a pattern that still falls off it is refused.

A `pattern` with `minLength` / `maxLength` keeps xgrammar's behaviour: the pattern alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from engine.grammar.limits import GrammarError

_LENGTH_BOUNDED_CHAR = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
"""The character rule of a length-bounded string, as xgrammar prints it."""

_JSON_CHAR_RULES = r"""
radixserve_json_char ::= [^\0-\x1f"\\\uD800-\uDFFF] | "\\" radixserve_json_escape
radixserve_json_escape ::= [\"\\/bfnrt]
    | "u" [0-9A-Ca-cE-Fe-f] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f]
    | "u" [Dd] [0-7] [0-9A-Fa-f] [0-9A-Fa-f]
    | "u" [Dd] [89ABab] [0-9A-Fa-f] [0-9A-Fa-f] "\\u" [Dd] [C-Fc-f] [0-9A-Fa-f] [0-9A-Fa-f]
"""
"""One JSON string character: unescaped, or escaped. A surrogate is no character: neither
escaped alone nor UTF-8-encoded (bytes a negated class of xgrammar would otherwise admit,
which decode to three replacement characters). xgrammar's own rule names start with root,
basic_ or defs_."""

_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
"""Keywords whose values are JSON data, never schemas."""
_SCHEMA_MAPS = frozenset({"$defs", "definitions", "dependentSchemas", "properties"})
"""Keywords whose values map names to schemas."""


def json_schema_grammar(source: str) -> xgr.Grammar:
    """The grammar of the JSON schema `source`, without free whitespace, whose strings are
    all strict JSON. GrammarError for a pattern only an unescaped string could match;
    xgrammar's own errors for an invalid schema or regex."""
    schema = json.loads(source)
    rewritten = _rewrite_patterns(schema)
    if rewritten != schema:
        source = json.dumps(rewritten)
    ebnf = str(xgr.Grammar.from_json_schema(source, any_whitespace=False))
    ebnf, num_rules = _LENGTH_BOUNDED_CHAR.subn(r"\1 ::= radixserve_json_char", ebnf)
    if num_rules:
        ebnf += _JSON_CHAR_RULES
    return xgr.Grammar.from_ebnf(ebnf)


def _rewrite_patterns(node: Any) -> Any:
    """`node` (a schema, or a list or map of them) with every pattern xgrammar applies to a
    string made printable ASCII, and checked."""
    if isinstance(node, list):
        return [_rewrite_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    types = node.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    rewritten: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            rewritten[key] = value
        elif key == "pattern" and is_string and isinstance(value, str):
            rewritten[key] = _checked_pattern(value)
        elif key == "patternProperties" and isinstance(value, dict):
            rewritten[key] = {_checked_pattern(k): _rewrite_patterns(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rewritten[key] = {k: _rewrite_patterns(v) for k, v in value.items()}
        else:
            rewritten[key] = _rewrite_patterns(value)
    return rewritten


def _checked_pattern(pattern: str) -> str:
    """`pattern` in printable ASCII; GrammarError if xgrammar would still match it on the
    string body unfiltered (its output names the filtered match `json_string=true`)."""
    ascii_pattern = _ascii_regex(pattern)
    probe = json.dumps({"type": "string", "pattern": ascii_pattern})
    if "json_string=true" not in str(xgr.Grammar.from_json_schema(probe, any_whitespace=False)):
        raise GrammarError(
            f"pattern {pattern!r} cannot be matched in a JSON string: every match needs a "
            "character that JSON escapes (a quote, a backslash or a control character), or "
            "the pattern uses syntax the grammar engine only matches unescaped"
        )
    return ascii_pattern


def _ascii_regex(pattern: str) -> str:
    """`pattern` with each character outside printable ASCII, escaped or not, written as
    the regex escape `\\u{...}`: the same pattern, which xgrammar matches filtered."""
    out: list[str] = []
    chars = iter(pattern)
    for char in chars:
        if char == "\\":
            char = next(chars, "")
            out.append(_unicode_escape(char) if char and not _printable(char) else "\\" + char)
        else:
            out.append(char if _printable(char) else _unicode_escape(char))
    return "".join(out)


def _printable(char: str) -> bool:
    return " " <= char <= "~"


def _unicode_escape(char: str) -> str:
    return f"\\u{{{ord(char):X}}}"
