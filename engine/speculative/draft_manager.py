"""Speculative decoding as the scheduler sees it: two calls. `next_batch`, where a decode
step would run, proposes the running requests' drafts (`Drafter.propose`) and lays them
out as one verify batch; `process_result` applies that batch's accepted tokens to its
requests (`process_verify`) and tells the drafter how its drafts fared."""

from __future__ import annotations

from collections.abc import Collection

from engine import constants
from engine.mem.swa_kv_pool import KVPool
from engine.sched.batch import ScheduleBatch
from engine.sched.cache_manager import CacheManager
from engine.sched.lora_slots import LoRASlots
from engine.sched.output_processor import OutputProcessor, Processed
from engine.sched.running_batch import RunningBatch
from engine.speculative.drafter import Drafter
from engine.speculative.verify import VerifyOutput
from engine.speculative.verify_batch import prepare_verify
from engine.speculative.verify_output import process_verify


class DraftManager:
    def __init__(
        self,
        drafter: Drafter,
        cache_manager: CacheManager,
        token_to_kv_pool: KVPool,
        eos_token_ids: Collection[int],
        lora: LoRASlots,
        outputs: OutputProcessor,
    ) -> None:
        self.drafter = drafter
        self.cache_manager = cache_manager
        self.token_to_kv_pool = token_to_kv_pool
        self.eos_token_ids = eos_token_ids
        self.lora = lora
        self.outputs = outputs

    def next_batch(self, running: RunningBatch) -> ScheduleBatch | None:
        """The verify batch of the running requests' drafts, within the KV room there is
        and `SPEC_MAX_VERIFY_ROWS` rows; None when nobody drafts (the step is then a plain
        decode). Nothing of the running requests may be in flight."""
        cache = self.cache_manager
        room = min(cache.room_with_eviction(), constants.SPEC_MAX_VERIFY_ROWS) - len(running)
        trees = self.drafter.propose(running.reqs, room)
        if trees is None:
            return None
        batch = prepare_verify(
            running, trees, self.cache_manager, self.token_to_kv_pool, self.eos_token_ids
        )
        self.lora.assign(batch)
        self.outputs.stats.count_batch("target_verify")
        return batch

    def process_result(
        self, batch: ScheduleBatch, verify: VerifyOutput, running: RunningBatch
    ) -> Processed:
        """Apply a verify batch's accepted tokens; the requests that finished leave
        `running`, whose lengths grow by what each accepted."""
        assert batch.trees is not None, "a verify batch"
        processed = self.outputs.fail_faults(batch)
        self.outputs.stats.generation_tokens += process_verify(
            self.outputs, batch, verify, processed
        )
        running.remove(processed.leaving)
        running.resync_lens()
        self.drafter.on_verified(batch.reqs, batch.trees, verify)
        return processed
