"""xgrammar compiles tried first in a child process that can be killed: a compile is
native code that cannot be interrupted, so one past its time or memory budget would
otherwise hold a core (and its memory) until it ends. The child (`compile_child`) says
whether the grammar compiled within the budget; only then does the worker compile it
itself, a compile now known to end. llguidance needs none of this: its own limits bound
a compile's work before it starts.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import xgrammar as xgr

from engine.grammar.limits import GrammarError

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's messages start with "[time] source.cc:line: ", which tells a client nothing."""
_CHILD = Path(__file__).with_name("compile_child.py")
"""The child's script: run as a file, it imports xgrammar alone (seconds less to start than
the `engine` package)."""
STARTUP_TIMEOUT_S = 120.0
"""How long a child may take to import xgrammar and load the vocabulary."""
NICENESS = 10
"""About a tenth of a core for a compile when every core is busy serving (a compile that
then runs past its budget is stopped like any other)."""
POLL_INTERVAL_S = 0.02
"""How often a wait for the child looks at its memory."""


class CompileBudget:
    """What one compile may take: seconds of wall time and bytes of resident memory."""

    def __init__(self, timeout_s: float, max_memory_bytes: int):
        self.timeout_s = timeout_s
        self.max_memory_bytes = max_memory_bytes


class CompileProcess:
    """One child compiling xgrammar grammars, used by one compile thread at a time (the
    backend's pool checks them out). Started in the background at construction and again
    after a kill; a compile waits for the start first, outside its budget. `close` may
    come from another thread while a compile waits: it kills the child, which ends that
    wait, and only then closes the connection (whose descriptor a new one may reuse)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, budget: CompileBudget):
        self._info_json = tokenizer_info.serialize_json()
        self._budget = budget
        self._lock = threading.RLock()
        """Held while the connection is used, and to close it."""
        self._closed = False
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._sender: threading.Thread | None = None
        self._ready = False
        self._start()

    def _start(self) -> None:
        """A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's
        main module: a script that builds an Engine at top level would start it again)."""
        parent, child = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, str(_CHILD), str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        # Below the model's threads from its first import on: a child busy on a core that
        # the forward's threads share makes every forward wait for the thread it slows.
        os.setpriority(os.PRIO_PROCESS, self._process.pid, NICENESS)
        child.close()
        self._conn = Connection(parent.detach())
        # The vocabulary is megabytes: the send blocks until the child, still importing,
        # reads it, so it goes from a thread; the child answers "ready" after reading it.
        self._sender = threading.Thread(
            target=_send_quietly, args=(self._conn, self._info_json), daemon=True
        )
        self._sender.start()
        self._ready = False

    def check(self, kind: str, ebnf: str, on_start: Callable[[], None] = lambda: None) -> None:
        """Compile a `kind` grammar, given as xgrammar's EBNF, in the child; GrammarError
        for one xgrammar refuses, or past the budget (the child is then killed and a
        fresh one started). `on_start` hears the start of the budget: after the child's
        own start, which is not the grammar's cost."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile processes were stopped")
            try:
                if not self._ready:
                    self._wait_ready()
                on_start()
                self._compile(kind, ebnf)
            except (EOFError, OSError):  # the child died, or `close` killed it
                self._kill()
                if not self._closed:
                    self._start()
                raise RuntimeError("the grammar compile process stopped") from None

    def _wait_ready(self) -> None:
        """Wait for a started child to have loaded xgrammar and the vocabulary (seconds):
        the start is not the grammar's cost, so it is not counted in its budget."""
        assert self._conn is not None, "started"
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            raise OSError(f"no grammar compile process started in {STARTUP_TIMEOUT_S:g} s")
        self._conn.recv()
        self._ready = True

    def _compile(self, kind: str, ebnf: str) -> None:
        assert self._conn is not None and self._process is not None, "started"
        self._conn.send(ebnf)
        deadline = time.monotonic() + self._budget.timeout_s
        while not self._conn.poll(POLL_INTERVAL_S):
            if time.monotonic() >= deadline:
                self._restart()
                raise CompileKilled(
                    f"compiling the {kind} took longer than {self._budget.timeout_s:g} s "
                    "(--grammar-compile-timeout); the compile was stopped"
                )
            if _resident_bytes(self._process.pid) > self._budget.max_memory_bytes:
                self._restart()
                raise CompileKilled(
                    f"compiling the {kind} took more than "
                    f"{self._budget.max_memory_bytes >> 20} MiB (--grammar-compile-memory-mb); "
                    "the compile was stopped"
                )
        ok, message = self._conn.recv()
        if not ok:
            raise grammar_error(kind, RuntimeError(message))

    def _restart(self) -> None:
        self._kill()
        self._start()

    def _kill(self) -> None:
        """Kill the child and close the connection; the lock is held."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        if self._sender is not None:
            self._sender.join()  # its send fails at once with the child gone
        if self._conn is not None:
            self._conn.close()  # only now: no thread may still write to its descriptor
        self._process = self._conn = self._sender = None

    def close(self) -> None:
        """Stop the child for good (from any thread)."""
        self._closed = True
        process = self._process
        if process is not None:
            process.kill()  # ends a compile's wait, which then lets the lock go
        with self._lock:
            self._kill()


def grammar_error(kind: str, exc: Exception) -> GrammarError:
    """xgrammar's complaint about a `kind` grammar, in words for the client."""
    return GrammarError(f"invalid {kind}: {_LOG_PREFIX.sub('', str(exc)).strip()}")


class CompileKilled(GrammarError):
    """A compile stopped at its budget: the request's 400 says which."""

    reason = "compile_budget"


def _resident_bytes(pid: int | None) -> int:
    """The child's resident memory (0 once it is gone or before it has a pid)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _send_quietly(conn: Connection, message: object) -> None:
    """Send, unless the child is killed first (a compile then sees it gone)."""
    try:
        conn.send(message)
    except OSError:
        pass
