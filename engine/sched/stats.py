"""The scheduler's counters, which the observability layer exports; the observer that hears
the per-request and per-batch events counters cannot carry; the snapshot, the one read
point for the scheduler's state; and its static facts (`SchedulerInfo`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from engine.grammar import GrammarObserver
from engine.sched.req import Req

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner


class SchedulerObserver(GrammarObserver, Protocol):
    """Hears the per-request and per-batch events that counters cannot carry (the worker
    turns them into histograms and trace spans)."""

    def on_admit(self, req: Req) -> None:
        """`req` joins a batch for the first time (not after a retraction or a chunk)."""

    def on_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        """A forward pass and its sampling took `seconds`; heard when its result is read."""

    def on_progress(self) -> None:
        """A prefill's forward finished one more layer: the loop computes, it is not stuck
        (heard on the forward's thread; decode steps, short, report nothing)."""

    def on_grammar_mask(self, library: str, seconds: float) -> None:
        """One request's token mask took `seconds`; heard on the mask thread."""


@dataclass
class SchedulerStats:
    """Counters the observability layer exports, and the observer of events, if any."""

    num_retractions: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    prefill_tokens: int = 0
    """Tokens actually computed by prefill (radix hits excluded)."""
    cache_hit_tokens: int = 0
    cache_full_hit_tokens: int = 0
    """Of the same admissions' prompts, the tokens whose full-attention KV the tree held: a
    hybrid model's hit (`cache_hit_tokens`) stops short of them where its window's SWA KV
    went; elsewhere the two are equal."""
    cache_query_tokens: int = 0
    generation_tokens: int = 0
    forward_modes: dict[str, int] = field(default_factory=dict)
    jump_forwards: int = 0
    jump_forward_tokens: int = 0
    """Output tokens taken from grammar-forced text: each is a decode pass saved."""
    spec_verify_steps: int = 0
    """Request-steps of verify batches: each request in each verify pass."""
    spec_proposed_tokens: int = 0
    """Drafted tokens verified."""
    spec_accepted_tokens: int = 0
    """Drafted tokens accepted and kept (a step's last token, sampled by the target, is not
    one of them)."""
    spec_accept_lengths: dict[int, int] = field(default_factory=dict)
    """Tokens a request took from one verify pass (1 + drafts accepted) → how often."""
    observer: SchedulerObserver | None = field(default=None, repr=False, compare=False)

    def observe_grammar_mask(self, library: str, seconds: float) -> None:
        """Tell the observer, if any, of one request's mask (`MaskFiller`)."""
        if self.observer is not None:
            self.observer.on_grammar_mask(library, seconds)

    def count_batch(self, mode: str) -> None:
        """A batch of forward mode `mode` (its name, lower case) was built."""
        self.forward_modes[mode] = self.forward_modes.get(mode, 0) + 1

    def count_verified(self, proposed: int, taken: int) -> None:
        """A request proposed `proposed` drafts and took `taken` tokens from a verify pass."""
        self.spec_verify_steps += 1
        self.spec_proposed_tokens += proposed
        self.spec_accepted_tokens += taken - 1
        self.spec_accept_lengths[taken] = self.spec_accept_lengths.get(taken, 0) + 1

    def count_retracted(self, reqs: list[Req]) -> None:
        self.num_retractions += len(reqs)
        self.retracted_input_tokens += sum(len(r.origin_input_ids) for r in reqs)
        self.retracted_output_tokens += sum(len(r.output_ids) for r in reqs)

    def counters(self) -> dict[str, Any]:
        """The plain numbers (a copy), e.g. for a status endpoint."""
        return {
            f.name: dict(v) if isinstance(v := getattr(self, f.name), dict) else v
            for f in fields(self)
            if f.name != "observer"
        }


class PoolSizes(NamedTuple):
    """A KV pool's slots at one moment: free, and held by the prefix cache unlocked
    (evictable: given back on demand) or locked by running requests (protected)."""

    free: int
    evictable: int
    protected: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler's numbers at one moment between turns (`Scheduler.snapshot()`): what
    /get_server_info, the metrics and the tensor-parallel step check read."""

    waiting: int
    compiling: int
    """Requests whose grammar is compiling."""
    running: int
    """Running requests, counting one whose prefill is still being chunked."""
    free_kv: int
    """Free slots of the KV pool (a hybrid model's full-attention one); the prefix cache's
    share of it follows."""
    evictable_kv: int
    protected_kv: int
    evicted_kv: int
    """KV slots evicted from the prefix cache so far (a counter)."""
    new_token_ratio: float
    counters: dict[str, Any]
    """`SchedulerStats.counters()`."""
    running_lora_adapters: tuple[str, ...]
    waiting_lora_adapters: tuple[str, ...]
    swa_kv: PoolSizes | None = None
    """A hybrid model's sliding-window pool (None: one pool)."""

    def in_step(self) -> dict[str, int]:
        """The numbers two tensor-parallel ranks in step agree on after each turn's inputs."""
        return {
            "waiting": self.waiting,
            "compiling": self.compiling,
            "running": self.running,
            "free_kv": self.free_kv,
            "evictable_kv": self.evictable_kv,
            "protected_kv": self.protected_kv,
            "generated": self.counters["generation_tokens"],
            "prefilled": self.counters["prefill_tokens"],
            "retractions": self.counters["num_retractions"],
        }


@dataclass(frozen=True)
class SchedulerInfo:
    """What does not change while the scheduler serves (`Scheduler.info()`): its limits and
    the model's and device's facts, for WorkerReady, /get_server_info and the metrics."""

    max_total_tokens: int
    swa_max_total_tokens: int | None
    """A hybrid model's sliding-window KV pool, in tokens (None: one pool)."""
    context_len: int
    max_running_requests: int
    chunked_prefill_size: int | None
    tp_size: int
    vocab_size: int
    eos_token_ids: list[int]
    """Sorted."""
    device: str
    """As torch names it: "cpu", "cuda:0"."""
    device_type: str
    dtype: str
    kv_cache_dtype: str
    weights_format: str
    deterministic: bool
    """`--enable-deterministic-inference`: batch-invariant kernels."""

    @classmethod
    def of(
        cls, runner: ModelRunner, chunked_prefill_size: int | None, tp_size: int
    ) -> SchedulerInfo:
        return cls(
            max_total_tokens=runner.max_total_num_tokens,
            swa_max_total_tokens=runner.swa_max_total_num_tokens,
            context_len=runner.context_len,
            max_running_requests=runner.req_to_token_pool.size,
            chunked_prefill_size=chunked_prefill_size,
            tp_size=tp_size,
            vocab_size=runner.model_config.vocab_size,
            eos_token_ids=sorted(runner.model_config.eos_token_ids),
            device=str(runner.device),
            device_type=runner.device.type,
            dtype=str(runner.dtype).removeprefix("torch."),
            kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            weights_format=runner.weights_format,
            deterministic=runner.deterministic,
        )
