"""GraphRunner: decode batches replayed from graphs captured once per batch-size bucket.

An eager decode step on CUDA is host-bound: about 46 kernel launches per layer from Python.
A captured graph replays them in one launch. A graph bakes in every address it touches, so
it reads its batch from static input buffers, computes everything else (positions,
attention metadata, input ids resolved from the FutureMap) inside itself from those, and
its KV pool must exist before capture (`ModelRunner` measures a trial capture, sizes the
pool, then captures). How a callable is captured and replayed is a `GraphBackend`: CUDA
graphs on a GPU, a fake in the CPU tests.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from engine.lora import LoRAManager
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.mem.swa_kv_pool import KVPool
from engine.model.attention.base import AttentionBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.model.layers.logits_processor import LogitsProcessorOutput
from engine.paths import inductor_dir

logger = logging.getLogger(__name__)

ResolveInputIds = Callable[[torch.Tensor], torch.Tensor]
"""Maps a batch's input ids (futures included) to token ids on the device, e.g.
`FutureMap.resolve`; pure tensor ops, so it can run inside a graph."""

# Static input buffers and the value a padding row holds: row 0 of `req_to_token` and KV
# slot 0 are reserved for padding by the pools, and a one-token context keeps its softmax
# finite.
PADDING = {"input_ids": 0, "req_pool_indices": 0, "seq_lens": 1, "out_cache_loc": 0}
LORA_PADDING = {"lora_slots": 0}
"""With LoRA on, each request's adapter slot id too (0, no adapter, for padding and for
batches without adapters): the graphs always carry the LoRA term."""


class GraphBackend(Protocol):
    """Records a callable once and replays it."""

    static_shapes: bool
    """Whether what is captured must keep static shapes and never read a host value (a
    recorded graph), or may inside opaque ops (a compiled one)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture `fn`; the returned callable replays it and returns its output, which
        lives in the graph's memory until the next replay of any graph."""
        ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph`s sharing one memory pool: buckets are captured largest first,
    so the smaller ones fit in the memory the largest already holds."""

    WARMUP_RUNS = 2
    """Eager runs before capture: Triton compiles and cuBLAS picks its workspace then, not
    while the stream is being captured."""
    static_shapes = True

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class TorchCompileBackend:
    """Each bucket's decode step compiled by `torch.compile` (inductor), for CPU: the ops of
    a layer fused into a few C++ kernels, weights and shapes fixed per bucket. Attention
    stays one opaque op (`radixserve::decode_attention`) sized by the batch's longest
    context at run time. Compiling takes minutes on a small CPU; inductor keeps its
    kernels under `$TORCHINDUCTOR_CACHE_DIR` (defaulted into radixserve's cache directory),
    so a restart mostly reads them back."""

    static_shapes = False

    def __init__(self) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir()))

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        compiled = torch.compile(fn, dynamic=False)
        compiled()  # compiles now, not on the first request
        return compiled


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_bs`, and `max_bs` itself: every
    batch up to the cap has a bucket at most 7 rows larger."""
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs, 8))
    return [*sizes, max_bs]


class DecodeInputs:
    """The static buffers every captured graph reads its batch from (`max_bs` rows each)."""

    def __init__(self, max_bs: int, device: torch.device, lora: bool):
        self.padding = PADDING | LORA_PADDING if lora else PADDING
        self.buffers = {
            name: torch.full((max_bs,), pad, dtype=torch.int64, device=device)
            for name, pad in self.padding.items()
        }
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=device)


class GraphRunner:
    """Decode batches of up to `max_bs` requests through captured graphs, padded to the
    next bucket. Built by `ModelRunner`, which decides when a batch can use it
    (`can_run`). With `lora`, each graph points the LoRA layers at its batch's adapters
    from a static buffer of slot ids (`LoRAManager.prepare` inside the graph)."""

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: KVPool,
        max_bs: int,
        backend: GraphBackend,
        batch_sizes: list[int] | None = None,
        lora: LoRAManager | None = None,
    ):
        self.model = model
        self.lora = lora
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.backend = backend
        self.batch_sizes = batch_sizes or capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        device = token_to_kv_pool.device
        self.inputs = DecodeInputs(self.max_bs, device, lora is not None)
        attn_backend.init_cuda_graph_state(
            self.max_bs, req_to_token_pool.max_context_len, backend.static_shapes
        )
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.resolve_input_ids: ResolveInputIds | None = None

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.forward_mode.is_decode()
            and forward_batch.batch_size <= self.max_bs
            and forward_batch.prompt_logprobs is None
        )

    def bucket(self, batch_size: int) -> int:
        """The smallest captured batch size that holds `batch_size` requests."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    @torch.inference_mode()
    def capture(self, resolve_input_ids: ResolveInputIds | None = None) -> None:
        """Capture every bucket, largest first, with `resolve_input_ids` baked in. The
        static inputs hold padding while capturing, so capture reads and writes only the
        padding row and slot."""
        started = time.perf_counter()
        self.graphs.clear()
        self.resolve_input_ids = resolve_input_ids
        for name, buffer in self.inputs.buffers.items():
            buffer.fill_(self.inputs.padding[name])
        for bs in reversed(self.batch_sizes):
            self.graphs[bs] = self.backend.capture(self._forward_fn(bs, resolve_input_ids))
        logger.info(
            "decode graphs: captured for batch sizes %s in %.1f s",
            self.batch_sizes,
            time.perf_counter() - started,
        )

    def replay(
        self, forward_batch: ForwardBatch, resolve_input_ids: ResolveInputIds | None = None
    ) -> LogitsProcessorOutput:
        """The logits of `forward_batch` from its bucket's graph. A resolver other than the
        one the graphs were captured with (the scheduler's FutureMap, once) recaptures."""
        if resolve_input_ids != self.resolve_input_ids or not self.graphs:
            self.capture(resolve_input_ids)
        bs = self.fill(forward_batch)
        logits = self.graphs[bs]()
        return LogitsProcessorOutput(logits[: forward_batch.batch_size])

    def fill(self, forward_batch: ForwardBatch) -> int:
        """Copy the batch into the static inputs and pad them to its bucket; return the
        bucket. Only `copy_` and `fill_` into existing buffers, device to device (the batch's
        inputs came over in one pinned copy: `ForwardBatch.from_host`): nothing here
        allocates or waits."""
        batch_size = forward_batch.batch_size
        bs = self.bucket(batch_size)
        padding = self.inputs.padding
        for name, buffer in self.inputs.buffers.items():
            source: torch.Tensor | None = getattr(forward_batch, name)
            if source is None:  # lora_slots of a batch without adapters
                buffer[:bs].fill_(padding[name])
                continue
            buffer[:batch_size].copy_(source, non_blocking=True)
            buffer[batch_size:bs].fill_(padding[name])
        return bs

    def _forward_fn(
        self, bs: int, resolve_input_ids: ResolveInputIds | None
    ) -> Callable[[], torch.Tensor]:
        """One bucket's decode step over the first `bs` rows of the static inputs. The
        `*_cpu` lists of its ForwardBatch describe the padding it was captured with, not a
        replayed batch: nothing inside a graph may read host values."""
        buffers = {name: buffer[:bs] for name, buffer in self.inputs.buffers.items()}
        positions = self.inputs.positions[:bs]
        extend_lens = self.inputs.extend_lens[:bs]

        def forward() -> torch.Tensor:
            input_ids = buffers["input_ids"]
            if resolve_input_ids is not None:
                input_ids = resolve_input_ids(input_ids)
            seq_lens = buffers["seq_lens"]
            torch.sub(seq_lens, 1, out=positions)
            forward_batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                input_ids=input_ids,
                positions=positions,
                req_pool_indices=buffers["req_pool_indices"],
                seq_lens=seq_lens,
                prefix_lens=positions,
                extend_lens=extend_lens,
                out_cache_loc=buffers["out_cache_loc"],
                seq_lens_cpu=[PADDING["seq_lens"]] * bs,
                prefix_lens_cpu=[0] * bs,
                extend_lens_cpu=[1] * bs,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=self.token_to_kv_pool,
                lora_slots=buffers.get("lora_slots"),
            )
            if self.lora is not None:
                self.lora.prepare(forward_batch)
            self.attn_backend.init_forward_metadata_graph(forward_batch)
            output: LogitsProcessorOutput = self.model(input_ids, positions, forward_batch)
            return output.next_token_logits

        return forward
