"""xgrammar behind the backend seam: its compiles (strict JSON schemas, regexes, EBNF),
its parse for the tokenizer's checks, and its matcher."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.grammar.compile_process import CompileBudget, CompileProcess, grammar_error
from engine.grammar.limits import GrammarError
from engine.grammar.strict_json import json_schema_grammar

NAME = "xgrammar"

_PARSERS: dict[str, Callable[[str], xgr.Grammar]] = {
    "json_schema": json_schema_grammar,
    "regex": xgr.Grammar.from_regex,
    "ebnf": xgr.Grammar.from_ebnf,
}


def parse(kind: str, source: str) -> xgr.Grammar:
    """`source` as an xgrammar grammar: about a millisecond, no vocabulary needed."""
    parser = _PARSERS.get(kind)
    if parser is None:
        raise GrammarError(f"unknown grammar kind {kind!r}")
    try:
        return parser(source)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses for bad input
        raise grammar_error(kind, e) from None


class XGrammarCompiler:
    """Token masks for a vocabulary: each grammar compiled first in one of `num_processes`
    children, killed past its budget (`compile_process`), then here; xgrammar's own cache
    off (the backend's holds each grammar once). JSON schemas compile without free
    whitespace: a small model given the choice loops on whitespace until max_tokens; and
    with every string strict JSON (`strict_json`), as tool-call arguments are parsed."""

    name = NAME

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None,
        num_processes: int,
        budget: CompileBudget,
    ):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._processes: queue.SimpleQueue[CompileProcess] = queue.SimpleQueue()
        self._all = [CompileProcess(info, budget) for _ in range(num_processes)]
        for process in self._all:
            self._processes.put(process)

    def compile(self, kind: str, source: str, on_start: Callable[[], None]) -> xgr.CompiledGrammar:
        """On a compile thread: parse here (a millisecond, the tokenizer's own check),
        compile in a free child within the budget, then here."""
        grammar = parse(kind, source)
        process = self._processes.get()
        try:
            process.check(kind, str(grammar), on_start)
        finally:
            self._processes.put(process)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:
            raise grammar_error(kind, e) from None

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def close(self) -> None:
        for process in self._all:
            process.close()


class XGrammarMatcher:
    """`GrammarMatcher` over xgrammar's matcher."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size: int = compiled.tokenizer_info.vocab_size

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(vocab_mask, row)

    def accept_token(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def allows_any_token(self) -> bool:
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bool(bits.flatten()[: self._vocab_size].any())

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        return self._matcher.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
