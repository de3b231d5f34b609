"""The scheduler's managers, one job each, as `engine.build.build_scheduler` wires them
over the same pools and counters."""

from __future__ import annotations

from dataclasses import dataclass

from engine.grammar import GrammarBackend
from engine.sched.batch_runner import BatchRunner
from engine.sched.cache_manager import CacheManager
from engine.sched.decode_manager import DecodeManager
from engine.sched.grammar_queue import GrammarQueue
from engine.sched.lora_slots import LoRASlots
from engine.sched.mask_filler import MaskFiller
from engine.sched.output_processor import OutputProcessor
from engine.sched.prefill_manager import PrefillManager
from engine.sched.request_limits import RequestLimits
from engine.sched.stats import SchedulerStats
from engine.sched.tp_sync import InputSync
from engine.speculative.draft_manager import DraftManager


@dataclass(frozen=True)
class Managers:
    cache_manager: CacheManager
    limits: RequestLimits
    stats: SchedulerStats
    output_processor: OutputProcessor
    grammar_queue: GrammarQueue
    grammar_backend: GrammarBackend | None
    mask_filler: MaskFiller
    decode: DecodeManager
    prefill: PrefillManager
    lora: LoRASlots
    batch_runner: BatchRunner
    overlap: bool
    """The overlap event loop (else the normal one)."""
    input_sync: InputSync | None
    """At TP > 1: rank 0 broadcasts each turn's inputs, the other ranks apply them."""
    drafts: DraftManager | None
    """Speculative decoding (`--speculative-algorithm`), None when off."""
