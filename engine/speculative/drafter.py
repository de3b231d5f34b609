"""`Drafter`, the one interface of speculative decoding's drafters (`propose`,
`on_verified`), and NGRAM's drafter; STANDALONE's drafts with a model (standalone.py).

Each decode step `propose` decides which running requests draft, and how many tokens,
within the KV room and the verify rows there are, and asks the algorithm for their draft
trees. `on_verified` is adaptive drafting: it sizes each request's drafts by what was
accepted and stops a request drafting while its drafts do not pay.

A draft needs the tokens the last step sampled, so the scheduler proposes once nothing of
the running requests is in flight. When no request drafts anything the step is a plain
decode batch (its fast path, its CUDA graph); otherwise every running request joins one
verify batch, a request without drafts as a tree of its root alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine import constants
from engine.sched.req import Req
from engine.speculative.draft_state import DraftState
from engine.speculative.draft_tree import DraftTree
from engine.speculative.grammar import constrain
from engine.speculative.ngram import NgramConfig, NgramState, NgramTrie
from engine.speculative.verify import VerifyOutput

_EMA_WEIGHT = 0.3


def draft_state(req: Req) -> DraftState:
    """`req`'s drafting state, a fresh one on its first step."""
    if req.draft_state is None:
        req.draft_state = DraftState()
    return req.draft_state


class Drafter(ABC):
    def __init__(self, num_draft_tokens: int, context_len: int, adaptive: bool) -> None:
        self.budget = num_draft_tokens - 1
        """Drafted tokens per request and step, at most."""
        self.context_len = context_len
        self.adaptive = adaptive
        self.step = 0

    def propose(self, reqs: list[Req], room: int) -> list[DraftTree] | None:
        """Each request's draft tree for this step, `room` drafted tokens in all at most;
        None when nobody drafts (the step is then a plain decode)."""
        self.step += 1
        budgets: list[int] = []
        drafted = 0
        for req in reqs:
            state = draft_state(req)
            budget = min(self.budget, state.draft_len, room - drafted, self._depth_left(req))
            budgets.append(budget if budget > 0 and self._drafts(req, state) else 0)
            drafted += budgets[-1]
        if not drafted:
            return None
        trees = [
            constrain(tree, req.grammar.matcher)
            if req.grammar.matcher is not None and tree.num_drafts
            else tree
            for req, tree in zip(reqs, self.draft(reqs, budgets))
        ]
        return trees if any(tree.num_drafts for tree in trees) else None

    @abstractmethod
    def draft(self, reqs: list[Req], budgets: list[int]) -> list[DraftTree]:
        """Each request's tree of up to `budgets[i]` drafted tokens (a root alone for 0)."""

    def on_verified(self, reqs: list[Req], trees: list[DraftTree], verify: VerifyOutput) -> None:
        """Adaptive drafting. Each drafted request's next draft length follows its last
        outcome: a draft accepted to its deepest node doubles it, a miss cuts it to the
        accepted length plus one, so that rows the target would reject are not paid for.
        Its acceptance also updates its average; below what a row costs at this batch size
        (`SPEC_ROW_COST_RATIO`) after the warm-up, it pauses for its back-off, which
        doubles each time (up to 16x) and resets once drafts pay."""
        if not self.adaptive:
            return
        pays = len(reqs) / (len(reqs) + constants.SPEC_ROW_COST_RATIO)
        for req, tree, tokens in zip(reqs, trees, verify.tokens):
            state = req.draft_state
            if state is None or not tree.num_drafts:
                continue
            accepted = len(tokens) - 1
            deepest = max(tree.depths)
            state.draft_len = min(self.budget, 2 * deepest) if accepted >= deepest else accepted + 1
            state.acceptance += _EMA_WEIGHT * (accepted / tree.num_drafts - state.acceptance)
            state.drafted_steps += 1
            if state.drafted_steps < constants.SPEC_ADAPTIVE_WARMUP_STEPS:
                continue
            if state.acceptance < pays:
                state.paused_until = self.step + state.backoff
                state.backoff = min(state.backoff * 2, constants.SPEC_ADAPTIVE_BACKOFF_STEPS * 16)
                state.drafted_steps, state.acceptance = 0, 1.0
            else:
                state.backoff = constants.SPEC_ADAPTIVE_BACKOFF_STEPS

    def _drafts(self, req: Req, state: DraftState) -> bool:
        """Whether `req` drafts this step. Not while paused; not under penalties, logit_bias
        or min_new_tokens, whose biases depend on the tokens before each position (such a
        request decodes one token per step in the verify batch). A grammar's drafts are
        filtered and masked per node (engine/speculative/grammar.py)."""
        params = req.sampling_params
        return state.paused_until <= self.step and not (
            params.frequency_penalty
            or params.presence_penalty
            or params.repetition_penalty != 1.0
            or params.logit_bias
            or len(req.output_ids) < params.min_new_tokens
        )

    def _depth_left(self, req: Req) -> int:
        """Drafts past the request's last token are wasted: a step also samples one more."""
        by_length = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        by_context = self.context_len - req.seqlen - 1
        return min(by_length, by_context)


class NgramDrafter(Drafter):
    """SGLang's NGRAM: drafts from a trie of every request's prompt and output."""

    def __init__(
        self, config: NgramConfig, num_draft_tokens: int, context_len: int, adaptive: bool
    ) -> None:
        super().__init__(num_draft_tokens, context_len, adaptive)
        self.trie = NgramTrie(config)

    def propose(self, reqs: list[Req], room: int) -> list[DraftTree] | None:
        """As `Drafter.propose`; every request's new tokens go into the trie first,
        drafting or not."""
        for req in reqs:
            self._feed(req, draft_state(req))
        return super().propose(reqs, room)

    def _feed(self, req: Req, state: DraftState) -> None:
        """The request's tokens the trie has not seen, without copying the ones it has
        (`all_token_ids` would copy the whole prompt every step)."""
        if state.ngram.fed > req.seqlen:  # a jump-forward replaced output tokens
            state.ngram = NgramState(fed=req.seqlen)
        start, prompt = state.ngram.fed, req.origin_input_ids
        if start >= len(prompt):
            self.trie.feed(state.ngram, req.output_ids[start - len(prompt) :])
        else:
            self.trie.feed(state.ngram, prompt[start:] + req.output_ids)

    def draft(self, reqs: list[Req], budgets: list[int]) -> list[DraftTree]:
        return [self._tree(req, budget) for req, budget in zip(reqs, budgets)]

    def _tree(self, req: Req, budget: int) -> DraftTree:
        last = req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
        if not budget:
            return DraftTree.root(last)
        assert req.draft_state is not None, "fed before"
        return self.trie.draft(req.draft_state.ngram, last, budget, budget)
