"""A request's speculative decoding state across steps (`Req.draft_state`): its `Drafter`
writes how it drafts, the verify step what was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import constants
from engine.speculative.ngram import NgramState


@dataclass
class DraftState:
    """One request's drafting state."""

    ngram: NgramState = field(default_factory=NgramState)
    acceptance: float = 1.0
    """Exponential average of the share of its drafted tokens accepted, per drafted step."""
    drafted_steps: int = 0
    """Drafted steps since it last (re)started drafting."""
    paused_until: int = 0
    """The decode step it drafts again from."""
    backoff: int = constants.SPEC_ADAPTIVE_BACKOFF_STEPS
    draft_len: int = 1 << 30
    """Drafted tokens it proposes next, at most: cut to the accepted length plus one after
    a miss, doubled after a draft accepted to its end."""
    verify_ct: int = 0
    """Verify passes it took part in."""
    accepted_drafts: int = 0
    """Drafted tokens those passes accepted (and the request kept)."""
