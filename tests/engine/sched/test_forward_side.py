"""The forward side of a step (`Scheduler.run_batch`: forward, sampling, the copies of the
tokens to the host) reads nothing back from the tensors: under the overlap loop the
scheduler processes the previous batch meanwhile, and a read would wait for the device."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.sched.scheduler import Scheduler
from tests.engine.model.test_graph_runner import guard_host_reads

aten = torch.ops.aten


class NoHostSyncMode(TorchDispatchMode):
    """Fails on `item`, `bool()` or `int()` of a tensor (what `guard_host_reads` cannot
    patch: they dispatch `_local_scalar_dense`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten._local_scalar_dense, aten.item):
            raise AssertionError(f"host read on the forward side: {func}")
        return func(*args, **(kwargs or {}))


def test_run_batch_reads_no_tensor_back_to_the_host(make_engine, monkeypatch):
    """Through the normal loop: `guard_host_reads` patches `Tensor` for every thread, and
    under the overlap loop the scheduler thread rightly reads the previous batch's tokens
    while the forward thread runs this one. Both loops call the same `run_batch`."""
    run_batch = Scheduler.run_batch
    modes: list[str] = []

    def guarded(self: Scheduler, batch: Any) -> Any:
        modes.append(batch.forward_mode.name)
        with ExitStack() as stack:
            guard_host_reads(stack)
            stack.enter_context(NoHostSyncMode())
            return run_batch(self, batch)

    monkeypatch.setattr(Scheduler, "run_batch", guarded)
    engine = make_engine(disable_overlap_schedule=True, chunked_prefill_size=16)
    prompts = [[5 + i] * (6 + 9 * i) for i in range(4)]
    outputs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert [len(o.output_ids) for o in outputs] == [6] * 4
    assert {"EXTEND", "DECODE"} <= set(modes)
