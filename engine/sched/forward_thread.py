"""The CPU overlap loop's forward thread.

On CPU ops run as they are called, so the overlap loop runs each batch's forward on a thread
of its own while the scheduler thread processes the previous batch. Both are Python threads
under one GIL: every torch op releases it, and a forward whose op ends while the scheduler
holds it waits (tens of microseconds to wake on a small VM) for it back. At the start of a
forward (future ids resolved, attention metadata, the embedding and rotary lookups) ops are
short, and the scheduler's Python stalls them most; in the layers, ops are long. So the
scheduler starts its work once the next forward has entered the model's layers: the model
calls `ForwardBatch.on_layers_start` there. Measured in docs/benchmarks/host.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from engine.sched.batch import ScheduleBatch
from engine.sched.batch_result import PendingResult

RunBatch = Callable[[ScheduleBatch], PendingResult]


class ForwardThread:
    """Runs the submitted batches' forwards in order, one at a time."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.in_layers = threading.Event()
        """Set when the latest submitted forward has entered its layers, or has ended
        (a forward that never reaches them, or fails, must not leave the scheduler waiting)."""
        self.in_layers.set()

    def submit(self, run_batch: RunBatch, batch: ScheduleBatch) -> Future[PendingResult]:
        in_layers = self.in_layers = threading.Event()
        batch.forward_batch.on_layers_start = in_layers.set

        def run() -> PendingResult:
            try:
                return run_batch(batch)
            finally:
                in_layers.set()

        return self.executor.submit(run)

    def wait_in_layers(self) -> None:
        """Block until the latest submitted forward has entered its layers; the one before
        it has then ended, since forwards run one at a time."""
        self.in_layers.wait()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
