"""The offline Engine: generate in-process over the same scheduler the server runs."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, cast

import torch

from engine import constants
from engine.args import EngineArgs
from engine.detokenize import IncrementalDetokenizer
from engine.distributed import (
    ParallelConfig,
    destroy_distributed,
    get_tp_group,
    init_distributed,
)
from engine.distributed.tp_ranks import (
    RankMain,
    RankProcesses,
    configure_rank_logging,
    dist_init_addr,
    rank_device,
)
from engine.grammar import GrammarBackend
from engine.model.dtype import resolve_dtype, resolve_kv_cache_dtype
from engine.model.loader import load_tokenizer
from engine.model.runner import ModelRunner
from engine.outputs import GenerateMeta, GenerateResult, StreamChunk
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req
from engine.sched.scheduler import Scheduler, after_turns

Prompt = str | Sequence[int]
SamplingParamsArg = dict[str, Any] | Sequence[dict[str, Any]] | None

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model=None, **options)`: `None` is the embedded SmolLM2-135M-Instruct; the
    options are EngineArgs fields, the snake_case of the server's flags."""

    def __init__(self, model: str | None = None, **options: Any):
        args = EngineArgs.from_options(model=model or "embedded", **options)
        if args.node_rank > 0:
            raise ValueError(
                "node_rank > 0 runs worker ranks only (`python -m services.worker "
                "--node-rank K`, or engine.api.serve_node); the Engine is rank 0, on node 0"
            )
        if args.tp_size == 1:
            self._start(args, 0, None, None)
            return
        if get_tp_group().size > 1:
            raise RuntimeError(
                "this process already holds a tensor-parallel engine (one group a process); "
                "shut it down first"
            )
        addr = dist_init_addr(args)
        ranks = RankProcesses(args, addr, _rank_main())
        try:
            self._start(args, 0, addr, ranks)
        except BaseException:
            ranks.kill()
            destroy_distributed()
            raise

    @classmethod
    def _for_rank(
        cls, args: EngineArgs, rank: int, addr: str, ranks: RankProcesses | None
    ) -> Engine:
        """The engine of a rank other than 0, which follows rank 0 (`_follow`)."""
        engine = cls.__new__(cls)
        engine._start(args, rank, addr, ranks)
        return engine

    def _start(
        self, args: EngineArgs, rank: int, addr: str | None, ranks: RankProcesses | None
    ) -> None:
        """Join the group (at TP > 1), then load this rank's shard of the model and build
        the scheduler: every rank builds the same one over its own pools. Start-up waits
        for the other ranks up to `dist_init_timeout`; serving, the group's timeout."""
        self.args = args
        self.ranks = ranks
        device = rank_device(args, rank)
        if addr is not None:
            config = ParallelConfig(args.tp_size, rank, addr, init_timeout_s=args.dist_init_timeout)
            init_distributed(config, torch.device(device), ranks.check if ranks else None)
            if ranks is not None:
                ranks.joined()
        dtype = resolve_dtype(args.dtype, torch.device(device))
        self.model_runner = ModelRunner(
            args.model,
            device=device,
            dtype=dtype,
            kv_cache_dtype=resolve_kv_cache_dtype(
                args.kv_cache_dtype, args.dtype, dtype, torch.device(device)
            ),
            quantization=args.quantization,
            quantized_activations=args.quantized_activations,
            attention_backend=args.attention_backend,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            max_running_requests=args.max_running_requests,
            context_len=args.context_length,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
            enable_torch_compile=args.enable_torch_compile,
            torch_compile_max_bs=args.torch_compile_max_bs,
            capture_graphs=False,  # the scheduler captures them, with its future lookup
            enable_lora=args.enable_lora,
            max_loras_per_batch=args.max_loras_per_batch,
            max_lora_rank=args.max_lora_rank,
        )
        self.tokenizer = (
            None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or args.model)
        )
        grammar_backend = None
        if self.tokenizer is not None and args.grammar_backend == "xgrammar":
            model_config = self.model_runner.model_config
            grammar_backend = GrammarBackend(
                self.tokenizer,
                model_config.vocab_size,
                stop_token_ids=model_config.eos_token_ids,
                max_workers=args.grammar_compile_workers,
                compile_timeout_s=args.grammar_compile_timeout,
                max_grammar_bytes=args.grammar_max_bytes,
                max_nesting_depth=args.grammar_max_nesting_depth,
                think_end_token=constants.REASONING_PARSERS.get(args.reasoning_parser or ""),
            )
        self.scheduler = Scheduler(
            args,
            self.model_runner,
            self._matched_stop_string if self.tokenizer else None,
            grammar_backend,
        )
        get_tp_group().start_serving()
        self._rids = itertools.count()

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
        sent = 0
        try:
            while not req.finished:
                self.scheduler.run_event_loop(should_stop=after_turns(1))
                rollback, req.output_rollback = min(req.output_rollback, sent), 0
                new_ids = req.output_ids[sent - rollback :]
                if new_ids or req.finished:
                    sent = len(req.output_ids)
                    if detok and rollback:
                        detok.rollback(rollback)
                    text = detok.add_tokens(new_ids, finished=req.finished) if detok else ""
                    meta = _meta(req) if req.finished else None
                    yield StreamChunk(text, new_ids, rollback, meta)
        finally:
            if not req.finished:
                self.scheduler.abort_request(req.rid)

    def shutdown(self) -> None:
        """Stop the scheduler; at TP > 1 rank 0's stop ends the other ranks' loops too,
        and each leaves the group."""
        if self.ranks is not None:
            self.ranks.expect_exit()
        self.scheduler.shutdown()
        if self.ranks is not None:
            self.ranks.join()
        if self.args.tp_size > 1:
            destroy_distributed()

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
        req = Req(str(next(self._rids)), input_ids, params, lora_name=lora_name)
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
            matched = req.finished_reason.matched if req.finished_reason else None
            output_ids = req.output_ids[:-1] if isinstance(matched, int) else req.output_ids
            detok.add_tokens(output_ids, finished=True)
            text = detok.final_text()
        return GenerateResult(text, list(req.output_ids), _meta(req))

    def _matched_stop_string(self, req: Req) -> str | None:
        """Stop strings are searched in the decoded tail only: a string of n characters
        spans at most n tokens."""
        assert self.tokenizer is not None, "installed only with a tokenizer"
        stop = req.sampling_params.stop
        tail = req.output_ids[-(max(len(s) for s in stop) + 1) :]
        text = self.tokenizer.decode(
            tail, skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        return next((s for s in stop if s in text), None)


def serve_node(args: EngineArgs) -> NoReturn:
    """A node other than 0 (`python -m services.worker --node-rank K`): run its ranks, the
    first in this process and the rest as its children, until rank 0 stops the group."""
    addr = dist_init_addr(args)
    _follow(args, args.first_rank, addr, RankProcesses(args, addr, _rank_main()))


def _rank_main() -> RankMain:
    """A spawned rank's body, logging at this process's level."""
    return functools.partial(_run_rank, log_level=logging.getLogger().getEffectiveLevel())


def _run_rank(args: EngineArgs, rank: int, addr: str, log_level: int) -> NoReturn:
    # A terminal's Ctrl-C reaches the whole process group: rank 0 stops this rank in
    # order (a rank that died of it would look like a crash).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_rank_logging(log_level, rank)
    _follow(args, rank, addr, None)


def _follow(args: EngineArgs, rank: int, addr: str, ranks: RankProcesses | None) -> NoReturn:
    """Build rank `rank`'s engine and run rank 0's turns until it stops the group, then
    end the process (status 0); a failed collective (a dead rank, or one stuck past the
    group's timeout) ends it with status 1."""
    engine = Engine._for_rank(args, rank, addr, ranks)
    status = 0
    try:
        engine.scheduler.follow()
        engine.shutdown()
    except Exception:
        logger.critical(
            "tensor-parallel rank %d: a collective failed (another rank died, or stalled "
            "past the group's timeout); exiting",
            rank,
            exc_info=True,
        )
        status = 1
    # Leave without the interpreter's finalization: a process group that reference cycles
    # keep alive until then is torn down after its threads, which can abort the process
    # ("terminate called without an active exception") after a clean stop.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)


def _meta(req: Req) -> GenerateMeta:
    params = req.sampling_params
    start = params.logprob_start_len
    prompt_logprobs = start >= 0 and not req.prompt_logprobs_pending  # an abort has them part-done
    return GenerateMeta(
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens or 0,
        finish_reason=req.finished_reason,
        output_token_logprobs=list(req.output_token_logprobs) if params.logprobs else None,
        output_top_logprobs=list(req.output_top_logprobs)
        if params.logprobs and params.top_logprobs_num
        else None,
        input_token_logprobs=list(zip(req.input_token_logprobs, req.origin_input_ids[start:]))
        if prompt_logprobs
        else None,
        input_top_logprobs=list(req.input_top_logprobs)
        if prompt_logprobs and params.prompt_top_logprobs_num
        else None,
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
