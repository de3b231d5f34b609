"""What a server reads of the scheduler, and asks of it between turns: the snapshot (the
one read point for its state), its static facts, its adapters, whether outputs wait, the
observer of its events, KV-cache events and the integrity check. The worker reads the
scheduler through these methods only, never through the managers behind them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sched.stats import PoolSizes, SchedulerInfo, SchedulerObserver, SchedulerSnapshot

if TYPE_CHECKING:
    from engine.cache.kv_events import BlockEventRecorder
    from engine.distributed.parallel_state import TPGroup
    from engine.grammar import GrammarBackend
    from engine.model.runner import ModelRunner
    from engine.sched.cache_manager import CacheManager
    from engine.sched.grammar_queue import GrammarQueue
    from engine.sched.lora_slots import LoRASlots
    from engine.sched.new_token_ratio import NewTokenRatioTracker
    from engine.sched.output_processor import OutputProcessor
    from engine.sched.prefill_manager import PrefillManager
    from engine.sched.running_batch import RunningBatch
    from engine.sched.stats import SchedulerStats


class SchedulerStatus:
    """The `Scheduler`'s read side (a base of it, as SGLang's scheduler mixins are)."""

    model_runner: ModelRunner
    cache_manager: CacheManager
    stats: SchedulerStats
    output_processor: OutputProcessor
    grammar_queue: GrammarQueue
    grammar_backend: GrammarBackend | None
    prefill: PrefillManager
    running: RunningBatch
    ratio: NewTokenRatioTracker
    lora: LoRASlots
    chunked_prefill_size: int | None
    tp_group: TPGroup

    def observe(self, observer: SchedulerObserver) -> None:
        """Tell `observer` the events counters cannot carry, grammar compiles included."""
        self.stats.observer = observer
        if self.grammar_backend is not None:
            self.grammar_backend.observer = observer

    def snapshot(self, adapters: bool = True) -> SchedulerSnapshot:
        """The one read point for status and metrics; `adapters=False` reads no request."""
        chunked, waiting = self.prefill.chunked(), [*self.prefill.waiting, *self.grammar_queue]
        running_adapters, waiting_adapters = (
            self.lora.info([*self.running, *chunked], waiting) if adapters else ([], [])
        )
        cache = self.cache_manager
        tree, swa = cache.tree_cache, cache.swa_allocator
        return SchedulerSnapshot(
            waiting=len(self.prefill.waiting),
            compiling=len(self.grammar_queue),
            running=len(self.running) + len(chunked),
            free_kv=cache.full_available_size(),
            evictable_kv=tree.evictable_size(),
            protected_kv=tree.protected_size(),
            evicted_kv=tree.evicted_tokens,
            new_token_ratio=self.ratio.new_token_ratio,
            counters=self.stats.counters(),
            running_lora_adapters=tuple(running_adapters),
            waiting_lora_adapters=tuple(waiting_adapters),
            swa_kv=None
            if swa is None
            else PoolSizes(
                swa.swa_available_size(), tree.swa_evictable_size(), tree.swa_protected_size()
            ),
        )

    def info(self) -> SchedulerInfo:
        """Its limits and the model's and device's facts, which do not change."""
        return SchedulerInfo.of(self.model_runner, self.chunked_prefill_size, self.tp_group.size)

    def has_pending_outputs(self) -> bool:
        """Requests advanced or finished that no event-loop turn has handed out yet."""
        return bool(self.output_processor.outputs)

    def lora_adapters(self) -> dict[str, str]:
        """The loaded adapters, name → path."""
        return self.lora.adapters()

    def attach_kv_events(self, recorder: BlockEventRecorder) -> None:
        """Record the prefix cache's blocks into `recorder` as KV-cache events."""
        self.cache_manager.tree_cache.attach_kv_events(recorder)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every KV slot is accounted for exactly once and the
        tree's ledgers are right (`CacheManager.check_integrity`)."""
        self.cache_manager.check_integrity()
