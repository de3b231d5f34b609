"""ModelRunner: the network, its KV memory and its attention backend, behind one `forward`."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.model.attention import create_attention_backend, default_attention_backend
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.model.layers.linear import Linear
from engine.model.layers.logits_processor import LogitsProcessorOutput
from engine.model.loader import load_model, open_checkpoint

logger = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
SUPPORTED_DTYPES = {
    "cpu": (torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.bfloat16, torch.float16, torch.float32),
}
# Without --max-total-tokens, a CPU KV cache gets this many bytes.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
DEFAULT_MAX_RUNNING_REQUESTS = 256


class ExtendInput(NamedTuple):
    """One request's part of a batch: `input_ids` are new tokens to place after the
    `prefix_len` tokens its `req_to_token` row already maps."""

    req_pool_idx: int
    prefix_len: int
    input_ids: Sequence[int]


class ModelRunner:
    """Loads the model onto `device` in `dtype` and owns the memory SGLang's ModelRunner
    owns: the request table, the KV slot allocator and the KV buffers. The KV pool holds
    `max_total_tokens` tokens; on CUDA, by default, what `mem_fraction_static` of the GPU
    leaves once the weights are loaded; on CPU, by default, `DEFAULT_CPU_KV_CACHE_BYTES`.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "bfloat16",
        attention_backend: str | None = None,
        max_total_tokens: int | None = None,
        mem_fraction_static: float = 0.85,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        context_len: int | None = None,
    ):
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if self.dtype not in SUPPORTED_DTYPES.get(self.device.type, ()):
            raise ValueError(f"dtype {self.dtype} is not supported on {self.device.type}")
        checkpoint = open_checkpoint(model)
        self.model_config = config = checkpoint.config
        self.context_len = context_len or config.context_len
        self.attn_backend = create_attention_backend(
            attention_backend or default_attention_backend(self.device),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            device=self.device,
        )
        self.model = load_model(
            checkpoint, dtype=self.dtype, device=self.device, attn_backend=self.attn_backend
        )
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.pack_weight()
        self.model.logits_processor.pack_lm_head(self.model.lm_head)
        self.init_memory_pool(max_total_tokens, mem_fraction_static, max_running_requests)

    def init_memory_pool(
        self, max_total_tokens: int | None, mem_fraction_static: float, max_running_requests: int
    ) -> None:
        config = self.model_config
        kv_shape = (config.num_key_value_heads, config.head_dim, config.num_hidden_layers)
        if max_total_tokens is None:
            max_total_tokens = MHATokenToKVPool.max_tokens_for_budget(
                self._kv_cache_budget(mem_fraction_static), *kv_shape, self.dtype
            )
        if max_total_tokens < 1:
            raise RuntimeError(
                "no memory left for the KV cache; raise mem_fraction_static or set max_total_tokens"
            )
        self.max_total_num_tokens = max_total_tokens
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, self.context_len, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            max_total_tokens, self.dtype, *kv_shape, self.device
        )
        logger.info(
            "KV cache: %d tokens, %.2f GiB",
            max_total_tokens,
            max_total_tokens * MHATokenToKVPool.cell_size(*kv_shape, self.dtype) / (1 << 30),
        )

    def _kv_cache_budget(self, mem_fraction_static: float) -> int:
        """Bytes for K/V: on CUDA, what is free beyond the `1 - mem_fraction_static` of the
        GPU kept for activations and other processes."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free - total * (1 - mem_fraction_static))

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits `[batch_size, vocab_size]` (float32, or float64 for a float64 model)."""
        return self.forward_output(forward_batch).next_token_logits

    @torch.inference_mode()
    def forward_output(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """The logits and the prompt logprobs `forward_batch.prompt_logprobs` asks for."""
        self.attn_backend.init_forward_metadata(forward_batch)
        output: LogitsProcessorOutput = self.model(
            forward_batch.input_ids, forward_batch.positions, forward_batch
        )
        return output

    def build_forward_batch(
        self, reqs: Sequence[ExtendInput], forward_mode: ForwardMode | None = None
    ) -> ForwardBatch:
        """Allocate KV slots for the new tokens, point each request's `req_to_token` row at
        them, and lay the batch out as tensors. The default mode is DECODE when every request
        adds one token, else EXTEND. For tests, benchmarks and offline use; the scheduler
        builds its batches from its own bookkeeping."""
        prefix_lens = [req.prefix_len for req in reqs]
        extend_lens = [len(req.input_ids) for req in reqs]
        out_cache_loc = self.token_to_kv_pool_allocator.alloc(sum(extend_lens))
        if out_cache_loc is None:
            raise RuntimeError(
                f"the KV pool has {self.token_to_kv_pool_allocator.available_size()} free slots, "
                f"the batch needs {sum(extend_lens)}"
            )
        start = 0
        for req, extend_len in zip(reqs, extend_lens):
            self.req_to_token_pool.write(
                req.req_pool_idx, req.prefix_len, out_cache_loc[start : start + extend_len]
            )
            start += extend_len
        if forward_mode is None:
            forward_mode = (
                ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
            )

        return ForwardBatch.build(
            forward_mode,
            torch.tensor(
                list(itertools.chain.from_iterable(req.input_ids for req in reqs)),
                dtype=torch.int64,
            ),
            [req.req_pool_idx for req in reqs],
            prefix_lens,
            extend_lens,
            out_cache_loc,
            self.req_to_token_pool,
            self.token_to_kv_pool,
        )
