"""Prompt logprobs over the wire: the worker and the detokenizer as real processes, and the
tokenizer's own `TokenizerManager` in the test, against the offline Engine's prefill."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine.sampling.sampling_params import SamplingParams
from services.io_struct import TokenizedGenerateReqInput
from services.settings import Settings
from services.tokenizer.errors import RequestError
from services.tokenizer.logprob_text import INLINE_LOGPROB_IDS
from services.tokenizer.manager import ReqOutput, TokenizerManager, running_manager
from testing.launcher import HEARTBEAT_INTERVAL, port_flags, server_ports

MAX_TOTAL_TOKENS = 4096
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on"


@pytest.fixture(scope="module")
def settings(tiny_llama_dir: Path, launcher) -> Settings:
    """The worker and the detokenizer running; the Settings a tokenizer of theirs reads."""
    ports = server_ports()
    flags = [
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        *port_flags(ports),
    ]
    for role in ("worker", "detokenizer"):
        launcher.start(role, flags)
    return Settings(
        model=str(tiny_llama_dir),
        heartbeat_interval=HEARTBEAT_INTERVAL,
        **{name.replace("-", "_"): port for name, port in ports.items()},
    )


async def wait_ready(manager: TokenizerManager, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            manager.require_ready()
            return
        except RequestError:
            assert time.monotonic() < deadline, "the worker and detokenizer never became ready"
            await asyncio.sleep(0.05)


def serve(settings: Settings, tokenizer, reqs: list[TokenizedGenerateReqInput]) -> dict:
    """Every ReqOutput of `reqs` (one group) by rid, and the worker's state once idle."""

    async def scenario() -> dict:
        async with running_manager(settings, tokenizer) as manager:
            await wait_ready(manager)
            outputs: dict[str, list[ReqOutput]] = {r.rid: [] for r in reqs}
            async for out in manager.generate(reqs):
                outputs[out.rid].append(out)
            return {"outputs": outputs, "info": await manager.server_info(check_integrity=True)}

    return asyncio.run(scenario())


def assert_all_kv_free(info: dict) -> None:
    assert info["radix_integrity"] == "ok"
    assert info["num_running_reqs"] == 0 and info["protected_kv_tokens"] == 0
    assert info["available_kv_tokens"] + info["evictable_kv_tokens"] == MAX_TOTAL_TOKENS


@pytest.mark.parametrize("repeats", [1, 8], ids=["decoded-inline", "decoded-in-a-thread"])
def test_a_prefill_only_request_brings_the_offline_prompt_logprobs_with_their_text(
    settings, offline, tokenizer, repeats
):
    ids = tokenizer.encode(" ".join([PROMPT] * repeats))
    # Each position names itself and 3 alternatives: the long prompt is decoded off the loop.
    assert (len(ids) * 4 > INLINE_LOGPROB_IDS) == (repeats > 1)
    scored = SamplingParams(max_new_tokens=0, logprob_start_len=0, prompt_top_logprobs_num=3)
    expected = offline.generate(
        ids, {"max_new_tokens": 0, "logprob_start_len": 0, "prompt_top_logprobs_num": 3}
    )[0].meta
    plain = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    result = serve(
        settings,
        tokenizer,
        [
            TokenizedGenerateReqInput(rid="scored", input_ids=ids, sampling_params=scored),
            TokenizedGenerateReqInput(rid="plain", input_ids=ids[:5], sampling_params=plain),
        ],
    )
    (out,) = result["outputs"]["scored"]
    assert out.output_ids == [] and out.text == "" and out.completion_tokens == 0
    assert out.finished_reason is not None and out.finished_reason.type == "length"
    assert expected.input_token_logprobs is not None and expected.input_top_logprobs is not None
    assert len(out.prompt_logprobs) == len(ids)
    first = out.prompt_logprobs[0]
    assert (first.token_id, first.token, first.logprob) == (ids[0], tokenizer.decode(ids[:1]), None)
    for entry, (logprob, token_id), top in zip(
        out.prompt_logprobs[1:], expected.input_token_logprobs[1:], expected.input_top_logprobs[1:]
    ):
        assert entry.logprob is not None and logprob is not None
        assert (entry.token_id, entry.token) == (token_id, tokenizer.decode([token_id]))
        assert entry.logprob == pytest.approx(logprob, abs=1e-5)
        assert [(t.token_id, t.token) for t in entry.top_logprobs] == [
            (t, tokenizer.decode([t])) for _, t in top
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for lp, _ in top], abs=1e-5
        )
    assert all(o.prompt_logprobs == () for o in result["outputs"]["plain"])
    assert_all_kv_free(result["info"])


def test_a_streamed_request_gets_its_prompt_logprobs_once_in_its_first_output(
    settings, offline, tokenizer
):
    ids = tokenizer.encode(PROMPT)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logprob_start_len": 5}
    expected = offline.generate(ids, params)[0]
    req = TokenizedGenerateReqInput(
        rid="streamed", input_ids=ids, sampling_params=SamplingParams(**params), stream=True
    )
    outputs = serve(settings, tokenizer, [req])["outputs"]["streamed"]
    assert [i for o in outputs for i in o.output_ids] == expected.output_ids
    assert len(outputs) > 1
    first, *rest = outputs
    assert [e.token_id for e in first.prompt_logprobs] == ids[5:]
    assert [e.logprob for e in first.prompt_logprobs] == pytest.approx(
        [lp for lp, _ in expected.meta.input_token_logprobs or []], abs=1e-5
    )
    assert all(o.prompt_logprobs == () for o in rest)
    assert first.cached_tokens <= 4, "the radix hit stops before position 4"


def test_logprob_start_len_past_the_prompt_is_a_400(settings, tokenizer):
    ids = tokenizer.encode("Hello")
    req = TokenizedGenerateReqInput(
        rid="too-far", input_ids=ids, sampling_params=SamplingParams(logprob_start_len=len(ids))
    )
    result = serve(settings, tokenizer, [req])
    (out,) = result["outputs"]["too-far"]
    assert out.finished_reason is not None
    assert (out.finished_reason.type, out.finished_reason.status_code) == ("abort", 400)
    assert "logprob_start_len" in (out.finished_reason.message or "")
    assert_all_kv_free(result["info"])
