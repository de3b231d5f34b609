"""A batch's grammar bitmask, filled on a thread of its own while the forward runs, each
request's row within a time budget.

The forward does not need the mask, only the sampler after it does, so the rows are
filled beside the forward and waited for just before sampling. Both libraries fill a row
in native code without the GIL. A row still filling when its budget ends costs only its
own request (ended with a 400 that names the grammar's cost; its row samples freely and
the token is void): the thread is left to finish that native call on its own, and the
batch's other rows go to a fresh thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import NamedTuple

import torch

from engine.grammar import GrammarMatcher, ReasoningGrammarMatcher, allocate_vocab_mask
from engine.grammar.cost import GrammarCostError
from engine.sched.req import Req


class VocabMask(NamedTuple):
    mask: torch.Tensor | None
    """The batch's grammar bitmask on the device; None when no request has a grammar."""
    faults: list[tuple[Req, Exception]]
    """Requests whose matcher raised or ran over its budget while filling its row (left
    all-allowed), and why."""


class MaskRow(NamedTuple):
    position: int
    """The request's row in the batch."""
    req: Req
    matcher: GrammarMatcher | ReasoningGrammarMatcher


class _Fill:
    """One row's fill on the mask thread: when it started, and how it ended."""

    def __init__(self, row: MaskRow):
        self.row = row
        self.started: float | None = None
        self.future: Future[None] | None = None


class MaskFiller:
    """Owns the mask thread. `timeout_s` None waits for every row however long it takes
    (tensor parallelism: every rank must end the same requests, and a deadline is met or
    missed per rank)."""

    def __init__(
        self,
        timeout_s: float | None,
        on_mask: Callable[[str, float], None] | None = None,
    ):
        self.timeout_s = timeout_s
        self.on_mask = on_mask
        """Hears each row's library and seconds (the worker's histogram), on the mask thread."""
        self.thread = _MaskThread()

    def start(
        self, rows: list[MaskRow], batch_size: int, vocab_size: int, device: torch.device
    ) -> PendingMask:
        """Start filling `rows` of an all-allowed `[batch_size, ⌈vocab_size / 32⌉]` mask."""
        pending = PendingMask(self, allocate_vocab_mask(batch_size, vocab_size), device)
        pending.submit([_Fill(row) for row in rows])
        return pending

    def replace_stuck_thread(self) -> None:
        """A fill ran over its budget and still holds the thread: later fills get a new one;
        the stuck one ends after its native call returns."""
        self.thread.stop()
        self.thread = _MaskThread()

    def shutdown(self) -> None:
        self.thread.stop()


class _MaskThread:
    """One daemon thread running fills in order: a daemon, so that a stuck native call
    does not hold up the worker's exit (a thread pool's threads are joined at exit)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[None], _Fill, PendingMask] | None]
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="grammar-mask", daemon=True).start()

    def submit(self, fill: _Fill, pending: PendingMask) -> Future[None]:
        future: Future[None] = Future()
        self._queue.put((future, fill, pending))
        return future

    def stop(self) -> None:
        """End after the fills already queued (those cancelled are skipped)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fill, pending = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                pending.fill(fill)
            except BaseException as e:  # the waiter reports it as the request's fault
                future.set_exception(e)
            else:
                future.set_result(None)


class PendingMask:
    """The mask of one batch while its rows fill; `result` waits for it."""

    def __init__(self, filler: MaskFiller, mask: torch.Tensor, device: torch.device):
        self._filler = filler
        self._mask = mask
        self._device = device
        self._fills: list[_Fill] = []
        self._lock = threading.Lock()

    def submit(self, fills: list[_Fill]) -> None:
        self._fills += fills
        thread = self._filler.thread
        for fill in fills:
            fill.future = thread.submit(fill, self)

    def fill(self, fill: _Fill) -> None:
        """Fill one row (on the mask thread)."""
        with self._lock:
            fill.started = time.monotonic()
        fill.row.matcher.fill_vocab_mask(self._mask, fill.row.position)
        on_mask = self._filler.on_mask
        if on_mask is not None:
            on_mask(fill.row.req.grammar.library, time.monotonic() - fill.started)

    def result(self) -> VocabMask:
        """The mask on the device once every row is filled or over its budget."""
        faults: list[tuple[MaskRow, Exception]] = []
        timeout_s = self._filler.timeout_s
        for k, fill in enumerate(self._fills):
            assert fill.future is not None, "submitted"
            while not fill.future.done():
                with self._lock:
                    started = fill.started
                if timeout_s is None or started is None:  # not started: the row before ends
                    wait_futures([fill.future], timeout=timeout_s)
                    continue
                left = started + timeout_s - time.monotonic()
                if left > 0:
                    wait_futures([fill.future], timeout=left)
                    continue
                faults.append((fill.row, _over_budget(timeout_s)))
                self._filler.replace_stuck_thread()
                self._restart(self._fills[k + 1 :])
                break
            else:
                error = fill.future.exception()
                if isinstance(error, Exception):
                    faults.append((fill.row, error))
                elif error is not None:
                    raise error
        for row, _ in faults:
            self._mask[row.position] = -1  # all allowed: its token is void
        return VocabMask(
            self._mask.to(self._device, non_blocking=True),
            [(row.req, error) for row, error in faults],
        )

    def _restart(self, fills: list[_Fill]) -> None:
        """Give the fills not yet run to the fresh thread (cancelled on the stuck one)."""
        waiting = [f for f in fills if f.future is not None and f.future.cancel()]
        thread = self._filler.thread
        for fill in waiting:
            fill.future = thread.submit(fill, self)


def _over_budget(timeout_s: float) -> GrammarCostError:
    return GrammarCostError(
        f"the grammar is too costly to follow here: its token mask took longer than "
        f"{timeout_s * 1000:g} ms (--grammar-mask-timeout-ms)"
    )
