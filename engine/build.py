"""One rank's engine from its arguments: `build(args, rank)`, the factory the offline
`Engine` and the server's worker share, and the tensor-parallel ranks it runs.

A rank's engine is its shard of the model, the tokenizer and the scheduler over them.
At TP > 1 rank 0 spawns its node's other ranks first; each of them builds the same
engine over its own pools and follows rank 0's turns until rank 0 stops the group.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
from transformers import PreTrainedTokenizerBase

from engine import constants
from engine.args import EngineArgs
from engine.detokenize import StopStringMatcher
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
from engine.model.runner import ModelRunner
from engine.model.tokenizer_cache import load_tokenizer
from engine.sched.model_drafter import ModelDrafter
from engine.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineCore:
    """One rank's engine."""

    args: EngineArgs
    model_runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase | None
    """None with `skip_tokenizer_init`: token ids in and out, no stop strings or grammars."""
    scheduler: Scheduler
    ranks: RankProcesses | None
    """The processes of this node's other ranks, where this rank spawned them."""

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


def build(
    args: EngineArgs, rank: int = 0, addr: str | None = None, ranks: RankProcesses | None = None
) -> EngineCore:
    """Rank `rank`'s engine. Rank 0 at TP > 1 (on node 0) spawns the other ranks of its
    node and kills them again if its own start fails; the ranks it spawns, and the first
    rank of another node, come with the rendezvous `addr` and the `ranks` they spawned."""
    if rank > 0 or args.tp_size == 1:
        return _build_rank(args, rank, addr, ranks)
    if get_tp_group().size > 1:
        raise RuntimeError(
            "this process already holds a tensor-parallel engine (one group a process); "
            "shut it down first"
        )
    addr = dist_init_addr(args)
    ranks = RankProcesses(args, addr, _rank_main())
    try:
        return _build_rank(args, 0, addr, ranks)
    except BaseException:
        ranks.kill()
        destroy_distributed()
        raise


def _build_rank(
    args: EngineArgs, rank: int, addr: str | None, ranks: RankProcesses | None
) -> EngineCore:
    """Join the group (at TP > 1), then load this rank's shard of the model and build the
    scheduler. Start-up waits for the other ranks up to `dist_init_timeout`; serving, the
    group's timeout."""
    device = rank_device(args, rank)
    if addr is not None:
        config = ParallelConfig(args.tp_size, rank, addr, init_timeout_s=args.dist_init_timeout)
        init_distributed(config, torch.device(device), ranks.check if ranks else None)
        if ranks is not None:
            ranks.joined()
    model_runner = _model_runner(args, device)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or args.model)
    drafter = None
    if args.speculative_draft_model_path is not None:
        draft_args = args.draft_model_args()
        draft_runner = _model_runner(draft_args, device)
        drafter = ModelDrafter(
            Scheduler(draft_args, draft_runner), draft_runner.model_config.vocab_size
        )
    scheduler = Scheduler(
        args,
        model_runner,
        StopStringMatcher(tokenizer) if tokenizer is not None else None,
        _grammar_backend(args, model_runner, tokenizer),
        drafter,
    )
    get_tp_group().start_serving()
    return EngineCore(args, model_runner, tokenizer, scheduler, ranks)


def _model_runner(args: EngineArgs, device: str) -> ModelRunner:
    dtype = resolve_dtype(args.dtype, torch.device(device))
    return ModelRunner(
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
        enable_deterministic_inference=args.enable_deterministic_inference,
    )


def _grammar_backend(
    args: EngineArgs, model_runner: ModelRunner, tokenizer: PreTrainedTokenizerBase | None
) -> GrammarBackend | None:
    if tokenizer is None or args.grammar_backend != "xgrammar":
        return None
    model_config = model_runner.model_config
    return GrammarBackend(
        tokenizer,
        model_config.vocab_size,
        stop_token_ids=model_config.eos_token_ids,
        max_workers=args.grammar_compile_workers,
        compile_timeout_s=args.grammar_compile_timeout,
        max_grammar_bytes=args.grammar_max_bytes,
        max_nesting_depth=args.grammar_max_nesting_depth,
        think_end_token=constants.REASONING_PARSERS.get(args.reasoning_parser or ""),
    )


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
    core = build(args, rank, addr, ranks)
    status = 0
    try:
        core.scheduler.follow()
        core.shutdown()
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
