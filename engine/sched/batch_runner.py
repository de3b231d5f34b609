"""The scheduler's forward side: forward a batch, sample it, agree on its tokens across
tensor-parallel ranks and leave them in the FutureMap, waiting for nothing; under the
overlap loop the batch is launched on the forward stream (CUDA) or thread (CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from engine.distributed import TPGroup
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sched.batch import ScheduleBatch
from engine.sched.batch_result import PendingResult
from engine.sched.forward_thread import ForwardThread
from engine.sched.future_map import FutureMap
from engine.speculative.verify import walk_trees

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner


class BatchRunner:
    def __init__(
        self,
        model_runner: ModelRunner,
        tp_group: TPGroup,
        overlap: bool,
        debug_future_map: bool,
    ):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.tp_group = tp_group
        self.sampler = Sampler()
        self.future_map = FutureMap(
            model_runner.req_to_token_pool.size, self.device, debug=debug_future_map
        )
        graph_runner = model_runner.graph_runner
        if graph_runner is not None and not debug_future_map:
            # Bake this scheduler's future lookup into the decode graphs now, not at the
            # first decode batch.
            graph_runner.capture(self.future_map.resolve)
        # Under overlap on CUDA the forward is queued on its own stream from this thread;
        # on CPU, where ops run as they are called, only a thread of its own overlaps it.
        self.forward_stream = (
            torch.cuda.Stream(self.device) if overlap and self.device.type == "cuda" else None
        )
        self.forward_thread = ForwardThread() if overlap and self.forward_stream is None else None

    def run(
        self, batch: ScheduleBatch, on_progress: Callable[[], None] | None = None
    ) -> PendingResult:
        """Forward and sample, and start copying the tokens to the host; wait for nothing.
        Under the overlap loop it touches only the batch's own tensors, the KV pool and the
        FutureMap (on the forward thread on CPU, the forward stream on CUDA). `on_progress`
        hears each layer of a prefill end."""
        started = time.perf_counter()
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        forward_batch = batch.forward_batch
        if batch.trees is not None:
            return self._verify(batch, started)
        if on_progress is not None and not forward_batch.forward_mode.is_decode():
            forward_batch.on_layer_end = on_progress
        if self.future_map.debug:  # its poison check syncs: not for a graph
            forward_batch.input_ids = self.future_map.resolve(forward_batch.input_ids)
            logits_output = self.model_runner.forward_output(forward_batch)
        else:  # resolved inside the forward, so inside a decode graph
            logits_output = self.model_runner.forward_output(
                forward_batch, resolve_input_ids=self.future_map.resolve
            )
        batch.resolve_vocab_mask()  # filled on the mask thread while the forward ran
        out = self._agree_on_tokens(
            batch, self.sampler(logits_output.next_token_logits, batch.sampling_info)
        )
        self.future_map.store(forward_batch.req_pool_indices, out.next_token_ids)
        return PendingResult(
            out, logits_output, forward_batch.prompt_logprobs, started, start_event
        )

    def _verify(self, batch: ScheduleBatch, started: float) -> PendingResult:
        """The target's draw at every draft-tree node, and each request's walk of its tree
        (`walk_trees`). The step's last token of each request goes to the FutureMap, as a
        decode step's token would, for a later batch that rides it as a future."""
        assert batch.trees is not None, "a verify batch"
        forward_batch = batch.forward_batch
        logits_output = self.model_runner.forward_output(forward_batch)
        sampled = self.sampler(logits_output.next_token_logits, batch.sampling_info)
        # Every rank walks the same trees (each feeds its trie the same tokens) over rank
        # 0's draws, so all accept alike.
        verify = walk_trees(batch.trees, self._agree_on_tokens(batch, sampled))
        last = torch.tensor([tokens[-1] for tokens in verify.tokens], device=self.device)
        self.future_map.store(forward_batch.req_pool_indices, last)
        return PendingResult(
            SamplerOutput(last, None, None, None), None, None, started, verify=verify
        )

    def launch(
        self, run: Callable[[ScheduleBatch], PendingResult], batch: ScheduleBatch
    ) -> Future[PendingResult]:
        """Start `run(batch)` on the forward side without waiting for it: queued on the
        forward stream (CUDA), or run on the forward thread (CPU); there, it returns once
        the forward has entered its layers (see engine/sched/forward_thread.py)."""
        if self.forward_thread is not None:
            launched = self.forward_thread.submit(run, batch)
            self.forward_thread.wait_in_layers()
            return launched
        if self.forward_stream is None:
            raise RuntimeError("launch is the overlap loop's: overlap is off")
        stream = self.forward_stream
        # The batch's inputs were written on the scheduler's stream: order the forward
        # after them, and keep their memory from reuse until the forward stream is done.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        _record_stream(batch, stream)
        with torch.cuda.stream(stream):
            done: Future[PendingResult] = Future()
            done.set_result(run(batch))
        return done

    def shutdown(self) -> None:
        if self.forward_thread is not None:
            self.forward_thread.shutdown()

    def _agree_on_tokens(self, batch: ScheduleBatch, out: SamplerOutput) -> SamplerOutput:
        """At TP > 1 every rank samples from the same (all-gathered) logits. Greedy rows
        agree by construction, so a batch of them costs nothing more; a batch with a
        sampled or grammar-masked row takes rank 0's ids (one all-gather of B ids on the
        device group, in stream order: no host sync). Seeding every rank alike would
        agree too, but only while no rank's RNG is ever drawn differently: the broadcast
        makes agreement a fact, not a hope."""
        info = batch.sampling_info
        if self.tp_group.size == 1 or (info.is_all_greedy and info.vocab_mask is None):
            return out
        ids = self.tp_group.all_gather(out.next_token_ids[None], dim=0)[0]
        return out._replace(next_token_ids=ids)


def _record_stream(batch: ScheduleBatch, stream: torch.cuda.Stream) -> None:
    """Mark the batch's device tensors as used on `stream`, so that the caching allocator
    does not hand their memory out again before the forward stream has read them."""
    for holder in (batch.forward_batch, batch.sampling_info, batch.forward_batch.prompt_logprobs):
        for value in vars(holder).values() if holder is not None else ():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                value.record_stream(stream)
