"""A turn's work is bounded: a prefill is cut into chunks by default (the device's size),
and while a long prompt is prefilled chunk by chunk the running requests keep decoding
between its chunks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.api import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.sched.chunk_size import CPU_CHUNKED_PREFILL_SIZE
from engine.sched.scheduler import after_turns


def test_chunked_prefill_size_zero_is_the_devices_and_none_stays_off(
    make_engine: Callable[..., Engine],
):
    assert make_engine().scheduler.chunked_prefill_size == CPU_CHUNKED_PREFILL_SIZE
    assert make_engine(chunked_prefill_size=None).scheduler.chunked_prefill_size is None
    assert make_engine(chunked_prefill_size=48).scheduler.chunked_prefill_size == 48
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        make_engine(chunked_prefill_size=-1)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_running_requests_decode_between_the_chunks_of_a_long_prompt(
    make_engine: Callable[..., Engine], overlap: bool
):
    engine = make_engine(chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    sched = engine.scheduler
    params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    running = engine._submit([5, 6, 7], SamplingParams.from_dict(params))
    sched.run_event_loop(after_turns(3))
    assert running.output_ids  # decoding
    long_prompt = engine._submit(
        list(range(3, 3 + 160)), SamplingParams.from_dict(params)
    )  # 10 chunks
    modes: list[str] = []
    while not long_prompt.output_ids:
        before = len(running.output_ids)
        sched.run_event_loop(after_turns(1))
        modes.append("decode" if len(running.output_ids) > before else "prefill")
    # Ten chunks, and running's decode steps between them rather than after them all.
    assert modes.count("decode") >= 9, modes
    assert "prefill,prefill" not in ",".join(modes), modes
