"""Speculative decoding's tests."""

from __future__ import annotations

import pytest

from engine import constants


@pytest.fixture(autouse=True)
def rows_uncapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's rows cost nothing: let every request of a batch draft (the cap's
    own test lowers it again)."""
    monkeypatch.setattr(constants, "SPEC_MAX_VERIFY_ROWS", 1024)
