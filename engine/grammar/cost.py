"""Mask cost: what a grammar may cost per token, judged from its text before it runs, and
the error that ends a request whose grammar ran over its budget at run time.

Counted repeats with a variable count nested inside each other (`((a{0,16}){0,16}){0,16}`)
let one stretch of output be split among the repeats in exponentially many ways. An
Earley parser (xgrammar) keeps every split alive, so its mask for the next token grows with
each token matched: measured on SmolLM2's vocabulary, three such levels of 8 took 0.7 s a
mask after 26 tokens and four levels of 128 took 18 s after 5, while three levels of 4 stay
under a millisecond. llguidance's lexer works on a fixed budget ("fuel") per token, so
there the same pattern ends the request with a cost error instead of stalling the batch.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from engine.grammar.limits import GrammarError

MAX_NESTED_VARIABLE_REPEATS = 2
"""Levels of variable counted repeats nested in each other that are served as they are."""
MAX_NESTED_REPEAT_PRODUCT = 64
"""Deeper nests are served when the product of their counts stays this small."""

_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


class GrammarCostError(GrammarError):
    """A request's grammar ran over its mask budget: the request ends with this message,
    the batch goes on."""

    reason = "mask_budget"


class CostlyGrammar(GrammarError):
    """A grammar refused before it runs: its masks could not be bounded."""

    reason = "mask_cost"


class RepeatNest(NamedTuple):
    """The deepest chain of variable counted repeats nested in one another."""

    depth: int
    """How many are nested."""
    product: int
    """The product of their upper counts: how many ways a match may be split, roughly."""
    counts: tuple[str, ...]
    """Their counts as written, outermost first."""


_NONE = RepeatNest(0, 1, ())


def nested_repeats(kind: str, source: str) -> RepeatNest:
    """The deepest nest of variable counted repeats (`{m,n}`, m < n) in a regex or an EBNF
    (within one rule: a nest through rule references is not seen). A fixed count (`{n}`)
    and unbounded repeats (`*`, `+`, `{m,}`) do not deepen a nest: Earley items for them
    do not multiply."""
    if kind not in ("regex", "ebnf"):
        return _NONE
    quoted_strings = kind == "ebnf"
    frames: list[RepeatNest] = [_NONE]  # the deepest nest inside each open group
    last = _NONE  # the nest of the atom just read, which a count may follow
    i = 0
    while i < len(source):
        ch = source[i]
        atom: RepeatNest | None = None
        if ch == "\\":
            i += 1
            atom = _NONE
        elif ch == "[":
            i = _skip_class(source, i)
            atom = _NONE
        elif ch == '"' and quoted_strings:
            i = _skip_string(source, i)
            atom = _NONE
        elif ch == "(":
            frames.append(_NONE)
        elif ch == ")" and len(frames) > 1:
            atom = frames.pop()
        elif ch == "{" and (count := _COUNT.match(source, i)):
            low, comma, high = count.groups()
            if comma and high and int(low) < int(high):
                last = RepeatNest(
                    last.depth + 1, last.product * int(high), (count.group(0), *last.counts)
                )
                frames[-1] = max(frames[-1], last)
            i = count.end()
            continue
        else:
            atom = _NONE
        if atom is not None:
            last = atom
            frames[-1] = max(frames[-1], atom)
        i += 1
    return max(frames)


def _skip_class(source: str, start: int) -> int:
    """The index of the `]` closing the character class opened at `start`."""
    i = start + 1
    if source[i : i + 1] == "^":
        i += 1
    if source[i : i + 1] == "]":  # a leading ] is a literal
        i += 1
    while i < len(source) and source[i] != "]":
        i += 2 if source[i] == "\\" else 1
    return i


def _skip_string(source: str, start: int) -> int:
    """The index of the `"` closing the EBNF string literal opened at `start`."""
    i = start + 1
    while i < len(source) and source[i] != '"':
        i += 2 if source[i] == "\\" else 1
    return i


def explosive(nest: RepeatNest) -> bool:
    """Whether an Earley parser's masks may grow without bound on this nest."""
    return nest.depth > MAX_NESTED_VARIABLE_REPEATS and nest.product > MAX_NESTED_REPEAT_PRODUCT


def check_mask_cost(kind: str, source: str) -> None:
    """Raise GrammarError for a grammar whose masks an Earley parser cannot bound."""
    nest = nested_repeats(kind, source)
    if explosive(nest):
        raise CostlyGrammar(
            f"{kind} nests {nest.depth} variable counted repeats "
            f"({' inside '.join(reversed(nest.counts))}): up to {nest.product:.3g} ways to "
            f"split a match, so xgrammar's token masks grow with every token; at most "
            f"{MAX_NESTED_VARIABLE_REPEATS} levels are served (or a product of counts up to "
            f"{MAX_NESTED_REPEAT_PRODUCT}); llguidance serves it within a fixed cost per token"
        )
