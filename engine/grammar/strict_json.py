"""JSON-schema grammars whose strings all parse as strict JSON.

Tool-call arguments are read with a strict parser (`json.loads`' default), which refuses a
raw control character (U+0000-U+001F) inside a string. xgrammar's schema conversion (0.2.9,
and its main branch as of 2026) writes such strings in two places:

- A string with `minLength` / `maxLength` (and no `pattern` or known `format`) repeats the
  class `[^"\\\\\\r\\n]`: every other control character, tab included, goes out raw, and no
  escape can be written at all. Its rule is rewritten here to a JSON character: an
  unescaped one, or one escape sequence (a surrogate pair's two escapes counting as the one
  character they decode to, as JSON Schema counts). How the count is kept decides the mask
  cost (docs/benchmarks/grammar.md): xgrammar unrolls an EBNF repetition of a rule that is
  more than one character class, above 128 with lookaheads of 128 characters, so that a
  mask's cost grows with the bound and the position in the string (to about a second a
  mask near the end of a 32,767-character string). A
  `Regex(...)` repetition above 128 is run with a counter instead (a cost per mask that does
  not grow with the bound or the position), and one of at most 32 is unrolled into a small
  automaton whose masks are precomputed; between the two, where xgrammar would unroll the
  regex too at a compile cost of seconds, the EBNF repetition stays.
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

from engine.grammar.exact import without_nothing
from engine.grammar.limits import GrammarError

_LENGTH_BOUNDED_CLASS = r"[^\"\\\r\n]"
"""The character of a length-bounded string, as xgrammar prints it: in a rule of its own
(`name_characters`), or inline where the bound is at most one."""
_JSON_CHAR_RULE = re.compile(r"^(\S+) ::= \(\(radixserve_json_char\)\)$", re.M)
_REPEAT = re.compile(r"\b(\S+)\{(\d+), (-?\d+)\}")
"""A repetition: `name{min, max}`, max -1 for none."""
_UNROLLED_MAX = 32
"""Repetitions up to this count go to an unrolled regex (compiled in well under a second)."""
_COUNTED_MIN = 128
"""xgrammar runs a regex repetition above this count with a counter (below, it unrolls)."""
_JSON_CHAR_REGEX = (
    r"(?:[\x20\x21\x23-\x5b\x5d-\x7f]|[\u{80}-\u{7FF}]|[\u{800}-\u{FFF}]|[\u{1000}-\u{CFFF}]"
    r"|[\u{D000}-\u{D7FF}]|[\u{E000}-\u{FFFF}]|[\u{10000}-\u{3FFFF}]|[\u{40000}-\u{FFFFF}]"
    r'|[\u{100000}-\u{10FFFF}]|\\(?:["\\/bfnrt]|u(?:[0-9A-Ca-cE-Fe-f][0-9A-Fa-f]{3}'
    r"|[Dd][0-7][0-9A-Fa-f]{2}|[Dd][89ABab][0-9A-Fa-f]{2}\\u[Dd][C-Fc-f][0-9A-Fa-f]{2})))"
)
"""`radixserve_json_char` as a regex. The unescaped characters are listed as ranges of one
UTF-8 length each, split where the second byte's range narrows (after E0, ED, F0, F4):
xgrammar's regex automaton admits overlong and surrogate encodings (E0 9B 92) for a range
that spans those boundaries."""

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
    rewritten = _rewrite(without_nothing(schema, drop_forbidden=True))
    if rewritten != schema:
        source = json.dumps(rewritten)
    ebnf = str(xgr.Grammar.from_json_schema(source, any_whitespace=False))
    if _LENGTH_BOUNDED_CLASS in ebnf:
        ebnf = ebnf.replace(_LENGTH_BOUNDED_CLASS, "radixserve_json_char")
        chars = set(_JSON_CHAR_RULE.findall(ebnf))
        ebnf = _REPEAT.sub(lambda m: _counted_repeat(m) if m[1] in chars else m[0], ebnf)
        ebnf += _JSON_CHAR_RULES
    return xgr.Grammar.from_ebnf(ebnf)


def _counted_repeat(match: re.Match[str]) -> str:
    """A length-bounded string's repetition, as the cheapest form xgrammar masks exactly."""
    low, high = int(match[2]), int(match[3])
    if _UNROLLED_MAX < max(low, high) <= _COUNTED_MIN:
        return match[0]
    bounds = f"{low}," if high == -1 else f"{low},{high}"
    return f"Regex({json.dumps(_JSON_CHAR_REGEX + '{' + bounds + '}')})"


def _rewrite(node: Any) -> Any:
    """`node` (a schema, or a list or map of them) with every pattern xgrammar applies to a
    string made printable ASCII, and checked; and every array without `items` given the
    `items: {}` it means, which xgrammar's strict mode needs to serve a `minItems` (it
    refuses `{"type": "array", "minItems": 1}`: "minItems is greater than the number of
    prefixItems")."""
    if isinstance(node, list):
        return [_rewrite(item) for item in node]
    if not isinstance(node, dict):
        return node
    types = node.get("type")
    rewritten: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            rewritten[key] = value
        elif key == "pattern" and _has_type(types, "string") and isinstance(value, str):
            rewritten[key] = _checked_pattern(value)
        elif key == "patternProperties" and isinstance(value, dict):
            rewritten[key] = {_checked_pattern(k): _rewrite(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rewritten[key] = {k: _rewrite(v) for k, v in value.items()}
        else:
            rewritten[key] = _rewrite(value)
    if _has_type(types, "array") and "items" not in node:
        rewritten["items"] = {}
    return rewritten


def _has_type(types: Any, name: str) -> bool:
    return types == name or (isinstance(types, list) and name in types)


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
