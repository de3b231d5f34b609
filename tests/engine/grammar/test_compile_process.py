"""xgrammar's compiles tried in a child process: past the time or memory budget the child
is killed (its pid gone) and the request gets a GrammarError saying why; the next compile
runs in a fresh child."""

import os

import pytest
import xgrammar as xgr

from engine.grammar.compile_process import CompileBudget, CompileKilled, CompileProcess
from engine.grammar.limits import GrammarError
from engine.model.tokenizer_cache import load_tokenizer

SLOW = str(xgr.Grammar.from_regex('[^"]{0,60000}'))  # about 1.7 s to compile on two cores
AB = str(xgr.Grammar.from_regex("[ab]{2}"))


@pytest.fixture(scope="module")
def info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo.from_huggingface(
        load_tokenizer("embedded"), vocab_size=49152, stop_token_ids=[2]
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_compile_past_its_time_is_killed_and_the_next_runs_in_a_fresh_child(info):
    process = CompileProcess(info, CompileBudget(timeout_s=0.3, max_memory_bytes=4 << 30))
    try:
        process.check("regex", AB)  # the child works
        first = process._process
        assert first is not None
        with pytest.raises(CompileKilled, match=r"took longer than 0.3 s"):
            process.check("regex", SLOW)
        assert first.poll() is not None and not _alive(first.pid)
        process.check("regex", AB)
        assert process._process is not None and process._process.pid != first.pid
    finally:
        process.close()


def test_a_compile_past_its_memory_is_killed(info):
    process = CompileProcess(info, CompileBudget(timeout_s=30, max_memory_bytes=1 << 20))
    try:
        with pytest.raises(CompileKilled, match=r"more than 1 MiB"):
            process.check("regex", SLOW)  # the interpreter alone is above 1 MiB
    finally:
        process.close()


def test_a_grammar_xgrammar_refuses_is_a_grammar_error_and_the_child_lives(info):
    process = CompileProcess(info, CompileBudget(timeout_s=30, max_memory_bytes=4 << 30))
    try:
        with pytest.raises(GrammarError, match="invalid ebnf") as refused:
            process.check("ebnf", 'root ::= "a" | undefined_rule')
        assert not isinstance(refused.value, CompileKilled)
        assert process._process is not None and process._process.poll() is None
    finally:
        process.close()
