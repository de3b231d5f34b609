"""A generation request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from engine.cache.namespace import PrefixNamespace
from engine.sampling.sampling_params import SamplingParams
from engine.sched.finish_reason import FinishReason
from engine.sched.req_state import (
    GrammarState,
    KVState,
    OutputRead,
    OutputState,
    PrefillState,
    StopCriteria,
)

if TYPE_CHECKING:
    from engine.speculative.draft_state import DraftState


class ReqSpec(Protocol):
    """A request as submitted: the fields a `Req` is built from, whether they came from
    the tokenizer over the wire or from rank 0 to a tensor-parallel follower."""

    @property
    def rid(self) -> str: ...
    @property
    def input_ids(self) -> list[int]: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def extra_key(self) -> PrefixNamespace | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def routing_key(self) -> str | None: ...
    @property
    def lora_name(self) -> str | None: ...


class ReqStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True, slots=True)
class Admission:
    """What the scheduler orders, admits and caches a request by, fixed on submission."""

    extra_key: PrefixNamespace | None = None
    """Radix namespace: requests in different namespaces share no KV. It includes the
    `lora_name`: K/V computed under one adapter is wrong under any other."""
    priority: int = 0
    """Higher runs first under the priority policy; the radix tree keeps its prefixes
    longer under the priority eviction policy."""
    routing_key: str | None = None
    """The routing-key policy runs requests of a key the running batch holds first."""
    lora_name: str | None = None
    """The LoRA adapter it runs under (None: the base model)."""

    def __post_init__(self) -> None:
        if self.lora_name is not None:
            namespace = self.extra_key or PrefixNamespace()
            object.__setattr__(self, "extra_key", replace(namespace, lora=self.lora_name))


@dataclass
class Lifecycle:
    """A request's stage: the scheduler admits it and retraction sends it back to waiting;
    `Req.finish` ends it (the output processor, aborts, failures)."""

    status: ReqStatus = ReqStatus.WAITING
    finished_reason: FinishReason | None = None
    num_retractions: int = 0


@dataclass(eq=False)
class Req:
    """One request: what was asked and its tokens; what it was submitted under
    (`admission`); the state one manager owns sits in that manager's object (`stop`,
    `lifecycle`, `prefill`, `kv`, `grammar`, `output`, `draft_state`)."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    admission: Admission = Admission()
    """Its namespace, priority, routing key and adapter (set on submission)."""
    stop: StopCriteria = field(default_factory=StopCriteria)
    """What ends it (set on submission)."""
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    """Where it stands: waiting, running or finished (the scheduler's), and how often
    retraction sent it back."""

    kv: KVState = field(default_factory=KVState)
    """Its row, slots and prefix-cache lock (`CacheManager`'s)."""

    prefill: PrefillState = field(default_factory=PrefillState)
    """Its prefill progress (the prefill adder's and manager's)."""
    grammar: GrammarState = field(default_factory=GrammarState)
    """Its grammar's compile, then matcher (`GrammarQueue`'s, then `OutputProcessor`'s)."""
    output: OutputState = field(default_factory=OutputState)
    """Its logprobs so far (`OutputProcessor`'s) and where the output's one reader stands
    (`read_output`)."""
    draft_state: DraftState | None = None
    """Its speculative decoding state (engine/speculative/'s), None until it first drafts."""

    @classmethod
    def of(cls, spec: ReqSpec) -> Req:
        return cls(
            spec.rid,
            spec.input_ids,
            spec.sampling_params,
            admission=Admission(spec.extra_key, spec.priority, spec.routing_key, spec.lora_name),
        )

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.lifecycle.status is ReqStatus.FINISHED

    @property
    def prompt_logprobs_pending(self) -> bool:
        """It asks for prompt logprobs and its prefill has not computed them all yet."""
        start = self.sampling_params.logprob_start_len
        return start >= 0 and len(self.output.prompt_logprobs) < len(self.origin_input_ids) - start

    @property
    def prompt_logprobs_ready(self) -> bool:
        """It asks for prompt logprobs and has them all (an abort mid-prefill leaves them
        part-done: those are never reported)."""
        return self.sampling_params.logprob_start_len >= 0 and not self.prompt_logprobs_pending

    @property
    def spec_verify_ct(self) -> int:
        """Verify passes it took part in (SGLang's meta_info name)."""
        return 0 if self.draft_state is None else self.draft_state.verify_ct

    @property
    def spec_accept_length(self) -> float:
        """Tokens per verify pass it took part in (SGLang's meta_info name); 0 without any."""
        state = self.draft_state
        if state is None or not state.verify_ct:
            return 0.0
        return 1.0 + state.accepted_drafts / state.verify_ct

    def read_output(self) -> OutputRead:
        """What of the output is new since the last read, for its one reader: the ids from
        `start` on, the first `rollback` of which replace the last ids the previous reads
        returned (a jump-forward re-encoded them; never more than were read)."""
        return self.output.take(len(self.output_ids))

    @property
    def max_prefix_len(self) -> int:
        """How many leading tokens a radix hit may cover. Never the last: its logits are what
        the next token is sampled from. While prompt logprobs are pending, none of the
        positions whose logits they need: those of `logprob_start_len - 1` (at least 0) on.
        The tree holds K/V, not logits, so those positions must be computed again."""
        limit = self.seqlen - 1
        if self.prompt_logprobs_pending:
            limit = min(limit, max(self.sampling_params.logprob_start_len - 1, 0))
        return limit

    def all_token_ids(self) -> list[int]:
        """Prompt plus output: also what a retracted request prefills again."""
        return self.origin_input_ids + self.output_ids

    @property
    def needs_output_history(self) -> bool:
        """Its sampling reads the output so far on the CPU side: penalties, min_new_tokens,
        seeded sampling, a grammar."""
        params = self.sampling_params
        return bool(
            params.frequency_penalty
            or params.presence_penalty
            or params.repetition_penalty != 1.0
            or len(self.output_ids) < params.min_new_tokens
            or (params.seed is not None and not params.is_greedy)
            or self.grammar.matcher is not None
        )

    def finish(self, reason: FinishReason) -> None:
        self.lifecycle.status = ReqStatus.FINISHED
        self.lifecycle.finished_reason = reason


def take_by_rid(reqs: list[Req], rid: str) -> Req | None:
    """Remove request `rid` from `reqs` and return it (an abort), if it is there."""
    for i, req in enumerate(reqs):
        if req.rid == rid:
            return reqs.pop(i)
    return None
