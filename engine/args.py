"""Engine options: one dataclass, shared by the offline Engine and the worker service.

Field names are the snake_case of the server's CLI flags (`--max-total-tokens` is
`max_total_tokens`); each field's `help` metadata becomes the flag's help text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from engine import constants
from engine.cache.evict_policy import EVICTION_POLICIES
from engine.speculative.ngram import NgramConfig

_T = TypeVar("_T")


def _opt(default: _T, help: str, **kwargs: Any) -> _T:
    """A field with its flag's help text (and `choices`, if any) in its metadata."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class EngineArgs:
    model: str = _opt(
        "embedded",
        "local HF directory, GGUF file, HF repo id, or 'embedded' (SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = _opt(None, "tokenizer source when it differs from the model")
    skip_tokenizer_init: bool = _opt(False, "token ids in and out only; no tokenizer is loaded")
    device: str = _opt("auto", "cuda when available, else cpu")
    dtype: str = _opt(
        "auto",
        "auto: on CUDA bfloat16; on CPU the fastest for this CPU's kernel path "
        "(docs/benchmarks/cpu-paths.md): bfloat16 with AVX512-BF16 or AMX, float32 otherwise",
        choices=("auto", "bfloat16", "float16", "float32", "float64"),
    )
    quantization: str = _opt(
        "auto",
        "how weights are held: gguf (a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K "
        "blocks as stored, on CPU or CUDA), int8 (int8 rows quantized at load, CPU), none "
        "(the dtype), each at --tp-size 1; auto: gguf for a GGUF file on CPU at --tp-size 1, "
        "else none",
        choices=constants.QUANTIZATION_METHODS,
    )
    quantized_activations: str = _opt(
        "int16",
        "decode rows over quantized weights, rounded per block of 32 for integer dot "
        "products: int16 (within 1/65534 of the block's largest value: the dequantized "
        "model's results to about 1e-5), int8 (as llama.cpp does: faster with VNNI, less "
        "exact), or float (each weight widened: the dequantized model's results exactly, "
        "about half the speed); docs/benchmarks/quantization.md",
        choices=tuple(constants.ACTIVATION_BITS),
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "what the KV cache holds: the dtype, or float16 under float32 on CPU (half the bytes "
        "decode attention reads; llama.cpp's default cache type); auto: float16 where "
        "--dtype auto chose float32 on CPU, else the dtype (docs/benchmarks/cpu-paths.md)",
        choices=constants.KV_CACHE_DTYPES,
    )
    context_length: int | None = _opt(None, "override the model's context length")
    max_total_tokens: int | None = _opt(
        None,
        "KV cache size in tokens (default: a byte budget on CPU, --mem-fraction-static on CUDA)",
    )
    mem_fraction_static: float = _opt(0.85, "fraction of GPU memory for weights + KV cache")
    swa_full_tokens_ratio: float = _opt(
        0.8,
        "hybrid sliding-window models (Gemma 3): slots of the sliding layers' KV pool per slot "
        "of the full-attention layers' pool, in (0, 1]; the two share the bytes that "
        "--max-total-tokens (or the memory budget) gives every layer (docs/architecture.md)",
    )
    disable_hybrid_swa_memory: bool = _opt(
        False, "hybrid sliding-window models: keep every layer's KV in one pool"
    )
    disable_window_checkpoints: bool = _opt(
        False,
        "hybrid sliding-window models: keep the sliding layers' KV of cached prefixes only "
        "before each cached sequence's end, not also before its branch points, where a "
        "prefix shared by later requests ends (docs/architecture.md)",
    )
    max_running_requests: int = _opt(256, "cap on the running batch (rows of req_to_token)")
    max_prefill_tokens: int = _opt(16384, "cap on the new tokens of one prefill batch")
    chunked_prefill_size: int | None = _opt(
        0,
        "split prefills longer than this into chunks; 0: the device's default (CPU: 256, a "
        "turn of about a second at an 8k context; CUDA: 4096); none: off",
    )
    enable_mixed_chunk: bool = _opt(False, "let running decodes ride along in prefill batches")
    schedule_policy: str = _opt("fcfs", "queue order", choices=constants.SCHEDULE_POLICIES)
    schedule_conservativeness: float = _opt(
        1.0, "scales the starting new_token_ratio (higher: fewer retractions)"
    )
    clip_max_new_tokens: int = _opt(
        constants.CLIP_MAX_NEW_TOKENS, "max_new_tokens cap in budget estimates only"
    )
    radix_eviction_policy: str = _opt(
        "lru", "radix cache eviction order", choices=tuple(EVICTION_POLICIES)
    )
    disable_radix_cache: bool = _opt(False, "no prefix sharing")
    disable_overlap_schedule: bool | None = _opt(
        None,
        "run the normal event loop instead of the overlap loop (default: overlap on CUDA; "
        "on CPU the normal loop: there the forward thread and the scheduler contend for "
        "the GIL, and the overlap loop measured slower, docs/benchmarks/host.md)",
    )
    attention_backend: str | None = _opt(
        None, "torch | triton (default: triton on CUDA, torch on CPU)"
    )
    cuda_graph_max_bs: int = _opt(
        160,
        "largest decode batch replayed from a CUDA graph (clipped to --max-running-requests); "
        "larger ones run eagerly",
    )
    disable_cuda_graph: bool = _opt(False, "run every decode batch eagerly (no CUDA graphs)")
    enable_torch_compile: bool = _opt(
        False,
        "CPU only: compile the decode step with torch.compile, one graph per batch-size bucket "
        "up to --torch-compile-max-bs; compiling takes minutes at start "
        "(docs/benchmarks/model.md)",
    )
    torch_compile_max_bs: int = _opt(
        8, "largest decode batch run compiled under --enable-torch-compile; larger run eagerly"
    )
    random_seed: int = _opt(0, "seed for the random schedule policy and unseeded sampling")
    enable_deterministic_inference: bool = _opt(
        False,
        "CPU: the same request gives the same tokens whatever shares its batches and whatever "
        "the cache holds: batch-invariant kernels (float activations), and unseeded sampled "
        "requests drawn from --random-seed; docs/operations.md",
    )
    speculative_algorithm: str | None = _opt(
        None,
        "speculative decoding: NGRAM drafts the tokens that followed the request's latest "
        "tokens in earlier prompts and outputs (a token trie), STANDALONE a smaller draft "
        "model's greedy tokens; the model verifies each request's drafts in one forward "
        "pass, lossless; docs/operations.md",
        choices=constants.SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model_path: str | None = _opt(
        None,
        "STANDALONE: the draft model (a path or Hub id, as --model), a smaller model of the "
        "same tokenizer; it runs on the same device and dtype with a KV pool of its own",
    )
    speculative_draft_max_total_tokens: int = _opt(
        16384, "STANDALONE: the draft model's KV pool, in tokens (its radix tree keeps what fits)"
    )
    speculative_num_draft_tokens: int = _opt(
        8,
        "tokens per request in a verify pass: the last sampled token and up to this many "
        "minus one drafts (docs/benchmarks/speculative.md sizes it from the verify cost)",
    )
    speculative_ngram_min_match_window_size: int = _opt(
        1, "NGRAM: shortest suffix of a request matched against the trie"
    )
    speculative_ngram_max_match_window_size: int = _opt(
        12, "NGRAM: longest suffix matched (the longest match with continuations drafts first)"
    )
    speculative_ngram_min_bfs_breadth: int = _opt(
        1, "NGRAM BFS: continuations taken per node after the longest match"
    )
    speculative_ngram_max_bfs_breadth: int = _opt(
        10, "NGRAM BFS: continuations taken per node after the shortest match"
    )
    speculative_ngram_match_type: str = _opt(
        "BFS",
        "NGRAM: BFS expands a match's continuations breadth-first, the most recent first; "
        "PROB best-first by how often each path followed",
        choices=("BFS", "PROB"),
    )
    speculative_ngram_max_trie_depth: int = _opt(
        18, "NGRAM: longest n-gram the trie holds (a match plus its drafts)"
    )
    speculative_ngram_capacity: int = _opt(
        1_000_000, "NGRAM: trie nodes kept; past it the least recently extended are dropped"
    )
    speculative_adaptive: bool = _opt(
        True,
        "a request whose drafts keep being rejected stops drafting for a while (doubling), so "
        "text that does not repeat itself pays almost nothing for speculation",
    )
    grammar_backend: str = _opt(
        "auto",
        "structured output: xgrammar, llguidance, auto (per grammar, xgrammar where it "
        "enforces the grammar, else llguidance where it does, else a 400 naming the keyword; "
        "llguidance first for a JSON schema with a length-bounded string), or none "
        "(json_schema, regex and ebnf refused with a 400)",
        choices=constants.GRAMMAR_BACKENDS,
    )
    grammar_compile_workers: int = _opt(
        2, "threads compiling json_schema / regex / ebnf grammars (and xgrammar's processes)"
    )
    grammar_compile_timeout: float = _opt(
        10.0,
        "seconds a grammar may take to compile (xgrammar's compile is then killed) or to "
        "wait for a free compile worker, before its request gets a 400",
    )
    grammar_compile_memory_mb: int = _opt(
        2048, "resident memory an xgrammar compile process may reach before it is killed"
    )
    grammar_mask_timeout_ms: float = _opt(
        100.0,
        "milliseconds one request's token mask may take in a step (filled while the forward "
        "runs) before the request ends with a 400 naming its grammar's cost (tp 1 only)",
    )
    grammar_max_bytes: int = _opt(
        262144, "largest json_schema / regex / ebnf accepted, in bytes (UTF-8)"
    )
    grammar_max_nesting_depth: int = _opt(
        64,
        "deepest nesting accepted: JSON containers of a schema, brackets "
        "of a regex or ebnf (xgrammar recurses natively over them)",
    )
    reasoning_parser: str | None = _opt(
        None,
        "the model writes a <think> section first: split it into reasoning_content, and "
        "apply grammars only after it",
        choices=tuple(constants.REASONING_PARSERS),
    )
    enable_jump_forward: bool = _opt(
        False,
        "append text a grammar forces without a forward pass per token (needs the radix cache)",
    )
    debug_future_map: bool = _opt(
        False, "poison the FutureMap and assert every future is written before read"
    )
    tp_size: int = _opt(
        1,
        "tensor-parallel ranks, one process and one device each: the model's layers and KV "
        "heads are split over them",
    )
    nnodes: int = _opt(1, "nodes the tensor-parallel ranks span, tp_size / nnodes on each")
    node_rank: int = _opt(
        0,
        "this node's index in [0, nnodes): node 0 runs rank 0, the worker the other "
        "services talk to; the others run worker ranks only",
    )
    dist_init_addr: str | None = _opt(
        None,
        "host:port where rank 0 serves the rendezvous (default: 127.0.0.1 and a free port, "
        "on one node); required when nnodes > 1",
    )
    dist_init_timeout: float = _opt(
        1800.0,
        "seconds tensor-parallel start-up waits for every rank to join the group and load "
        "its shard (a local rank that dies fails the start at once); once serving, a "
        "collective waits 60 s",
    )
    lora_paths: str | None = _opt(
        None,
        "LoRA adapters (PEFT directories) loaded at start, as name=path entries separated "
        "by commas or spaces; a request picks one by its name",
    )
    max_lora_rank: int = _opt(16, "largest LoRA adapter rank accepted")
    max_loras_per_batch: int = _opt(
        4,
        "LoRA adapters resident at once (one batch mixes at most this many; others wait "
        "and swap in, least recently used out)",
    )
    enable_lora_runtime_update: bool = _opt(
        False, "allow /load_lora_adapter and /unload_lora_adapter while serving"
    )
    lora_root: str | None = _opt(
        None,
        "directory that run-time adapter paths must lie under (default: the parent "
        "directories of --lora-paths)",
    )

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ValueError(
                "chunked_prefill_size must be >= 0 (0: the device's default; none: off), "
                f"got {self.chunked_prefill_size}"
            )
        if self.enable_deterministic_inference and self.enable_torch_compile:
            raise ValueError(
                "enable_deterministic_inference runs the batch-invariant kernels eagerly: "
                "drop enable_torch_compile"
            )
        if self.enable_jump_forward and self.disable_radix_cache:
            raise ValueError(
                "enable_jump_forward needs the radix cache: "
                "a jump hands the request's KV to the tree"
            )
        self.check_parallel()
        self.lora_entries()
        if (self.speculative_algorithm == "STANDALONE") != bool(self.speculative_draft_model_path):
            raise ValueError(
                "speculative_draft_model_path goes with speculative_algorithm STANDALONE, "
                "and STANDALONE needs it"
            )
        if self.speculative_algorithm is not None:
            self.ngram_config()
            if self.speculative_num_draft_tokens < 2:
                raise ValueError(
                    "speculative_num_draft_tokens counts the tree's root (the last sampled "
                    "token) and its drafts: it must be >= 2, "
                    f"got {self.speculative_num_draft_tokens}"
                )
            if self.speculative_algorithm == "STANDALONE" and self.tp_size > 1:
                raise ValueError(
                    "speculative_algorithm STANDALONE runs at tp_size 1: its draft model's "
                    "scheduler is not split over the ranks"
                )

    def check_speculative(
        self, attention_backend: str, vocab_size: int, draft_vocab_size: int | None
    ) -> None:
        """The speculative checks that need the device's attention backend and the loaded
        models' vocabularies (`engine.build` asks once both are loaded)."""
        if self.speculative_algorithm is None:
            return
        if attention_backend != "torch":
            raise ValueError(
                "speculative_algorithm verifies draft trees with the torch attention "
                "backend only: pass attention_backend torch"
            )
        if draft_vocab_size is not None and draft_vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab_size} tokens) is not the "
                f"model's ({vocab_size}): it needs the same tokenizer"
            )

    def draft_model_args(self) -> EngineArgs:
        """STANDALONE: the draft model's engine options — this engine's device, dtype and
        kernels, its own pool, the normal loop, no speculation, adapters or grammars."""
        assert self.speculative_draft_model_path is not None, "STANDALONE"
        return replace(
            self,
            model=self.speculative_draft_model_path,
            tokenizer=None,
            skip_tokenizer_init=True,
            max_total_tokens=self.speculative_draft_max_total_tokens,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            disable_overlap_schedule=True,
            enable_torch_compile=False,
            grammar_backend="none",
            lora_paths=None,
            enable_lora_runtime_update=False,
        )

    def ngram_config(self) -> NgramConfig:
        """The `--speculative-ngram-*` options, checked."""
        return NgramConfig(
            max_trie_depth=self.speculative_ngram_max_trie_depth,
            capacity=self.speculative_ngram_capacity,
            min_match_window_size=self.speculative_ngram_min_match_window_size,
            max_match_window_size=self.speculative_ngram_max_match_window_size,
            min_bfs_breadth=self.speculative_ngram_min_bfs_breadth,
            max_bfs_breadth=self.speculative_ngram_max_bfs_breadth,
            match_type=self.speculative_ngram_match_type,
        )

    def check_parallel(self) -> None:
        """Refuse a rank layout that cannot start, before any process is spawned."""
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): "
                "every node runs the same number of ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(
                "nnodes > 1 needs dist_init_addr: the host:port of node 0 that every node reaches"
            )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if not self.dist_init_timeout > 0:
            raise ValueError(f"dist_init_timeout must be > 0 seconds, got {self.dist_init_timeout}")

    @property
    def enable_lora(self) -> bool:
        """Whether the model gets LoRA layers: adapters at start or loadable later."""
        return bool(self.lora_paths) or self.enable_lora_runtime_update

    def lora_entries(self) -> dict[str, str]:
        """`lora_paths` as name -> path, refusing a malformed or repeated entry."""
        entries: dict[str, str] = {}
        for entry in (self.lora_paths or "").replace(",", " ").split():
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_paths entries are name=path, got {entry!r}")
            if name in entries:
                raise ValueError(f"lora_paths names adapter {name!r} twice")
            entries[name] = path
        return entries

    def lora_roots(self) -> list[str]:
        """Directories run-time adapter paths must lie under."""
        if self.lora_root is not None:
            return [self.lora_root]
        return sorted({os.path.dirname(os.path.abspath(p)) for p in self.lora_entries().values()})

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def first_rank(self) -> int:
        """The global rank of this node's first rank (the one its own process runs)."""
        return self.node_rank * self.ranks_per_node

    @classmethod
    def from_options(cls, **options: Any) -> EngineArgs:
        """Build from keyword options, naming any unknown one (a typo must not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; valid options are {sorted(known)}"
            )
        return cls(**options)
