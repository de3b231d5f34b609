"""The offline Engine: generate in-process over the same scheduler the server runs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from engine.args import EngineArgs
from engine.build import build
from engine.detokenize import IncrementalDetokenizer
from engine.model.runner import ModelRunner
from engine.outputs import GenerateMeta, GenerateResult, StreamChunk
from engine.sampling.sampling_params import SamplingParams
from engine.sched.finish_reason import text_ids
from engine.sched.req import Admission, Req
from engine.sched.scheduler import Scheduler, after_turns

Prompt = str | Sequence[int]
SamplingParamsArg = dict[str, Any] | Sequence[dict[str, Any]] | None


class Engine:
    """`Engine(model=None, **options)`: `None` is the embedded SmolLM2-135M-Instruct; the
    options are EngineArgs fields, the snake_case of the server's flags."""

    def __init__(self, model: str | None = None, **options: Any):
        args = EngineArgs.from_options(model=model or "embedded", **options)
        if args.node_rank > 0:
            raise ValueError(
                "node_rank > 0 runs worker ranks only (`python -m services.worker "
                "--node-rank K`, or engine.build.serve_node); the Engine is rank 0, on node 0"
            )
        self.core = build(args)
        self._rids = itertools.count()

    @property
    def args(self) -> EngineArgs:
        return self.core.args

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def model_runner(self) -> ModelRunner:
        return self.core.model_runner

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.core.tokenizer

    def generate(
        self,
        prompt: Prompt | Sequence[Prompt],
        sampling_params: SamplingParamsArg = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[GenerateResult]:
        """Generate for one prompt or a batch (text, or token ids); one `GenerateResult`
        per prompt. `sampling_params` is one dict for all prompts or one per prompt;
        `json_schema` may be a dict. A grammar that fails to compile comes back as a result
        whose finish_reason is an abort with status_code 400, not as an exception.
        `lora_name` is one LoRA adapter for all prompts or one (or None) per prompt."""
        prompts = _as_prompt_list(prompt)
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_name, len(prompts))
        reqs: list[Req] = []
        try:  # a rejected prompt, or an interrupt, must not leave its batch-mates queued
            for p, sp, lora in zip(prompts, params, loras):
                reqs.append(self._submit(p, sp, lora))
            self.scheduler.run_event_loop(should_stop=lambda: all(r.finished for r in reqs))
        finally:
            for req in reqs:
                if not req.finished:
                    self.scheduler.abort_request(req.rid)
        return [self._result(req) for req in reqs]

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | None = None,
        lora_name: str | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield a `StreamChunk` (the text delta and the new ids) as tokens arrive; the
        last chunk also carries `meta`. With jump-forward a chunk may carry `rollback=k`:
        the last k ids already yielded were re-encoded and `output_ids` replaces them (the
        text only ever grows)."""
        req = self._submit(prompt, SamplingParams.from_dict(sampling_params or {}), lora_name)
        detok = self._detokenizer(req)
        try:
            while not req.finished:
                self.scheduler.run_event_loop(should_stop=after_turns(1))
                start, rollback = req.read_output()
                new_ids = req.output_ids[start:]
                if new_ids or req.finished:
                    if detok and rollback:
                        detok.rollback(rollback)
                    text = detok.add_tokens(new_ids, finished=req.finished) if detok else ""
                    meta = _meta(req) if req.finished else None
                    yield StreamChunk(text, new_ids, rollback, meta)
        finally:
            if not req.finished:
                self.scheduler.abort_request(req.rid)

    def shutdown(self) -> None:
        """Stop the scheduler (at TP > 1, every rank's: `EngineCore.shutdown`)."""
        self.core.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _submit(self, prompt: Prompt, params: SamplingParams, lora_name: str | None = None) -> Req:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; this engine runs with skip_tokenizer_init"
                )
            input_ids = self.tokenizer.encode(prompt)
        else:
            input_ids = list(prompt)
        req = Req(
            str(next(self._rids)), input_ids, params, admission=Admission(lora_name=lora_name)
        )
        self.scheduler.add_request(req)
        return req

    def _detokenizer(self, req: Req) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, req.sampling_params.stop, req.sampling_params.skip_special_tokens
        )

    def _result(self, req: Req) -> GenerateResult:
        detok = self._detokenizer(req)
        text = ""
        if detok is not None:
            detok.add_tokens(text_ids(req.output_ids, req.lifecycle.finished_reason), finished=True)
            text = detok.final_text()
        return GenerateResult(text, list(req.output_ids), _meta(req))


def _meta(req: Req) -> GenerateMeta:
    params = req.sampling_params
    start = params.logprob_start_len
    prompt_logprobs = req.prompt_logprobs_ready
    return GenerateMeta(
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.prefill.cached_tokens or 0,
        finish_reason=req.lifecycle.finished_reason,
        output_token_logprobs=list(req.output.token_logprobs) if params.logprobs else None,
        output_top_logprobs=list(req.output.top_logprobs)
        if params.logprobs and params.top_logprobs_num
        else None,
        input_token_logprobs=list(zip(req.output.prompt_logprobs, req.origin_input_ids[start:]))
        if prompt_logprobs
        else None,
        input_top_logprobs=list(req.output.prompt_top_logprobs)
        if prompt_logprobs and params.prompt_top_logprobs_num
        else None,
        spec_verify_ct=req.spec_verify_ct,
        spec_accept_length=req.spec_accept_length,
    )


def _as_prompt_list(prompt: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("no prompt given")
    if isinstance(prompt[0], int):  # one prompt of token ids
        return [cast(Sequence[int], prompt)]
    return list(cast(Sequence[Prompt], prompt))


def _as_params_list(sampling_params: SamplingParamsArg, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, dict):
        return [SamplingParams.from_dict(sampling_params or {}) for _ in range(n)]
    if len(sampling_params) != n:
        raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
    return [SamplingParams.from_dict(p) for p in sampling_params]


def _as_lora_list(lora_name: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if lora_name is None or isinstance(lora_name, str):
        return [lora_name] * n
    if len(lora_name) != n:
        raise ValueError(f"lora_name has {len(lora_name)} entries for {n} prompts")
    return list(lora_name)
