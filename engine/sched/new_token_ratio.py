"""The overcommit ledger: how much of its remaining max_new_tokens a running request is
assumed to still need.

Most requests stop long before max_new_tokens, so reserving it in full leaves KV memory
idle. The ratio starts cautious, grows bolder (decays) with every calm decode step, and
jumps back after a retraction shows it overshot — additive decrease of the reservation,
multiplicative backoff, like TCP's AIMD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine import constants

if TYPE_CHECKING:
    from engine.sched.req import Req


class NewTokenRatioTracker:
    def __init__(
        self,
        schedule_conservativeness: float = 1.0,
        init_ratio: float = constants.INIT_NEW_TOKEN_RATIO,
        min_ratio_factor: float = constants.MIN_NEW_TOKEN_RATIO_FACTOR,
        decay_steps: int = constants.NEW_TOKEN_RATIO_DECAY_STEPS,
        retract_decode_steps: int = constants.RETRACT_DECODE_STEPS,
    ):
        self.init_new_token_ratio = min(1.0, init_ratio * schedule_conservativeness)
        self.min_new_token_ratio = self.init_new_token_ratio * min_ratio_factor
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / decay_steps
        self.retract_decode_steps = retract_decode_steps
        self.new_token_ratio = self.init_new_token_ratio

    def on_decode_step(self) -> None:
        self.new_token_ratio = max(
            self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
        )

    def on_retract(self, remaining: Sequence[Req]) -> None:
        """Reserve what the survivors decoded so far plus `retract_decode_steps` more each."""
        decoded = sum(len(r.output_ids) for r in remaining)
        max_new = sum(r.sampling_params.max_new_tokens for r in remaining)
        self.new_token_ratio = min(
            1.0, (decoded + self.retract_decode_steps * len(remaining)) / (max_new + 1)
        )

    def on_idle(self) -> None:
        self.new_token_ratio = self.init_new_token_ratio
