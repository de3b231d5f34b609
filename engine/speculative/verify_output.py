"""What a verify batch's accepted tokens do to its requests: the verify side of
`OutputProcessor.process_batch_result`, through the same per-token steps (`advance`,
`after_token`) and the same ways to finish or fail a request."""

from __future__ import annotations

import torch

from engine.sched.batch import ScheduleBatch
from engine.sched.output_processor import OutputProcessor, Processed, TokenLogprob
from engine.sched.req import FinishReason, Req
from engine.speculative.drafter import draft_state
from engine.speculative.verify import VerifyOutput


def process_verify(
    outputs: OutputProcessor, batch: ScheduleBatch, verify: VerifyOutput, processed: Processed
) -> int:
    """Each request of a verify batch appends the tokens its walk accepted, one at a
    time, up to the one that finishes it (a stop token or string, its length, mid-draft
    or not); it keeps the K/V of the path nodes that fed them, and every other slot of
    the batch (rejected drafts, tokens past a finish, requests that ended while it ran)
    is freed at once. The number of tokens generated."""
    cache_manager, out_cache_loc = outputs.cache_manager, batch.forward_batch.out_cache_loc
    keep = torch.zeros(len(out_cache_loc), dtype=torch.bool)
    generated = 0
    for i, req in enumerate(batch.reqs):
        if req.finished:
            continue
        taken, reason = _take_verified(outputs, req, verify, i, processed)
        if req.finished:  # failed while taking them: its KV is released already
            continue
        path = torch.tensor(verify.path_rows[i][:taken])
        keep[path] = True
        cache_manager.keep_verified(req, out_cache_loc[path])
        state = draft_state(req)
        state.verify_ct += 1
        state.accepted_drafts += taken - 1
        outputs.stats.count_verified(batch.trees[i].num_drafts if batch.trees else 0, taken)
        generated += taken
        if reason is not None:  # finished mid-draft
            cache_manager.cache_finished_req(req)
            outputs.finish(req, reason)
            processed.leaving.append(req)
            continue
        last = verify.tokens[i][-1]
        outputs.after_token(req, last, _verified_logprob(verify, i, taken - 1), processed)
    cache_manager.free_slots(out_cache_loc[~keep])
    return generated


def _take_verified(
    outputs: OutputProcessor, req: Req, verify: VerifyOutput, i: int, processed: Processed
) -> tuple[int, FinishReason | None]:
    """Append row `i`'s accepted tokens but the last, advancing the grammar and checking
    the stops after each; the last is appended too and left to `after_token` (its
    grammar, jump-forward, sending). (How many were appended, why the request ends if
    it ends before the last.)"""
    tokens = verify.tokens[i]
    for k, token in enumerate(tokens[:-1]):
        req.output_ids.append(token)
        try:
            reason = outputs.advance(req, token, _verified_logprob(verify, i, k))
        except Exception as e:
            processed.leaving.append(req)
            outputs.fail(req, "processing its verified tokens", e)
            return k + 1, None
        if reason is not None:
            return k + 1, reason
    req.output_ids.append(tokens[-1])
    return len(tokens), None


def _verified_logprob(verify: VerifyOutput, i: int, k: int) -> TokenLogprob:
    """The logprobs of request `i`'s `k`-th accepted token of a verify batch."""
    logprobs, top = verify.logprobs, verify.top_logprobs
    return TokenLogprob(
        None if logprobs is None else logprobs[i][k], None if top is None else top[i][k]
    )
