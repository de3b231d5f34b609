"""Grammar compiles off the scheduler loop and one matcher per request, over the library
`--grammar-backend` names: xgrammar, llguidance, or auto (per grammar, the one that
enforces it: `choose_backend`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

import engine.grammar.llguidance_backend as llguidance_backend
import engine.grammar.xgrammar_backend as xgrammar_backend
from engine.grammar.limits import GrammarError, check_grammar_limits
from engine.grammar.matcher import GrammarMatcher
from engine.grammar.reasoning import ReasoningGrammarMatcher
from engine.grammar.validate import choose_backend

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "PendingGrammar",
    "allocate_vocab_mask",
]


class GrammarCompiler(Protocol):
    """One library's compiles for one vocabulary (`xgrammar_backend`, `llguidance_backend`)."""

    name: str

    def compile(self, kind: str, source: str) -> Any:
        """The compiled grammar; GrammarError for one the client must fix."""

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of `compiled`."""


class PendingGrammar:
    """A compile a request waits for in the grammar queue, with its deadline and the
    library that compiles it."""

    def __init__(self, kind: str, future: Future[Any], timeout_s: float, backend: str = ""):
        self.kind = kind
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.backend = backend

    def result(self) -> Any | None:
        """The compiled grammar, None while compiling; GrammarError on a failure or once
        the deadline has passed (the compile itself runs on and may still fill the cache)."""
        if self.future.done():
            return self.future.result()
        if time.monotonic() >= self.deadline:
            raise GrammarError(f"compiling the {self.kind} took longer than {self.timeout_s:g} s")
        return None


class GrammarBackend:
    """Compiles `json_schema`, `regex` and `ebnf` on `max_workers` threads with the library
    each grammar is served by.

    The cache is ours: an LRU of compile futures keyed by (library, kind, text), so
    concurrent requests with one grammar share a single compile; a failed compile is cached
    too, so the same bad grammar sent again fails at once instead of taking a worker. The
    worker compiles what the tokenizer let through (which refused, per library, what would
    not be enforced) or what the offline Engine was given as it is: best effort.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        backend: str = "auto",
        stop_token_ids: Sequence[int] | None = None,
        max_workers: int = 2,
        compile_timeout_s: float = 30.0,
        max_grammar_bytes: int = 65536,
        max_nesting_depth: int = 64,
        cache_size: int = 128,
        think_end_token: str | None = None,
    ):
        self.name = backend
        """`--grammar-backend`: a library, or auto."""
        self.tokenizer = tokenizer
        """Also what jump-forward re-encodes forced text with."""
        self.vocab_size = vocab_size
        self.compilers: dict[str, GrammarCompiler] = {}
        if backend in (xgrammar_backend.NAME, "auto"):
            self.compilers[xgrammar_backend.NAME] = xgrammar_backend.XGrammarCompiler(
                tokenizer, vocab_size, stop_token_ids, max_workers
            )
        if backend in (llguidance_backend.NAME, "auto"):
            self.compilers[llguidance_backend.NAME] = llguidance_backend.LLGuidanceCompiler(
                tokenizer, vocab_size, stop_token_ids
            )
        if not self.compilers:
            raise ValueError(f"unknown grammar backend {backend!r}")
        self.executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self.compile_timeout_s = compile_timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.max_nesting_depth = max_nesting_depth
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str, str], Future[Any]] = OrderedDict()
        self.on_compile: Callable[[float | None], None] | None = None
        """Hears the seconds of each compile, or None for each grammar refused (the worker's
        metrics); called on the compile threads. Cache hits are not compiles."""
        self.think_end_token_id = (
            None if think_end_token is None else _token_id(tokenizer, think_end_token, vocab_size)
        )
        """The token that closes a reasoning section (the reasoning parser's), if any."""

    def library_for(self, kind: str, source: str) -> str:
        """The library that serves this grammar: the one configured, or auto's choice."""
        if self.name != "auto":
            return self.name
        return choose_backend(kind, source, self.max_grammar_bytes, self.max_nesting_depth)

    def submit(self, kind: str, source: str) -> PendingGrammar:
        """Start compiling (or reuse the cached compile of) `source`; never blocks. A
        grammar over the limits comes back as an already failed compile; the limits are
        checked once per grammar text, on a miss (auto's cached choice checks them too)."""
        try:
            library = self.library_for(kind, source)
        except GrammarError as e:
            return self._refused(kind, e)
        key = (library, kind, source)
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            return PendingGrammar(kind, cached, self.compile_timeout_s, library)
        try:
            check_grammar_limits(kind, source, self.max_grammar_bytes, self.max_nesting_depth)
        except GrammarError as e:
            return self._refused(kind, e)
        future = self.executor.submit(self._compile, self.compilers[library], kind, source)
        self.cache[key] = future
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return PendingGrammar(kind, future, self.compile_timeout_s, library)

    def _refused(self, kind: str, error: GrammarError) -> PendingGrammar:
        """An already failed compile: the grammar is over the limits."""
        self._report(None)
        future: Future[Any] = Future()
        future.set_exception(error)
        return PendingGrammar(kind, future, self.compile_timeout_s)

    def new_matcher(
        self, pending: PendingGrammar, reasoning: bool
    ) -> GrammarMatcher | ReasoningGrammarMatcher:
        """A request's matcher for the grammar `pending` compiled (it has); with `reasoning`
        (its output opens with a reasoning section) and a think-end token, one that
        constrains only what follows that token."""
        matcher = self.compilers[pending.backend].new_matcher(pending.future.result())
        if reasoning and self.think_end_token_id is not None:
            return ReasoningGrammarMatcher(matcher, self.think_end_token_id)
        return matcher

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, compiler: GrammarCompiler, kind: str, source: str) -> Any:
        start = time.perf_counter()
        try:
            compiled = compiler.compile(kind, source)
        except GrammarError:
            self._report(None)
            raise
        self._report(time.perf_counter() - start)
        return compiled

    def _report(self, seconds: float | None) -> None:
        if self.on_compile is not None:
            self.on_compile(seconds)


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str, vocab_size: int) -> int:
    """The id of `token`, which the tokenizer must encode as one token of the vocabulary: a
    reasoning section is seen to end by that one id."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or not 0 <= ids[0] < vocab_size:
        raise ValueError(f"{token!r} is not one token of the vocabulary: it encodes as {ids}")
    return ids[0]


def allocate_vocab_mask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask `[batch_size, ceil(vocab_size / 32)]` on the host."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)
