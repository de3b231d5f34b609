"""One rank's engine from its arguments: `build(args, rank)`, the factory the offline
`Engine` and the server's worker share, and the tensor-parallel ranks it runs;
`build_scheduler`, which wires the scheduler's managers.

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
from engine.model.attention import default_attention_backend
from engine.model.dtype import resolve_dtype, resolve_kv_cache_dtype
from engine.model.runner import ModelRunner
from engine.model.tokenizer_cache import load_tokenizer
from engine.sched.batch_runner import BatchRunner
from engine.sched.cache_manager import CacheManager
from engine.sched.chunk_size import resolve_chunked_prefill_size
from engine.sched.decode_manager import DecodeManager
from engine.sched.grammar_queue import GrammarQueue
from engine.sched.lora_slots import LoRASlots
from engine.sched.managers import Managers
from engine.sched.mask_filler import MaskFiller
from engine.sched.output_processor import OutputProcessor
from engine.sched.prefill_manager import PrefillManager
from engine.sched.request_limits import RequestLimits
from engine.sched.scheduler import Scheduler
from engine.sched.stats import SchedulerStats
from engine.sched.tp_sync import InputSync
from engine.speculative.draft_manager import DraftManager
from engine.speculative.drafter import Drafter, NgramDrafter
from engine.speculative.standalone import StandaloneDrafter

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
    draft_scheduler: Scheduler | None = None
    """STANDALONE speculative decoding's: the draft model's own scheduler."""

    def shutdown(self) -> None:
        """Stop the scheduler; at TP > 1 rank 0's stop ends the other ranks' loops too,
        and each leaves the group."""
        if self.ranks is not None:
            self.ranks.expect_exit()
        self.scheduler.shutdown()
        if self.draft_scheduler is not None:
            self.draft_scheduler.shutdown()
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
    draft_scheduler = None
    if args.speculative_draft_model_path is not None:
        draft_args = args.draft_model_args()
        draft_scheduler = build_scheduler(draft_args, _model_runner(draft_args, device))
    args.check_speculative(
        args.attention_backend or default_attention_backend(device),
        model_runner.model_config.vocab_size,
        draft_scheduler.model_config.vocab_size if draft_scheduler is not None else None,
    )
    scheduler = build_scheduler(
        args,
        model_runner,
        StopStringMatcher(tokenizer) if tokenizer is not None else None,
        _grammar_backend(args, model_runner, tokenizer),
        draft_scheduler,
    )
    get_tp_group().start_serving()
    return EngineCore(args, model_runner, tokenizer, scheduler, ranks, draft_scheduler)


def build_scheduler(
    args: EngineArgs,
    model_runner: ModelRunner,
    stop_strings: StopStringMatcher | None = None,
    grammar_backend: GrammarBackend | None = None,
    draft_scheduler: Scheduler | None = None,
) -> Scheduler:
    """The scheduler over `model_runner`, its managers wired over the same pools and
    counters; `draft_scheduler` drafts for STANDALONE speculative decoding."""
    config, device, context_len = (
        model_runner.model_config,
        model_runner.device,
        model_runner.context_len,
    )
    cache_manager = CacheManager.over_pools(
        model_runner,
        not args.disable_radix_cache,
        args.radix_eviction_policy,
        window_checkpoints=not args.disable_window_checkpoints,
    )
    stats = SchedulerStats()
    limits = RequestLimits(
        config.vocab_size,
        context_len,
        model_runner.max_total_num_tokens,
        args.clip_max_new_tokens,
        stop_strings=stop_strings is not None,
        grammars=grammar_backend is not None,
        swa_max_total_tokens=model_runner.swa_max_total_num_tokens,
        swa_decode_tokens=cache_manager.swa_tokens_held_at_most(args.clip_max_new_tokens),
    )
    # Every rank must end the same requests: a deadline would be met or missed per rank.
    grammar_step_timeout_s = (
        args.grammar_mask_timeout_ms / 1000 if get_tp_group().size == 1 else None
    )
    outputs = OutputProcessor(
        cache_manager,
        stats,
        context_len,
        stop_strings,
        grammar_backend,
        args.enable_jump_forward,
        grammar_step_timeout_s,
    )
    decode = DecodeManager(
        config.vocab_size, device, cache_manager, stats, args.schedule_conservativeness
    )
    chunked_prefill_size = resolve_chunked_prefill_size(args.chunked_prefill_size, device)
    lora = LoRASlots(model_runner.lora_manager, args, device)
    prefill = PrefillManager(
        args, cache_manager, lora, stats, chunked_prefill_size, model_runner.req_to_token_pool.size
    )
    if args.disable_overlap_schedule is None:
        overlap = device.type == "cuda"
    else:
        overlap = not args.disable_overlap_schedule
    tp_group = get_tp_group()
    managers = Managers(
        cache_manager,
        limits,
        stats,
        outputs,
        GrammarQueue(grammar_backend, outputs),
        grammar_backend,
        MaskFiller(grammar_step_timeout_s, stats.observe_grammar_mask),
        decode,
        prefill,
        lora,
        BatchRunner(model_runner, tp_group, overlap, args.debug_future_map),
        overlap,
        InputSync(tp_group) if tp_group.size > 1 else None,
        _draft_manager(args, model_runner, cache_manager, lora, outputs, draft_scheduler),
    )
    return Scheduler(args, model_runner, managers)


def _draft_manager(
    args: EngineArgs,
    model_runner: ModelRunner,
    cache_manager: CacheManager,
    lora: LoRASlots,
    outputs: OutputProcessor,
    draft_scheduler: Scheduler | None,
) -> DraftManager | None:
    """Speculative decoding's manager over the drafter of `--speculative-algorithm`."""
    if args.speculative_algorithm is None:
        return None
    num_draft_tokens, adaptive = args.speculative_num_draft_tokens, args.speculative_adaptive
    drafter: Drafter
    if draft_scheduler is not None:
        drafter = StandaloneDrafter(
            draft_scheduler, num_draft_tokens, model_runner.context_len, adaptive
        )
    else:
        drafter = NgramDrafter(
            args.ngram_config(), num_draft_tokens, model_runner.context_len, adaptive
        )
    return DraftManager(
        drafter,
        cache_manager,
        model_runner.token_to_kv_pool,
        model_runner.model_config.eos_token_ids,
        lora,
        outputs,
    )


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
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        disable_hybrid_swa_memory=args.disable_hybrid_swa_memory,
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
    if tokenizer is None or args.grammar_backend == "none":
        return None
    model_config = model_runner.model_config
    return GrammarBackend(
        tokenizer,
        model_config.vocab_size,
        backend=args.grammar_backend,
        stop_token_ids=model_config.eos_token_ids,
        max_workers=args.grammar_compile_workers,
        compile_timeout_s=args.grammar_compile_timeout,
        compile_memory_bytes=args.grammar_compile_memory_mb << 20,
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
