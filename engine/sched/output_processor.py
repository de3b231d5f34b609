"""What a batch's sampled tokens do to its requests (SGLang's
`scheduler_output_processor_mixin`), and the one place a request is finished.

`process_batch_result` commits each row's new KV, appends its token, records logprobs,
advances its grammar (with jump-forward), checks the stops, and caches, sends or ends the
request. Every request that advanced or finished is collected in `outputs` for the
event loop to send; `finish` and `fail` are the only ways a request ends. A verify batch's
accepted tokens go through the same `advance` and `after_token`, from speculative
decoding's `process_verify` (engine/speculative/verify_output.py).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from engine.detokenize import StopStringMatcher
from engine.grammar import GrammarBackend, GrammarMatcher, ReasoningGrammarMatcher
from engine.grammar.cost import GrammarCostError
from engine.grammar.jump_forward import JumpForward, decodes_concatenatively, plan_jump_forward
from engine.sched.batch import ScheduleBatch
from engine.sched.batch_result import BatchResult
from engine.sched.cache_manager import CacheManager
from engine.sched.req import FinishReason, Req, ReqStatus
from engine.sched.retract import release_req
from engine.sched.stats import SchedulerStats

logger = logging.getLogger(__name__)

AnyGrammarMatcher = GrammarMatcher | ReasoningGrammarMatcher
"""A request's grammar state: plain, or waiting for the end of a reasoning section."""


class Processed(NamedTuple):
    """What a batch's result moves between the scheduler's queues."""

    leaving: list[Req]
    """Leave the running batch: finished, failed or jumped forward."""
    requeued: list[Req]
    """Jumped forward: back to the front of the waiting queue, in this order."""


class OutputProcessor:
    def __init__(
        self,
        cache_manager: CacheManager,
        stats: SchedulerStats,
        context_len: int,
        stop_strings: StopStringMatcher | None,
        grammar_backend: GrammarBackend | None,
        enable_jump_forward: bool,
        grammar_step_timeout_s: float | None = None,
    ):
        self.cache_manager = cache_manager
        self.stats = stats
        self.context_len = context_len
        self.stop_strings = stop_strings
        """None without a tokenizer: stop strings are then refused at submission."""
        self.grammar_backend = grammar_backend
        self.grammar_step_timeout_s = grammar_step_timeout_s
        """A request whose grammar took longer than this to accept its token (and plan a
        jump-forward) ends with a cost error: the time is spent on the scheduler's thread,
        and an Earley state that grew this large grows on. None: no limit (tp > 1)."""
        self.jump_forward = False
        """Grammar-forced text is taken in one extend (`--enable-jump-forward`), where the
        tokenizer's pieces decode independently."""
        if enable_jump_forward and grammar_backend is not None:
            self.jump_forward = decodes_concatenatively(grammar_backend.tokenizer)
            if not self.jump_forward:
                logger.warning(
                    "jump-forward is off: this tokenizer's pieces do not decode independently"
                )
        self.outputs: list[Req] = []
        """Requests that advanced or finished since the event loop last took them."""

    def take_outputs(self) -> list[Req]:
        outputs, self.outputs = self.outputs, []
        return outputs

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Mark `req` finished and send it; whoever holds it in a queue drops it."""
        req.finish(reason)
        self.outputs.append(req)

    def fail(self, req: Req, stage: str, error: Exception) -> bool:
        """Contain an error raised while handling `req` alone: log it once with its
        traceback, free its KV without caching it, and finish it with a server error that
        the client sees; the loop serves the other requests on. True: like any finished
        request it leaves the running batch."""
        logger.error("request %s failed while %s", req.rid, stage, exc_info=error)
        if req.kv.req_pool_idx is not None:
            release_req(req, self.cache_manager)
        message = (
            f"internal server error while {stage} ({type(error).__name__}); "
            "the request was stopped, and the server serves other requests on"
        )
        self.finish(req, FinishReason("abort", message=message))
        return True

    def fail_faults(self, batch: ScheduleBatch) -> Processed:
        """Fail each request whose grammar raised while masking its row, or ran over its
        mask budget (a 400 that names the cost): its row sampled unconstrained, so the
        token is void. The batch's `Processed`, to fill on."""
        processed = Processed([], [])
        for req, error in batch.faults:
            if req.finished:
                continue
            processed.leaving.append(req)
            if isinstance(error, GrammarCostError):
                self._backend().report_refused(req.grammar.library, error)
                if req.kv.req_pool_idx is not None:  # its token is void: nothing to cache
                    release_req(req, self.cache_manager)
                self.finish(req, FinishReason("abort", message=str(error), status_code=400))
            else:
                self.fail(req, "masking its grammar's tokens", error)
        return processed

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> Processed:
        """Commit each request's new KV, append its sampled token and end, cache or send it.

        A batch's prefill rows come first and take `_process_extend`; its decode rows are
        most of the work at large batches, so a plain decode (no logprobs, grammar or stop
        strings) that neither hits a stop token nor reaches its length takes a short path
        of a few attribute reads and one set lookup."""
        num_extend = batch.num_extend_reqs
        reqs, tokens = batch.reqs, result.next_token_ids
        processed = self.fail_faults(batch)
        generated = 0
        for i in range(num_extend):
            generated += self._process_extend(batch, result, i, processed)
        commit, outputs = self.cache_manager.commit, self.outputs
        for i in range(num_extend, len(reqs)):
            req = reqs[i]
            if req.finished:
                continue  # finished or aborted while this batch ran; its KV is already freed
            commit(req, 1)
            token = tokens[i]
            output_ids = req.output_ids
            output_ids.append(token)
            generated += 1
            if (
                req.stop.plain_decode
                and token not in req.stop.stop_ids
                and len(output_ids) < req.sampling_params.max_new_tokens
            ):
                outputs.append(req)
            else:
                self.after_token(req, token, _row_logprob(result, i), processed)
        self.stats.generation_tokens += generated
        return processed

    def _process_extend(
        self, batch: ScheduleBatch, result: BatchResult, i: int, processed: Processed
    ) -> int:
        """Row `i`, a prefill (or its last chunk); the number of tokens it generated."""
        req = batch.reqs[i]
        if req.finished:
            return 0
        self.cache_manager.commit(req, batch.extend_lens[i])
        if req.prompt_logprobs_pending:
            try:
                _add_prompt_logprobs(req, result, i)
            except Exception as e:
                processed.leaving.append(req)
                self.fail(req, "gathering its prompt logprobs", e)
                return 0
        if id(req) in batch.chunked:
            self.cache_manager.cache_unfinished_req(req)
            return 0
        if req.sampling_params.max_new_tokens == 0:  # a prefill alone: nothing to sample
            self.cache_manager.cache_finished_req(req)
            self.finish(req, FinishReason("length"))
            processed.leaving.append(req)
            return 0
        token = result.next_token_ids[i]
        req.output_ids.append(token)
        # A prompt's prefill is shared at once; a retracted or jumped request's extend stays
        # its own (over two pools an insert now would drop the SWA KV before the tokens its
        # next jump keeps, and the match after that jump would recompute them).
        fresh = len(req.output_ids) == 1
        self.after_token(req, token, _row_logprob(result, i), processed, fresh_prefill=fresh)
        return 1

    def after_token(
        self,
        req: Req,
        token: int,
        logprob: TokenLogprob,
        processed: Processed,
        fresh_prefill: bool = False,
    ) -> None:
        """Record the logprobs of the token just appended, advance the grammar,
        and end the request or send it on (into `processed` when it leaves the batch).

        What runs the request's own logprobs, grammar, stop strings or jump-forward plan is
        contained: an error there fails this request alone (`fail`) and the batch goes on.
        The KV hand-overs stay outside the guard: an error in them is the scheduler's own."""
        grammar = req.grammar.matcher
        started = time.perf_counter()
        try:
            reason = self.advance(req, token, logprob)
            plan = (
                self._plan_jump_forward(req, grammar)
                if reason is None and self.jump_forward and grammar is not None
                else None
            )
        except Exception as e:
            processed.leaving.append(req)
            self.fail(req, "processing its sampled token", e)
            return
        if reason is None and grammar is not None:
            reason = self._over_step_budget(req, time.perf_counter() - started)
        if reason is not None:
            self.cache_manager.cache_finished_req(req)
            self.finish(req, reason)
            processed.leaving.append(req)
            return
        if fresh_prefill:  # share the fresh prefill with later requests now
            self.cache_manager.cache_unfinished_req(req)
        self.outputs.append(req)
        if plan is not None:
            self._jump_forward(req, plan)
            processed.leaving.append(req)
            processed.requeued.append(req)

    def _over_step_budget(self, req: Req, seconds: float) -> FinishReason | None:
        """The cost error that ends `req` if its grammar's step took `seconds`, too long."""
        budget = self.grammar_step_timeout_s
        if budget is None or seconds <= budget:
            return None
        error = GrammarCostError(
            f"the grammar is too costly to follow here: accepting a token took "
            f"{seconds * 1000:.0f} ms, longer than {budget * 1000:g} ms "
            "(--grammar-mask-timeout-ms)"
        )
        self._backend().report_refused(req.grammar.library, error)
        return FinishReason("abort", message=str(error), status_code=400)

    def advance(self, req: Req, token: int, logprob: TokenLogprob) -> FinishReason | None:
        """Record the logprobs of the token just appended and advance the grammar; why the
        request ends now, if it does."""
        params = req.sampling_params
        if params.logprobs:
            assert logprob.logprob is not None, "the sampler returns logprobs when a request asks"
            req.output.token_logprobs.append((logprob.logprob, token))
            if params.top_logprobs_num:
                assert logprob.top is not None, "as for logprobs"
                req.output.top_logprobs.append(logprob.top[: params.top_logprobs_num])
        grammar = req.grammar.matcher
        reason = _accept_grammar_token(grammar, token) if grammar is not None else None
        return reason or self.check_finished(req)

    def check_finished(self, req: Req) -> FinishReason | None:
        params = req.sampling_params
        num_output = len(req.output_ids)
        if num_output >= params.max_new_tokens:
            return FinishReason("length")
        if num_output >= params.min_new_tokens:
            token = req.output_ids[-1]
            if token in req.stop.stop_ids:
                return FinishReason("stop", matched=token)
            if params.stop and self.stop_strings is not None:
                matched = self.stop_strings.match(
                    req.output_ids, params.stop, params.skip_special_tokens
                )
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        if len(req.origin_input_ids) + num_output >= self.context_len:
            return FinishReason("length")
        return None

    def _plan_jump_forward(self, req: Req, matcher: AnyGrammarMatcher) -> JumpForward | None:
        """The tokens of the text the grammar forces now, with the matcher already moved
        onto them; None (matcher unchanged) when there is nothing to take."""
        params = req.sampling_params
        forced = matcher.find_jump_forward_string()
        if not forced or params.logprobs:  # forced tokens have no sampled logprobs to report
            return None
        plan = plan_jump_forward(self._tokenizer(), req.output_ids, forced)
        if plan is None:
            return None
        new_len = len(req.output_ids) - plan.rollback + len(plan.token_ids)
        if (
            new_len >= params.max_new_tokens
            or len(req.origin_input_ids) + new_len >= self.context_len
        ):
            return None  # the forced text would end the request: decode up to the limit
        if params.stop and self._forced_text_hits_stop(req, forced):
            return None  # decode it token by token, so that the stop check ends the request
        if not _retokenize_grammar(matcher, req.output_ids, plan):
            return None
        return plan

    def _jump_forward(self, req: Req, plan: JumpForward) -> None:
        """Take the forced tokens of `plan`. The request leaves the running batch with its
        KV handed to the radix tree and returns through the waiting queue as an extend of
        the forced tokens: one forward pass instead of one per token. Under the overlap
        loop nothing of it is in flight here: the scheduler resolved its last batch before
        building the next, as for every grammar request."""
        kept = len(req.output_ids) - plan.rollback
        self.cache_manager.cache_finished_req(req, len(req.origin_input_ids) + kept)
        del req.output_ids[kept:]
        req.output_ids += plan.token_ids
        req.output.rollback = plan.rollback
        req.lifecycle.status = ReqStatus.WAITING
        self.stats.jump_forwards += 1
        self.stats.jump_forward_tokens += len(plan.token_ids) - plan.rollback

    def _forced_text_hits_stop(self, req: Req, forced: str) -> bool:
        params = req.sampling_params
        assert self.stop_strings is not None, "a grammar backend comes with a tokenizer"
        hit = self.stop_strings.match(
            req.output_ids, params.stop, params.skip_special_tokens, forced
        )
        return hit is not None

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        """The grammar backend's tokenizer."""
        return self._backend().tokenizer

    def _backend(self) -> GrammarBackend:
        """The grammar backend: there whenever a request has a grammar."""
        if self.grammar_backend is None:
            raise RuntimeError("a grammar request reached a scheduler without a grammar backend")
        return self.grammar_backend


class TokenLogprob(NamedTuple):
    """A sampled token's logprob and likeliest alternatives, where the request asked."""

    logprob: float | None
    top: list[tuple[float, int]] | None


def _row_logprob(result: BatchResult, i: int) -> TokenLogprob:
    logprobs, top = result.next_token_logprobs, result.top_logprobs
    return TokenLogprob(None if logprobs is None else logprobs[i], None if top is None else top[i])


def _accept_grammar_token(matcher: AnyGrammarMatcher, token: int) -> FinishReason | None:
    """Advance the matcher; a terminated grammar ends the request, its stop token (the
    model's EOS) counting as the matched stop token."""
    if not matcher.accept_token(token):
        if not matcher.allows_any_token():  # every token was masked: the draw was arbitrary
            return FinishReason(
                "abort",
                message="no token of the model's vocabulary can continue the json_schema, "
                "regex or ebnf here: it needs text this tokenizer cannot produce",
                status_code=400,
            )
        # The mask allowed only grammar tokens, so this is a bug, not the client's fault.
        return FinishReason("abort", message=f"token {token} was sampled outside the grammar")
    if matcher.is_terminated():
        return FinishReason("stop", matched=token)
    return None


def _retokenize_grammar(
    matcher: AnyGrammarMatcher, output_ids: list[int], plan: JumpForward
) -> bool:
    """Move the matcher onto the re-encoded tokens; False (matcher unchanged) if it refuses
    one, which only a special token inside the forced text could cause."""
    replaced = output_ids[len(output_ids) - plan.rollback :]
    matcher.rollback(plan.rollback)
    for n, token in enumerate(plan.token_ids):
        if not matcher.accept_token(token):
            matcher.rollback(n)
            for old in replaced:
                matcher.accept_token(old)
            return False
    return True


def _add_prompt_logprobs(req: Req, result: BatchResult, i: int) -> None:
    """Append what batch row `i` computed of `req`'s prompt logprobs; position 0, which
    nothing predicts, is None and comes first."""
    params = req.sampling_params
    if not req.output.prompt_logprobs and params.logprob_start_len == 0:
        req.output.prompt_logprobs.append(None)
        if params.prompt_top_logprobs_num:
            req.output.prompt_top_logprobs.append([])
    if result.input_token_logprobs is not None:
        req.output.prompt_logprobs += result.input_token_logprobs[i]
    if params.prompt_top_logprobs_num and result.input_top_logprobs is not None:
        k = params.prompt_top_logprobs_num
        req.output.prompt_top_logprobs += [top[:k] for top in result.input_top_logprobs[i]]
