"""vLLM's render endpoints: per prompt, the token ids and sampling parameters the worker
would be sent, in vLLM's `GenerateRequest` shape. They stop the generation flow after
`prepare`, so their ids are chat's and completions' by construction; nothing is
submitted."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from engine.sampling.sampling_params import SamplingParams
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.protocol.common import RenderedRequest, RenderedSamplingParams
from services.tokenizer.serving_base import prepare
from services.tokenizer.serving_openai import OpenAIEndpoint


async def render(request: Request, endpoint: OpenAIEndpoint) -> list[RenderedRequest]:
    """One rendered request per prompt of `endpoint`'s request."""
    body = endpoint.body
    prepared = await prepare(request, endpoint)
    return [
        RenderedRequest(
            request_id=TokenizerManager.new_rid(endpoint.id_prefix),
            token_ids=ids,
            sampling_params=vllm_sampling_params(params),
            model=body.model,
            stream=body.stream,
            stream_options=body.stream_options if body.stream else None,
            cache_salt=body.cache_salt,
            priority=body.priority,
        )
        for ids, params in zip(prepared.ids, prepared.params)
    ]


_VLLM_GRAMMAR_KEYS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
"""vLLM's `structured_outputs` key for each grammar kind (a `choice` is already an EBNF)."""


def vllm_sampling_params(params: SamplingParams) -> RenderedSamplingParams:
    """`params` under vLLM's names: logprobs as a count (None: not asked), the prompt's
    logprobs likewise, a grammar as `structured_outputs`."""
    structured: dict[str, Any] | None = None
    if params.grammar is not None:
        kind, source = params.grammar
        key = _VLLM_GRAMMAR_KEYS[kind]
        structured = {key: json.loads(source) if kind == "json_schema" else source}
    return RenderedSamplingParams(
        n=params.n,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        logprobs=params.top_logprobs_num if params.logprobs else None,
        prompt_logprobs=params.prompt_top_logprobs_num if params.logprob_start_len >= 0 else None,
        skip_special_tokens=params.skip_special_tokens,
        structured_outputs=structured,
        logit_bias=params.logit_bias or None,
    )
