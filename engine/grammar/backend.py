"""The xgrammar backend: compile grammars on a small thread pool, one matcher per request."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.grammar.limits import GrammarError, check_grammar_limits
from engine.grammar.matcher import GrammarMatcher
from engine.grammar.reasoning import ReasoningGrammarMatcher
from engine.grammar.strict_json import json_schema_grammar
from engine.grammar.validate import grammar_error

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "PendingGrammar",
    "allocate_vocab_mask",
]


class PendingGrammar:
    """A compile a request waits for in the grammar queue, with its deadline."""

    def __init__(self, kind: str, future: Future[xgr.CompiledGrammar], timeout_s: float):
        self.kind = kind
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def result(self) -> xgr.CompiledGrammar | None:
        """The compiled grammar, None while compiling; GrammarError on a failure or once
        the deadline has passed (the compile itself runs on and may still fill the cache)."""
        if self.future.done():
            return self.future.result()
        if time.monotonic() >= self.deadline:
            raise GrammarError(f"compiling the {self.kind} took longer than {self.timeout_s:g} s")
        return None


class GrammarBackend:
    """Compiles `json_schema`, `regex` and `ebnf` with xgrammar on `max_workers` threads.

    The cache is ours: an LRU of compile futures keyed by (kind, text), so concurrent
    requests with one grammar share a single compile; xgrammar's own cache is off so a
    grammar is held once. A failed compile is cached too: the same bad grammar sent again
    fails at once instead of taking a worker. JSON schemas compile without
    free whitespace: a small model given the choice loops on whitespace until max_tokens;
    and with every string strict JSON (`strict_json`), as tool-call arguments are parsed.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        max_workers: int = 2,
        compile_timeout_s: float = 30.0,
        max_grammar_bytes: int = 65536,
        max_nesting_depth: int = 64,
        cache_size: int = 128,
        think_end_token: str | None = None,
    ):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
        )
        self.tokenizer = tokenizer
        """Also what jump-forward re-encodes forced text with."""
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_workers, cache_enabled=False)
        self.executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self.compile_timeout_s = compile_timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.max_nesting_depth = max_nesting_depth
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self.on_compile: Callable[[float | None], None] | None = None
        """Hears the seconds of each compile, or None for each grammar refused (the worker's
        metrics); called on the compile threads. Cache hits are not compiles."""
        self.think_end_token_id = (
            None if think_end_token is None else _token_id(tokenizer, think_end_token, vocab_size)
        )
        """The token that closes a reasoning section (the reasoning parser's), if any."""

    def submit(self, kind: str, source: str) -> PendingGrammar:
        """Start compiling (or reuse the cached compile of) `source`; never blocks. A
        grammar over the limits comes back as an already failed compile."""
        key = (kind, source)
        future = self.cache.get(key)
        if future is not None:
            self.cache.move_to_end(key)
        else:
            try:
                check_grammar_limits(kind, source, self.max_grammar_bytes, self.max_nesting_depth)
            except GrammarError as e:
                self._report(None)
                future = Future()
                future.set_exception(e)
                return PendingGrammar(kind, future, self.compile_timeout_s)
            future = self.executor.submit(self._compile, kind, source)
            self.cache[key] = future
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return PendingGrammar(kind, future, self.compile_timeout_s)

    def new_matcher(
        self, compiled: xgr.CompiledGrammar, reasoning: bool
    ) -> GrammarMatcher | ReasoningGrammarMatcher:
        """A request's matcher; with `reasoning` (its output opens with a reasoning section)
        and a think-end token, one that constrains only what follows that token."""
        matcher = GrammarMatcher(compiled)
        if reasoning and self.think_end_token_id is not None:
            return ReasoningGrammarMatcher(matcher, self.think_end_token_id)
        return matcher

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self._run_compiler(kind, source)
        except GrammarError:
            self._report(None)
            raise
        self._report(time.perf_counter() - start)
        return compiled

    def _report(self, seconds: float | None) -> None:
        if self.on_compile is not None:
            self.on_compile(seconds)

    def _run_compiler(self, kind: str, source: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                return self.compiler.compile_grammar(json_schema_grammar(source))
            if kind == "regex":
                return self.compiler.compile_regex(source)
            if kind == "ebnf":
                return self.compiler.compile_grammar(source)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses for bad input
            raise grammar_error(kind, e) from None
        raise GrammarError(f"unknown grammar kind {kind!r}")


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
