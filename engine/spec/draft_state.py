"""A request's drafting state across steps (`Req.draft_state`), which only the scheduler's
`DraftManager` writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import constants
from engine.spec.ngram import NgramState


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
