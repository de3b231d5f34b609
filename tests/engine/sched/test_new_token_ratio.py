import pytest

from engine.sampling.sampling_params import SamplingParams
from engine.sched.new_token_ratio import NewTokenRatioTracker
from engine.sched.req import Req


def ratio_after(tracker: NewTokenRatioTracker, steps: int) -> float:
    for _ in range(steps):
        tracker.on_decode_step()
    return tracker.new_token_ratio


@pytest.mark.parametrize(
    ("steps", "expected"), [(0, 0.7), (300, 0.399), (600, 0.098), (1000, 0.098)]
)
def test_ratio_decays_linearly_from_0_7_to_14_percent_over_600_steps(steps, expected):
    assert ratio_after(NewTokenRatioTracker(), steps) == pytest.approx(expected)


def test_conservativeness_scales_the_start_and_the_floor_and_caps_at_one():
    tracker = NewTokenRatioTracker(schedule_conservativeness=0.5)
    assert tracker.new_token_ratio == pytest.approx(0.35)
    assert ratio_after(tracker, 600) == pytest.approx(0.049)
    assert NewTokenRatioTracker(schedule_conservativeness=3.0).new_token_ratio == 1.0


def test_retraction_jumps_to_the_formula_then_decays_and_idle_resets():
    tracker = NewTokenRatioTracker()
    ratio_after(tracker, 600)
    survivors = [
        Req("a", [1], SamplingParams(max_new_tokens=256), output_ids=[5] * 40),
        Req("b", [1], SamplingParams(max_new_tokens=256), output_ids=[5] * 10),
    ]
    tracker.on_retract(survivors)
    assert tracker.new_token_ratio == pytest.approx((50 + 20 * 2) / (512 + 1))
    assert ratio_after(tracker, 1) == pytest.approx((50 + 40) / 513 - (0.7 - 0.098) / 600)
    tracker.on_idle()
    assert tracker.new_token_ratio == pytest.approx(0.7)


def test_retraction_ratio_is_capped_at_one():
    tracker = NewTokenRatioTracker()
    tracker.on_retract([Req("a", [1], SamplingParams(max_new_tokens=4), output_ids=[5] * 3)])
    assert tracker.new_token_ratio == 1.0
