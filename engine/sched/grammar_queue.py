"""Requests whose grammar (json_schema, regex, ebnf) is compiling: they wait here, off the
waiting queue, until the compile ends; then they get their matcher and go on to the
waiting queue, or fail alone with a 400."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from typing import NamedTuple

from engine.grammar import GrammarBackend, GrammarError, PendingGrammar
from engine.sched.output_processor import OutputProcessor
from engine.sched.req import FinishReason, Req, take_by_rid

GRAMMAR_POLL_INTERVAL_S = 0.005
"""With only compiling requests to serve, a round waits this long for a compile to end
rather than spin; short, so that the event loop still receives new requests promptly."""


class CompilesDone(NamedTuple):
    """What left the queue in one look: `ready` to wait (in queue order), and the rids of
    the ready and of the failed with their reasons, as tensor-parallel followers take them."""

    ready: list[Req]
    ready_rids: list[str]
    failed: list[tuple[str, FinishReason]]


class GrammarQueue:
    def __init__(self, backend: GrammarBackend | None, outputs: OutputProcessor):
        self.backend = backend
        self.outputs = outputs
        self.reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def submit(self, req: Req, grammar: tuple[str, str]) -> None:
        """Start compiling `req`'s grammar; it waits here meanwhile."""
        req.grammar.pending = self._backend().submit(*grammar)
        self.reqs.append(req)

    def remove(self, rid: str) -> Req | None:
        """Take request `rid` out (an abort), if it waits here."""
        return take_by_rid(self.reqs, rid)

    def take_done(self, idle: bool) -> CompilesDone:
        """The requests whose compile ended: the compiled with their matchers; a failed or
        timed-out compile fails its request alone with a 400. When the scheduler is `idle`
        otherwise, waits briefly for a compile rather than spin."""
        if idle:
            pending = [_pending_grammar(r).future for r in self.reqs]
            wait(pending, timeout=GRAMMAR_POLL_INTERVAL_S, return_when=FIRST_COMPLETED)
        still_compiling: list[Req] = []
        done = CompilesDone([], [], [])
        for req in self.reqs:
            try:
                compiled = _pending_grammar(req).result()
            except GrammarError as e:
                self._backend().report_refused(_pending_grammar(req).backend, e)
                self.outputs.finish(req, FinishReason("abort", message=str(e), status_code=400))
            except Exception as e:
                self.outputs.fail(req, "compiling its grammar", e)
            else:
                if compiled is None:
                    still_compiling.append(req)
                elif self._give_matcher(req):
                    done.ready.append(req)
                    done.ready_rids.append(req.rid)
                continue
            assert req.lifecycle.finished_reason is not None, "finished just above"
            done.failed.append((req.rid, req.lifecycle.finished_reason))
        self.reqs = still_compiling
        return done

    def follow(self, ready: list[str], failed: dict[str, FinishReason]) -> list[Req]:
        """A rank other than 0 takes rank 0's word on which compiles ended and how (when
        one ends depends on thread timing): the failed finish with rank 0's reason; the
        ready, returned in rank 0's order, wait for their compile here."""
        by_rid = {req.rid: req for req in self.reqs}
        self.reqs = [r for r in self.reqs if r.rid not in failed and r.rid not in ready]
        for rid, reason in failed.items():
            self.outputs.finish(by_rid[rid], reason)
        taken = []
        for rid in ready:
            req = by_rid[rid]
            if self._give_matcher(req):
                taken.append(req)
        return taken

    def _give_matcher(self, req: Req) -> bool:
        """Give `req` the matcher of its finished compile; False if that failed it."""
        pending = _pending_grammar(req)
        try:
            req.grammar.matcher = self._backend().new_matcher(
                pending, req.sampling_params.reasoning
            )
        except Exception as e:
            self.outputs.fail(req, "compiling its grammar", e)
            return False
        req.grammar.pending = None
        req.grammar.library = pending.backend
        return True

    def _backend(self) -> GrammarBackend:
        """The backend, there whenever a request has a grammar (`add_request` checks)."""
        if self.backend is None:
            raise RuntimeError("a grammar request reached a scheduler without a grammar backend")
        return self.backend


def _pending_grammar(req: Req) -> PendingGrammar:
    """The compile a request in the grammar queue waits for."""
    if req.grammar.pending is None:
        raise RuntimeError(f"request {req.rid} is in the grammar queue without a compile")
    return req.grammar.pending
