"""JSON-schema grammars admit only strict JSON, with either library: no raw control
character inside a string, length bounds counted in JSON characters; with xgrammar,
patterns it would expand unfiltered refused, and no byte sequence that is not UTF-8."""

import functools
import json
import random
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    PendingGrammar,
    allocate_vocab_mask,
)
from engine.grammar.validate import validate_grammar
from engine.model.tokenizer_cache import load_tokenizer

VOCAB = 49152  # SmolLM2's, the embedded tokenizer's
EOS = 2
CONTROL_CHARS = [chr(c) for c in range(0x20)]

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "tags": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 2},
            "maxItems": 2,
        },
        "meta": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
            "required": ["code"],
        },
    },
    "required": ["name", "tags", "meta"],
}
REFS = {
    "type": "object",
    "properties": {
        "a": {"$ref": "#/$defs/short"},
        "b": {"type": ["string", "null"], "maxLength": 1},
    },
    "required": ["a", "b"],
    "$defs": {"short": {"type": "string", "minLength": 2, "maxLength": 2}},
}

CASES = [
    pytest.param(
        {"type": "string", "minLength": 1, "maxLength": 3},
        # An escape sequence is one character; a surrogate pair's two escapes are one too.
        ['"a"', '"abc"', '"😀é€"', r'"\n\t\\"', r'"\"\/\u0001"', r'"\ud83d\ude00\u00e9"'],
        ['""', '"abcd"', r'"\n\t\\\""', r'"\ud83d"', r'"\ude00"', r'"\x"', '"a\\"'],
        "{}",
        id="minLength-maxLength",
    ),
    pytest.param(
        {"type": "string", "minLength": 2}, ['"ab"', r'"\"\""'], ['"a"'], "{}", id="minLength"
    ),
    pytest.param(
        {"type": "string", "minLength": 63, "maxLength": 64},
        ['"' + "a" * 63 + '"', '"' + "\\n" * 64 + '"', '"' + "é" * 62 + r'\ud83d\ude00"'],
        ['"' + "a" * 62 + '"', '"' + "a" * 65 + '"', '"' + "\\n" * 62 + '"'],
        "a" * 63 + "{}",
        id="bounds-64-ebnf",
    ),
    pytest.param(
        {"type": "string", "minLength": 200, "maxLength": 32767},
        ['"' + "a" * 200 + '"', '"' + "\\t" * 200 + '"', '"' + "€" * 199 + r'\u00e9"'],
        ['"' + "a" * 199 + '"', '"' + "\\t" * 199 + '"', '"' + "a" * 199 + r'\ud83d"'],
        "a" * 200 + "{}",
        id="bounds-32767-counted",
    ),
    pytest.param(
        {"type": "string", "minLength": 130},
        ['"' + "ab" * 65 + '"', '"' + r"\/" * 130 + '"'],
        ['"' + "a" * 129 + '"'],
        "a" * 130 + "{}",
        id="minLength-130-counted",
    ),
    pytest.param(
        {"type": "string", "maxLength": 0}, ['""'], ['"a"', r'"\n"'], "{}", id="maxLength-0"
    ),
    pytest.param(
        {"type": "string", "pattern": "^a.*$"}, ['"a"', '"a b"'], ['"b"'], "a{}", id="pattern"
    ),
    pytest.param(
        {"type": "string", "pattern": "^é.*$"},
        ['"é"', '"éa€"'],
        ['"a"', '"é""'],
        "é{}",
        id="non-ascii-pattern",
    ),
    pytest.param(
        {"type": "string", "pattern": "^[а-я]+$"}, ['"абв"'], ['"abc"'], None, id="cyrillic-class"
    ),
    pytest.param(
        {"enum": ["a\nb", "c\t"]}, [r'"a\nb"', r'"c\t"'], [], "a{}b", id="enum-with-escapes"
    ),
    pytest.param(
        NESTED,
        [
            '{"name": "", "tags": [], "meta": {"code": "AB"}}',
            r'{"name": "\"ab\"", "tags": ["x", "\t"], "meta": {"code": "ZZ"}}',
        ],
        ['{"name": "abcde", "tags": [], "meta": {"code": "AB"}}'],
        '{{"name": "{}", "tags": [], "meta": {{"code": "AB"}}}}',
        id="nested",
    ),
    pytest.param(
        REFS,
        ['{"a": "ab", "b": null}', r'{"a": "\u00e9\n", "b": "x"}'],
        ['{"a": "a", "b": null}'],
        '{{"a": "a{}", "b": null}}',
        id="refs-and-type-lists",
    ),
    pytest.param(
        {"type": "object", "patternProperties": {"^é.*$": {"type": "integer"}}},
        ['{"éa": 1}'],
        ['{"a": 1}'],
        '{{"é{}": 1}}',
        id="pattern-properties",
    ),
    pytest.param(
        {"type": "string", "format": "email"}, ['"a@b.co"'], [], '"a{}@b.co"', id="format"
    ),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def make_backend(tokenizer, library: str) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB, backend=library, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def xgrammar_backend(tokenizer):
    backend = make_backend(tokenizer, "xgrammar")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def llguidance_backend(tokenizer):
    backend = make_backend(tokenizer, "llguidance")
    yield backend
    backend.shutdown()


def compiled(backend: GrammarBackend, schema: dict) -> PendingGrammar:
    pending = backend.submit("json_schema", json.dumps(schema))
    while pending.result() is None:
        time.sleep(0.005)
    return pending


@functools.cache
def byte_tokens() -> dict[int, int]:
    """The vocabulary's one-byte tokens by byte: text spelled byte by byte, as it is (the
    tokenizer's encode may normalise a control character away)."""
    vocab = xgr.TokenizerInfo.from_huggingface(load_tokenizer("embedded"), vocab_size=VOCAB)
    return {b[0]: i for i, b in enumerate(vocab.decoded_vocab) if len(b) == 1}


def accepts(backend: GrammarBackend, grammar: PendingGrammar, text: str) -> bool:
    """Whether the grammar takes the bytes of `text`, and then ends (False for a byte no
    token spells: no output can hold it)."""
    matcher = backend.new_matcher(grammar, reasoning=False)
    data = text.encode()
    if any(b not in byte_tokens() for b in data):
        return False
    tokens = [byte_tokens()[b] for b in data]
    return all(matcher.accept_token(t) for t in [*tokens, EOS]) and matcher.is_terminated()


@pytest.mark.parametrize(
    ("schema", "valid", "invalid", "raw_template"), [c for c in CASES if c.values[3] is not None]
)
def test_llguidance_refuses_raw_control_characters_too(
    llguidance_backend, schema, valid, invalid, raw_template
):
    """It writes only the escapes JSON needs, each counted as one character, and refuses
    the optional ones (`\\/`, `\\u00e9`, a surrogate pair) the cases list as valid: their
    valid texts are xgrammar's to take (the random walks below check llguidance's answers
    validate)."""
    grammar = compiled(llguidance_backend, schema)
    for char in CONTROL_CHARS:
        assert not accepts(llguidance_backend, grammar, raw_template.format(char)), repr(char)


@pytest.mark.parametrize(("schema", "valid", "invalid", "raw_template"), CASES)
def test_the_grammar_refuses_raw_control_characters_and_keeps_the_bounds(
    xgrammar_backend, schema, valid, invalid, raw_template
):
    backend = xgrammar_backend
    grammar = compiled(backend, schema)
    for text in valid:
        jsonschema.validate(json.loads(text), schema)  # the case itself is right
        assert accepts(backend, grammar, text), text
    for text in invalid:
        assert not accepts(backend, grammar, text), text
    if raw_template is not None:  # where the schema allows a character, none may be raw
        for char in CONTROL_CHARS:
            assert not accepts(backend, grammar, raw_template.format(char)), repr(char)


@pytest.mark.parametrize(
    "pattern",
    ['^a"$', r"^a\n$", r"^C:\\.*$", "^[\\x00-\\x1f]$", "^a\x01$"],
)
def test_a_pattern_only_an_unescaped_string_matches_is_refused_before_and_at_compile(
    xgrammar_backend, pattern
):
    schema = json.dumps(
        {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    )
    message = re.escape(f"pattern {pattern!r} cannot be matched in a JSON string")
    with pytest.raises(GrammarError, match=f"^invalid json_schema: {message}"):
        validate_grammar("json_schema", schema, 65536, 64, backend="xgrammar")
    with pytest.raises(GrammarError, match=message):
        compiled(xgrammar_backend, json.loads(schema))


@pytest.mark.parametrize("max_length", [3, 64, 32767], ids=["unrolled", "ebnf", "counted"])
@pytest.mark.parametrize(
    ("lead", "refused", "accepted"),
    [(0xED, 0xA0, 0x9F), (0xE0, 0x9F, 0xA0), (0xF0, 0x8F, 0x90), (0xF4, 0x90, 0x8F)],
    ids=["surrogate", "overlong-3", "overlong-4", "above-U+10FFFF"],
)
def test_a_length_bounded_string_refuses_bytes_that_are_not_utf8(
    xgrammar_backend, max_length, lead, refused, accepted
):
    """Byte tokens spell what no text can: U+D800, or U+0800 in four bytes, is not UTF-8."""
    grammar = compiled(xgrammar_backend, {"type": "string", "maxLength": max_length}).result()
    byte_token = {
        b[0]: i for i, b in enumerate(grammar.tokenizer_info.decoded_vocab) if len(b) == 1
    }
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_token(byte_token[ord('"')]) and matcher.accept_token(byte_token[lead])
    assert not matcher.accept_token(byte_token[refused])
    assert matcher.accept_token(byte_token[accepted])


def test_a_pattern_on_a_schema_that_is_not_a_string_is_left_to_xgrammar(xgrammar_backend):
    grammar = compiled(xgrammar_backend, {"type": "integer", "pattern": '^a"$'})
    assert accepts(xgrammar_backend, grammar, "12")


WALK_SCHEMAS = [
    {"type": "string", "minLength": 1, "maxLength": 6},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 8},
            "code": {"type": "string", "pattern": "^[a-zé]{1,3}$"},
            "kind": {"enum": ["a\nb", 'q"', "c"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "code", "kind"],
    },
    NESTED,
    REFS,
]


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def walk_backend(request, xgrammar_backend, llguidance_backend):
    return {"xgrammar": xgrammar_backend, "llguidance": llguidance_backend}[request.param]


@pytest.fixture(scope="module")
def walk_grammars(walk_backend):
    return [compiled(walk_backend, schema) for schema in WALK_SCHEMAS]


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB).decoded_vocab


@pytest.fixture(scope="module")
def escape_prone(token_bytes):
    """Tokens that write a quote, a backslash or a control character, or one character:
    drawn half the time, so that walks reach the escapes and the bounds."""
    return torch.tensor(
        [
            i
            for i, b in enumerate(token_bytes)
            if len(b) == 1 or b'"' in b or b"\\" in b or any(c < 0x20 for c in b)
        ]
    )


def allowed_tokens(matcher: GrammarMatcher) -> torch.Tensor:
    mask = allocate_vocab_mask(1, VOCAB)
    matcher.fill_vocab_mask(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB].nonzero().flatten()


@settings(max_examples=60)
@given(schema_index=st.integers(0, len(WALK_SCHEMAS) - 1), seed=st.integers(0, 2**32 - 1))
def test_random_token_walks_under_the_grammar_give_strict_valid_json(
    walk_backend, walk_grammars, token_bytes, escape_prone, schema_index, seed
):
    rng = random.Random(seed)
    matcher = walk_backend.new_matcher(walk_grammars[schema_index], reasoning=False)
    tokens: list[int] = []
    while not matcher.is_terminated():
        assert len(tokens) < 200, b"".join(token_bytes[t] for t in tokens)
        allowed = allowed_tokens(matcher)
        if EOS in allowed:
            token = EOS
        else:
            prone = allowed[torch.isin(allowed, escape_prone)]
            pool = prone if len(prone) and rng.random() < 0.5 else allowed
            token = int(pool[rng.randrange(len(pool))])
        assert matcher.accept_token(token)
        tokens.append(token)
    text = b"".join(token_bytes[t] for t in tokens[:-1]).decode()
    jsonschema.validate(json.loads(text), WALK_SCHEMAS[schema_index])
