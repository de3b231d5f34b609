"""The CPU overlap loop's forward thread lets the scheduler go on once the next forward has
entered its layers, and never leaves it waiting for a forward that does not get there.
The batches are stand-ins: only `forward_batch.on_layers_start` is read."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from engine.sched.forward_thread import ForwardThread

WAIT_S = 10


def batch() -> Any:
    return SimpleNamespace(forward_batch=SimpleNamespace(on_layers_start=None))


@pytest.fixture
def forward_thread():
    thread = ForwardThread()
    yield thread
    thread.shutdown()


def test_the_wait_ends_when_the_forward_enters_its_layers_not_when_it_ends(
    forward_thread: ForwardThread,
) -> None:
    release = threading.Event()

    def run_batch(b: Any) -> str:
        b.forward_batch.on_layers_start()
        assert release.wait(WAIT_S)
        return "tokens"

    future = forward_thread.submit(run_batch, batch())
    forward_thread.wait_in_layers()
    assert not future.done()  # still in its layers
    release.set()
    assert future.result(WAIT_S) == "tokens"


def test_a_forward_that_never_reaches_its_layers_ends_the_wait(
    forward_thread: ForwardThread,
) -> None:
    finished = forward_thread.submit(lambda b: "tokens", batch())
    forward_thread.wait_in_layers()
    assert finished.result(WAIT_S) == "tokens"

    def fail(b: Any) -> str:
        raise RuntimeError("no KV")

    failed = forward_thread.submit(fail, batch())
    forward_thread.wait_in_layers()
    with pytest.raises(RuntimeError, match="no KV"):
        failed.result(WAIT_S)


def test_forwards_run_one_at_a_time_in_order(forward_thread: ForwardThread) -> None:
    """So the previous forward has ended once the next one has entered its layers."""
    ran: list[int] = []
    first_release = threading.Event()

    def first(b: Any) -> None:
        assert first_release.wait(WAIT_S)
        ran.append(1)

    def second(b: Any) -> None:
        ran.append(2)
        b.forward_batch.on_layers_start()

    one = forward_thread.submit(first, batch())
    two = forward_thread.submit(second, batch())
    first_release.set()
    forward_thread.wait_in_layers()
    assert one.done() and ran[0] == 1
    two.result(WAIT_S)
    assert ran == [1, 2]
