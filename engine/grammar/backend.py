"""The xgrammar backend: compile grammars on a small thread pool, one matcher per request."""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.grammar.limits import GrammarError, check_grammar_limits

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's messages start with "[time] source.cc:line: ", which tells a client nothing."""

__all__ = ["GrammarBackend", "GrammarError", "GrammarMatcher", "PendingGrammar", "allocate_vocab_mask"]


class GrammarMatcher:
    """One request's position in its grammar, as SGLang's grammar object: fill the mask
    for the next token, accept the sampled one, report termination."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `vocab_mask[row]` (xgrammar's int32 layout)."""
        self._matcher.fill_next_token_bitmask(vocab_mask, row)

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (state unchanged)."""
        return self._matcher.accept_token(token)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher.is_terminated()


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
    free whitespace: a small model given the choice loops on whitespace until max_tokens.
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
    ):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_workers, cache_enabled=False)
        self.executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self.compile_timeout_s = compile_timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.max_nesting_depth = max_nesting_depth
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()

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
                future = Future()
                future.set_exception(e)
                return PendingGrammar(kind, future, self.compile_timeout_s)
            future = self.executor.submit(self._compile, kind, source)
            self.cache[key] = future
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return PendingGrammar(kind, future, self.compile_timeout_s)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, source: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(source, any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(source)
            if kind == "ebnf":
                return self.compiler.compile_grammar(source)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses for bad input
            raise GrammarError(f"invalid {kind}: {_XGRAMMAR_LOG_PREFIX.sub('', str(e)).strip()}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}")


def allocate_vocab_mask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask `[batch_size, ceil(vocab_size / 32)]` on the host."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)
