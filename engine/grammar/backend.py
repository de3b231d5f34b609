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
from engine.grammar.compile_process import CompileBudget, CompileKilled
from engine.grammar.limits import GrammarError, check_grammar_limits
from engine.grammar.matcher import GrammarMatcher
from engine.grammar.reasoning import ReasoningGrammarMatcher
from engine.grammar.validate import choose_backend

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "GrammarObserver",
    "PendingGrammar",
    "allocate_vocab_mask",
]


class GrammarCompiler(Protocol):
    """One library's compiles for one vocabulary (`xgrammar_backend`, `llguidance_backend`)."""

    name: str

    def compile(self, kind: str, source: str, on_start: Callable[[], None]) -> Any:
        """The compiled grammar; GrammarError for one the client must fix. `on_start` is
        called when the budgeted work starts (after any wait for a compile worker)."""

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of `compiled`."""

    def close(self) -> None:
        """Stop what the compiler runs besides this process."""


class GrammarObserver(Protocol):
    """Hears the grammar events the worker's metrics count, per library; on the compile
    threads for compiles, the scheduler's thread for cache hits and refusals."""

    def on_grammar_compile(self, library: str, seconds: float) -> None:
        """A compile of `library` ended after `seconds` (cache hits are not compiles)."""

    def on_grammar_cache_hit(self, library: str) -> None:
        """A request's grammar was compiled already (or is compiling)."""

    def on_grammar_refused(self, library: str, reason: str) -> None:
        """A request's grammar failed: `GrammarError.reason`."""


GRACE_S = 0.5
"""A request waits this much longer than the compile budget, so that a compile stopped at
its budget is reported as that."""


class CompileJob:
    """One compile, shared by every request with its grammar: its future, and when its
    budgeted work started (None while it waits for a compile worker)."""

    def __init__(self, future: Future[Any] | None = None):
        self.future: Future[Any] = future if future is not None else Future()
        self.started: float | None = None

    def mark_started(self) -> None:
        self.started = time.monotonic()


class PendingGrammar:
    """A compile a request waits for in the grammar queue, and the library that compiles
    it. Its wait is bounded by the compile's budget from when the compile starts: a wait
    for a busy compile worker before that is the queue's, not the grammar's cost."""

    def __init__(self, kind: str, job: CompileJob, timeout_s: float, backend: str = ""):
        self.kind = kind
        self.job = job
        self.timeout_s = timeout_s
        self.backend = backend

    @property
    def future(self) -> Future[Any]:
        return self.job.future

    def result(self) -> Any | None:
        """The compiled grammar, None while compiling; GrammarError on a failure, or once
        the compile has run past its budget (xgrammar's is stopped there itself)."""
        if self.future.done():
            return self.future.result()
        started = self.job.started
        if started is not None and time.monotonic() >= started + self.timeout_s + GRACE_S:
            raise CompileKilled(
                f"compiling the {self.kind} took longer than {self.timeout_s:g} s "
                "(--grammar-compile-timeout)"
            )
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
        compile_timeout_s: float = 10.0,
        compile_memory_bytes: int = 2 << 30,
        max_grammar_bytes: int = 262144,
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
                tokenizer,
                vocab_size,
                stop_token_ids,
                max_workers,
                CompileBudget(compile_timeout_s, compile_memory_bytes),
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
        self.cache: OrderedDict[tuple[str, str, str], CompileJob] = OrderedDict()
        self.observer: GrammarObserver | None = None
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
            return self._refused(self.name, kind, e)
        key = (library, kind, source)
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            if self.observer is not None:
                self.observer.on_grammar_cache_hit(library)
            return PendingGrammar(kind, cached, self.compile_timeout_s, library)
        try:
            check_grammar_limits(kind, source, self.max_grammar_bytes, self.max_nesting_depth)
        except GrammarError as e:
            return self._refused(library, kind, e)
        job = CompileJob()
        job.future = self.executor.submit(self._compile, self.compilers[library], kind, source, job)
        self.cache[key] = job
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return PendingGrammar(kind, job, self.compile_timeout_s, library)

    def _refused(self, library: str, kind: str, error: GrammarError) -> PendingGrammar:
        """An already failed compile: the grammar is over the limits."""
        self.report_refused(library, error)
        job = CompileJob()
        job.future.set_exception(error)
        return PendingGrammar(kind, job, self.compile_timeout_s, library)

    def report_refused(self, library: str, error: GrammarError) -> None:
        """Tell the observer a request's grammar failed (here, or at run time)."""
        if self.observer is not None:
            self.observer.on_grammar_refused(library, error.reason)

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
        for compiler in self.compilers.values():
            compiler.close()

    def _compile(self, compiler: GrammarCompiler, kind: str, source: str, job: CompileJob) -> Any:
        """On a compile thread. A failure is reported where a request takes it
        (`GrammarQueue`), once per request."""
        start = time.perf_counter()
        compiled = compiler.compile(kind, source, job.mark_started)
        if self.observer is not None:
            self.observer.on_grammar_compile(compiler.name, time.perf_counter() - start)
        return compiled


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
