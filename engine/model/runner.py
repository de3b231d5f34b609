"""ModelRunner: the network, its KV memory and its attention backend, behind one `forward`."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from engine.distributed import get_tp_group
from engine.lora import LoRAManager
from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.mem.swa_kv_pool import KVPool, SWAKVPool
from engine.model.attention import create_attention_backend, default_attention_backend
from engine.model.batch_invariant import check_supported, make_batch_invariant
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from engine.model.graph_runner import (
    CudaGraphBackend,
    GraphBackend,
    GraphRunner,
    ResolveInputIds,
    TorchCompileBackend,
    capture_batch_sizes,
)
from engine.model.layers.linear import Linear
from engine.model.layers.logits_processor import LogitsProcessorOutput
from engine.model.layers.quantization import weights_format
from engine.model.loader import load_model, open_checkpoint, resolve_quantization

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


class ModelRunner:
    """Loads the model onto `device` in `dtype` and owns the memory SGLang's ModelRunner
    owns: the request table, the KV slot allocator and the KV buffers. The KV pool holds
    `max_total_tokens` tokens; on CUDA, by default, what `mem_fraction_static` of the GPU
    leaves once the weights are loaded; on CPU, by default, `DEFAULT_CPU_KV_CACHE_BYTES`.
    A hybrid model's (`ModelConfig.is_hybrid_swa`) sliding layers get a pool of their own,
    `swa_full_tokens_ratio` slots per full-attention slot, in the same bytes
    (`SWAKVPool.split_tokens`), unless `disable_hybrid_swa_memory`.

    Decode batches of up to `min(cuda_graph_max_bs, max_running_requests)` requests replay
    captured graphs (`GraphRunner`): CUDA graphs on a GPU unless `disable_cuda_graph`, and
    on any device when a `graph_backend` is given (the CPU tests inject a fake). On CPU,
    `enable_torch_compile` compiles the decode step of batches up to `torch_compile_max_bs`
    instead (off by default: minutes of compiling at start, docs/benchmarks/model.md).
    `capture_graphs=False` leaves the capture to the caller: the scheduler captures once,
    with its FutureMap's lookup baked in, rather than twice. `enable_deterministic_inference`
    switches the model to its batch-invariant kernels (`engine/model/batch_invariant.py`).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "bfloat16",
        kv_cache_dtype: str | torch.dtype | None = None,
        attention_backend: str | None = None,
        max_total_tokens: int | None = None,
        mem_fraction_static: float = 0.85,
        swa_full_tokens_ratio: float = 0.8,
        disable_hybrid_swa_memory: bool = False,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        context_len: int | None = None,
        cuda_graph_max_bs: int = 160,
        disable_cuda_graph: bool = False,
        enable_torch_compile: bool = False,
        torch_compile_max_bs: int = 8,
        graph_backend: GraphBackend | None = None,
        capture_graphs: bool = True,
        enable_lora: bool = False,
        max_loras_per_batch: int = 4,
        max_lora_rank: int = 16,
        quantization: str = "none",
        quantized_activations: str = "int16",
        enable_deterministic_inference: bool = False,
    ):
        self.device = torch.device(device)
        if enable_torch_compile and self.device.type != "cpu":
            raise ValueError(
                "enable_torch_compile compiles the CPU decode step; on CUDA, decode batches "
                "replay CUDA graphs (see cuda_graph_max_bs)"
            )
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if self.dtype not in SUPPORTED_DTYPES.get(self.device.type, ()):
            raise ValueError(f"dtype {self.dtype} is not supported on {self.device.type}")
        self.kv_cache_dtype = self._kv_cache_dtype(kv_cache_dtype)
        checkpoint = open_checkpoint(model)
        self.model_config = config = checkpoint.config
        self.tp_size = get_tp_group().size
        self.context_len = context_len or config.context_len
        self.attn_backend = create_attention_backend(
            attention_backend or default_attention_backend(self.device),
            **self._attention_shape(config),
        )
        self.deterministic = enable_deterministic_inference
        if self.deterministic:
            check_supported(self.device, self.dtype, self.attn_backend)
            if enable_torch_compile:
                raise ValueError("enable_deterministic_inference runs eagerly: no torch.compile")
            quantized_activations = "float"
        self.quantization = resolve_quantization(
            quantization, checkpoint, self.device, self.tp_size
        )
        self.model = load_model(
            checkpoint,
            dtype=self.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
            quantization=self.quantization,
            quantized_activations=quantized_activations,
        )
        self._prepare_weights()
        self.weights_format = weights_format(self.model, self.dtype)
        """How the linear layers' weights are held: the dtype's name, or the quantized
        format (`gguf:Q4_1`, `int8`); shown in /get_server_info and the cpu_info metric."""
        self.lora_manager: LoRAManager | None = None
        if enable_lora:
            self.lora_manager = LoRAManager(self.model, max_loras_per_batch, max_lora_rank)
        self.cuda_graph_bs = min(
            torch_compile_max_bs if enable_torch_compile else cuda_graph_max_bs,
            max_running_requests,
        )
        graph_backend = self._choose_graph_backend(
            graph_backend, enable_torch_compile, disable_cuda_graph
        )
        self.graph_runner: GraphRunner | None = None  # the pool's sizing may run forwards
        self.swa_layers = _swa_layers(config, disable_hybrid_swa_memory, swa_full_tokens_ratio)
        """Which layers keep their K/V in the SWA pool; None: one pool for every layer."""
        self.swa_full_tokens_ratio = swa_full_tokens_ratio
        self.init_memory_pool(
            max_total_tokens, mem_fraction_static, max_running_requests, graph_backend
        )
        self.graph_runner = self._make_graph_runner(graph_backend, capture_graphs)

    def _attention_shape(self, config: ModelConfig) -> dict[str, Any]:
        """This rank's share of the heads, as the attention backends take it."""
        return {
            "num_heads": config.num_attention_heads // self.tp_size,
            "num_kv_heads": config.get_num_kv_heads(self.tp_size),
            "head_dim": config.head_dim,
            "device": self.device,
        }

    def _make_graph_runner(
        self, graph_backend: GraphBackend | None, capture: bool
    ) -> GraphRunner | None:
        """The runner of captured decode batches over the pool (captured now unless the
        caller captures), or None where decode runs eagerly."""
        if graph_backend is None:
            logger.info("decode graphs: none to capture (decode runs eagerly on %s)", self.device)
            return None
        runner = self._graph_runner(self.token_to_kv_pool, graph_backend)
        if capture:
            runner.capture()
        return runner

    def _prepare_weights(self) -> None:
        """Batch-invariant kernels under --enable-deterministic-inference (before LoRA layers
        attach: they take their base's setting); otherwise the packed copies the default
        kernels read."""
        if self.deterministic:
            make_batch_invariant(self.model, self.attn_backend)
            return
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.pack_weight()
        self.model.logits_processor.pack_lm_head(self.model.lm_head)

    def _choose_graph_backend(
        self,
        graph_backend: GraphBackend | None,
        enable_torch_compile: bool,
        disable_cuda_graph: bool,
    ) -> GraphBackend | None:
        """What captures decode batches: torch.compile where asked (not with LoRA), CUDA
        graphs on a GPU unless disabled, the injected backend, or none."""
        if enable_torch_compile:
            if self.lora_manager is not None:
                logger.warning("--enable-torch-compile is not used with LoRA: decode runs eagerly")
                return None
            graph_backend = graph_backend or TorchCompileBackend()
        elif disable_cuda_graph:
            return None
        elif graph_backend is None and self.device.type == "cuda":
            graph_backend = CudaGraphBackend(self.device)
        return graph_backend if self.cuda_graph_bs >= 1 else None

    def _kv_cache_dtype(self, kv_cache_dtype: str | torch.dtype | None) -> torch.dtype:
        """What the KV pool holds: the dtype (None), or float16 under float32 on CPU, which
        the CPU kernels widen as they read it; nothing else has kernels that read it."""
        if kv_cache_dtype is None:
            return self.dtype
        kv_dtype = DTYPES[kv_cache_dtype] if isinstance(kv_cache_dtype, str) else kv_cache_dtype
        widened = self.device.type == "cpu" and self.dtype == torch.float32
        if kv_dtype != self.dtype and not (widened and kv_dtype == torch.float16):
            raise ValueError(
                f"kv_cache_dtype {str(kv_dtype).removeprefix('torch.')} is not supported under "
                f"dtype {str(self.dtype).removeprefix('torch.')} on {self.device.type}: the KV "
                "cache holds the dtype, or float16 under float32 on CPU"
            )
        return kv_dtype

    def init_memory_pool(
        self,
        max_total_tokens: int | None,
        mem_fraction_static: float,
        max_running_requests: int,
        graph_backend: GraphBackend | None = None,
    ) -> None:
        """Graphs bake in the KV pool's addresses, so their memory is reserved first: the
        request table, then the graph memory a trial capture measures, then the pool out of
        what is left; the graphs are captured over the pool afterwards. The pool holds this
        rank's KV heads only; under tensor parallelism every rank sizes it alike (the
        smallest size any rank can afford), since their schedulers allocate in step."""
        started = time.perf_counter()
        config = self.model_config
        kv_heads = config.get_num_kv_heads(self.tp_size)
        kv_shape = (kv_heads, config.head_dim, config.num_hidden_layers)
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, self.context_len, self.device)
        if max_total_tokens is None:
            graph_bytes = 0
            if graph_backend is not None and self.device.type == "cuda":
                graph_bytes = self._measure_graph_memory()
            max_total_tokens = get_tp_group().min_over_ranks(
                MHATokenToKVPool.max_tokens_for_budget(
                    self._kv_cache_budget(mem_fraction_static) - graph_bytes,
                    *kv_shape,
                    self.kv_cache_dtype,
                )
            )
        if max_total_tokens < 1:
            raise RuntimeError(
                "no memory left for the KV cache; raise mem_fraction_static or set max_total_tokens"
            )
        kv_bytes = max_total_tokens * MHATokenToKVPool.cell_size(*kv_shape, self.kv_cache_dtype)
        self.token_to_kv_pool_allocator = self._allocator(max_total_tokens)
        self.max_total_num_tokens = self.token_to_kv_pool_allocator.size
        self.swa_max_total_num_tokens = (
            self.token_to_kv_pool_allocator.size_swa
            if isinstance(self.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
            else None
        )
        """The SWA pool's slots of a hybrid model (None: one pool)."""
        self.token_to_kv_pool = self._kv_pool(self.token_to_kv_pool_allocator)
        logger.info(
            "KV cache: %d tokens%s, %.2f GiB, sized in %.1f s",
            self.max_total_num_tokens,
            ""
            if self.swa_layers is None
            else f" (sliding-window layers: {self.swa_max_total_num_tokens})",
            kv_bytes / (1 << 30),
            time.perf_counter() - started,
        )

    def _allocator(self, max_total_tokens: int) -> TokenToKVPoolAllocator:
        """The slots of `max_total_tokens` tokens' bytes in every layer: one pool, or a
        hybrid model's two, split by `SWAKVPool.split_tokens`."""
        if self.swa_layers is None:
            return TokenToKVPoolAllocator(max_total_tokens, self.device)
        full, swa = SWAKVPool.split_tokens(
            max_total_tokens, self.swa_layers, self.swa_full_tokens_ratio
        )
        return SWATokenToKVPoolAllocator(full, swa, self.device)

    def _kv_pool(self, allocator: TokenToKVPoolAllocator) -> KVPool:
        """The K/V buffers of `allocator`'s slots: two pools for a hybrid model."""
        config = self.model_config
        head_shape = (config.get_num_kv_heads(self.tp_size), config.head_dim)
        if isinstance(allocator, SWATokenToKVPoolAllocator):
            assert self.swa_layers is not None, "a hybrid allocator serves a hybrid model"
            return SWAKVPool(
                allocator.size,
                allocator.size_swa,
                self.kv_cache_dtype,
                *head_shape,
                self.swa_layers,
                allocator.full_to_swa_index_mapping,
                self.device,
            )
        return MHATokenToKVPool(
            allocator.size,
            self.kv_cache_dtype,
            *head_shape,
            config.num_hidden_layers,
            self.device,
        )

    def _graph_runner(
        self, token_to_kv_pool: KVPool, backend: GraphBackend, largest_only: bool = False
    ) -> GraphRunner:
        batch_sizes = capture_batch_sizes(self.cuda_graph_bs)
        return GraphRunner(
            self.model,
            self.attn_backend,
            self.req_to_token_pool,
            token_to_kv_pool,
            self.cuda_graph_bs,
            backend,
            batch_sizes[-1:] if largest_only else batch_sizes,
            self.lora_manager,
        )

    def _measure_graph_memory(self) -> int:
        """Bytes a capture of the largest bucket takes (its pool, the warm-up's
        activations), over a one-slot stand-in KV pool, freed again after."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stand_in = self._kv_pool(self._allocator(1))
        trial = self._graph_runner(stand_in, CudaGraphBackend(self.device), largest_only=True)
        trial.capture()
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        del trial, stand_in
        torch.cuda.empty_cache()
        logger.info("CUDA graphs: %.2f GiB reserved (trial capture)", used / (1 << 30))
        return used

    def _kv_cache_budget(self, mem_fraction_static: float) -> int:
        """Bytes for K/V: on CUDA, what is free beyond the `1 - mem_fraction_static` of the
        GPU kept for activations and other processes."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free - total * (1 - mem_fraction_static))

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits `[batch_size, vocab_size]` (float32, or float64 for a float64 model), in
        a tensor of the caller's own: with graphs, `forward_output`'s live in graph memory
        that the next replay overwrites."""
        logits = self.forward_output(forward_batch).next_token_logits
        return logits if self.graph_runner is None else logits.clone()

    @torch.inference_mode()
    def forward_output(
        self, forward_batch: ForwardBatch, resolve_input_ids: ResolveInputIds | None = None
    ) -> LogitsProcessorOutput:
        """The logits and the prompt logprobs `forward_batch.prompt_logprobs` asks for.

        `resolve_input_ids` (the scheduler's `FutureMap.resolve`) turns futures among the
        input ids into tokens as part of the forward: inside the graph for a decode batch
        of up to `cuda_graph_bs` requests, eagerly for every other batch. A graph's logits
        are valid until the next forward (the sampler reads them at once, on the stream)."""
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            return self.graph_runner.replay(forward_batch, resolve_input_ids)
        if self.lora_manager is not None:
            self.lora_manager.prepare(forward_batch)
        if resolve_input_ids is not None:
            forward_batch.input_ids = resolve_input_ids(forward_batch.input_ids)
        self.attn_backend.init_forward_metadata(forward_batch)
        output: LogitsProcessorOutput = self.model(
            forward_batch.input_ids, forward_batch.positions, forward_batch
        )
        return output


def _swa_layers(
    config: ModelConfig, disable_hybrid_swa_memory: bool, swa_full_tokens_ratio: float
) -> tuple[bool, ...] | None:
    """Which layers' K/V go to the SWA pool: a hybrid model's sliding layers, unless one
    pool is asked for; None: one pool for every layer."""
    if not config.is_hybrid_swa or disable_hybrid_swa_memory:
        return None
    if not 0 < swa_full_tokens_ratio <= 1:
        raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {swa_full_tokens_ratio}")
    return tuple(config.layer_window(i) is not None for i in range(config.num_hidden_layers))
