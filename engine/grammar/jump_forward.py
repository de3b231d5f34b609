"""Jump-forward decoding: append the text a grammar forces without a forward pass per token.

Where the grammar allows exactly one continuation (a JSON key, `": "`, a closing brace),
`find_jump_forward_string()` returns it and the request can take it at once. The catch is
the token boundary: the forced text may merge with the last sampled tokens into different
tokens than sampling produced (`{` then `"name"` is `{"` + `name` + `"` in a BPE
vocabulary). The model must see the tokenization its tokenizer would give the joint text,
so the last few output tokens are decoded, joined with the forced text and encoded again;
the tokens that changed are rolled back and replaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from engine.detokenize import Tokenizer as Decoder
from engine.detokenize import decode_text

RETOKENIZE_WINDOW = 4
"""Output tokens re-encoded with the forced text. A BPE merge stays inside one pre-token
(a run of punctuation, a word), which the last few tokens cover; if even the window's first
token changes, the merge may reach further back and the jump is skipped."""


class Tokenizer(Decoder, Protocol):
    """What jump-forward reads of a Hugging Face tokenizer: `decode`, and `encode`."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def decodes_concatenatively(tokenizer: Tokenizer) -> bool:
    """Whether decoding a run of tokens equals joining their separate decodes, which the
    window re-encoding relies on. Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) does;
    SentencePiece drops the leading space of a piece decoded alone, so it does not."""
    ids = tokenizer.encode('a b {"c": 1}', add_special_tokens=False)
    pieces = "".join(decode_text(tokenizer, [i], skip_special_tokens=False) for i in ids)
    return pieces == decode_text(tokenizer, ids, skip_special_tokens=False)


class JumpForward(NamedTuple):
    rollback: int
    """Trailing output tokens to drop (they merge with the forced text)."""
    token_ids: list[int]
    """Tokens to append after the rollback: the re-encoded tail, then the forced text."""


def plan_jump_forward(
    tokenizer: Tokenizer, output_ids: Sequence[int], forced: str, window: int = RETOKENIZE_WINDOW
) -> JumpForward | None:
    """How to append `forced` to `output_ids` as the tokenizer would encode the joint text,
    or None when that cannot be done safely: the tail starts or the rollback ends inside a
    UTF-8 character, the
    re-encoding does not decode back to the same text (tokenizers that add a prefix space),
    the merge reaches past the window, or nothing would be appended."""
    tail = list(output_ids[-window:])
    tail_text = decode_text(tokenizer, tail, skip_special_tokens=False)
    if "\ufffd" in tail_text:
        return None
    joint = tail_text + forced
    new_ids = tokenizer.encode(joint, add_special_tokens=False)
    if decode_text(tokenizer, new_ids, skip_special_tokens=False) != joint:
        return None
    kept = 0
    for old, new in zip(tail, new_ids):
        if old != new:
            break
        kept += 1
    if kept == 0 and len(tail) < len(output_ids):
        return None
    if "\ufffd" in decode_text(tokenizer, tail[:kept], skip_special_tokens=False):
        return None  # the rollback would split a character
    if kept == len(new_ids):
        return None
    return JumpForward(len(tail) - kept, new_ids[kept:])
