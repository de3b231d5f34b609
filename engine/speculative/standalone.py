"""STANDALONE speculative decoding's drafter: a smaller model of the same tokenizer, run by
a scheduler of its own, drafts each request's next tokens greedily.

Each step, every drafting request becomes one greedy job of the draft scheduler over its
tokens so far, generating as many tokens as the request may draft. The draft scheduler is
the engine's own (`Scheduler` over the draft model's `ModelRunner`): its pools are its
own, and so is its radix tree, keyed by plain tokens, so a job prefills only what the
request added since its last step (its last accepted tokens) and the rest is a radix hit;
its batches, chunking and eviction are the scheduler's. Drafts are a chain per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req
from engine.speculative.draft_tree import DraftTree
from engine.speculative.drafter import Drafter


class DraftScheduler(Protocol):
    """What the drafter uses of the draft model's `Scheduler` (which `engine.build` builds
    and shuts down)."""

    context_len: int

    def add_request(self, req: Req) -> None: ...
    def run_event_loop(self, should_stop: Callable[[], bool]) -> None: ...


class StandaloneDrafter(Drafter):
    def __init__(
        self, scheduler: DraftScheduler, num_draft_tokens: int, context_len: int, adaptive: bool
    ) -> None:
        super().__init__(num_draft_tokens, context_len, adaptive)
        self.scheduler = scheduler
        self._ids = itertools.count()

    def draft(self, reqs: list[Req], budgets: list[int]) -> list[DraftTree]:
        """Each request's chain of up to `budgets[i]` greedy draft tokens (the draft
        model's context may end the chain early: none past its own context length)."""
        trees = [DraftTree.root(req.all_token_ids()[-1]) for req in reqs]
        limit = self.scheduler.context_len - 1
        jobs: list[tuple[int, Req]] = []
        for i, (req, budget) in enumerate(zip(reqs, budgets)):
            tokens = req.all_token_ids()
            budget = min(budget, limit - len(tokens))
            if budget <= 0:
                continue
            params = SamplingParams(temperature=0.0, max_new_tokens=budget, ignore_eos=True)
            job = Req(f"draft-{next(self._ids)}", tokens, params)
            self.scheduler.add_request(job)
            jobs.append((i, job))
        if not jobs:
            return trees
        self.scheduler.run_event_loop(lambda: all(job.finished for _, job in jobs))
        for i, job in jobs:
            tree = trees[i]
            node = 0
            for token in job.output_ids:
                node = tree.add(node, token)
        return trees
