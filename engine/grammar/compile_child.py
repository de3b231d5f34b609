"""The child of `compile_process`: it compiles the xgrammar grammars (EBNF) its parent
sends, one at a time, with one thread (the worker's cores serve the model), and says
whether each compiled: the parent, knowing the compile ends within its budget, compiles
it again itself (sending a compiled grammar back serialized cost more than the compile:
24 s and 3.8 GB for one of JSONSchemaBench's schemas that compiles in 0.07 s). Run as a
script, not a module of the package: it imports xgrammar alone.

    python compile_child.py FD    (FD: its end of a socket pair)
"""

import sys
from multiprocessing.connection import Connection

import xgrammar as xgr


def serve(conn: Connection) -> None:
    """The first message is the vocabulary (xgrammar's TokenizerInfo); "ready" answers it.
    Then (True, "") or (False, xgrammar's message) per grammar; ends when the parent
    goes."""
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            ebnf = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
        except Exception as e:  # xgrammar's own errors for a grammar it cannot compile
            conn.send((False, str(e)))
        else:
            conn.send((True, ""))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
