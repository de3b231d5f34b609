"""The scheduler's constants, by their SGLang names, in one place.

Each default can be overridden with a `RADIXSERVE_<NAME>` environment variable (read at
import); the ones users tune per deployment are also engine options (see EngineArgs).
"""

from __future__ import annotations

import os
from typing import TypeVar

_Number = TypeVar("_Number", int, float)


def _env(name: str, default: _Number) -> _Number:
    value = os.environ.get(f"RADIXSERVE_{name}")
    return type(default)(value) if value is not None else default


INIT_NEW_TOKEN_RATIO: float = _env("INIT_NEW_TOKEN_RATIO", 0.7)
"""Starting overcommit ratio, multiplied by --schedule-conservativeness."""
MIN_NEW_TOKEN_RATIO_FACTOR: float = _env("MIN_NEW_TOKEN_RATIO_FACTOR", 0.14)
"""The ratio decays to this fraction of its starting value..."""
NEW_TOKEN_RATIO_DECAY_STEPS: int = _env("NEW_TOKEN_RATIO_DECAY_STEPS", 600)
"""...linearly over this many decode steps."""
RETRACT_DECODE_STEPS: int = _env("RETRACT_DECODE_STEPS", 20)
"""After a retraction, reserve enough for every survivor to decode this many more tokens."""
CLIP_MAX_NEW_TOKENS: int = _env("CLIP_MAX_NEW_TOKENS", 4096)
"""max_new_tokens is clipped to this in budget estimates only, never in generation."""
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD: int = _env("IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD", 32)
"""lpm dedup considers only requests whose radix hit is at most this many tokens..."""
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD: int = _env(
    "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD", 32
)
"""...and defers those sharing at least this many tokens with a queue-mate."""
SWA_EVICTION_INTERVAL: int = _env("SWA_EVICTION_INTERVAL", 32)
"""A hybrid model's request frees the SWA slots its window has left behind once this many
have piled up: one batched free per that many tokens, not one per token."""
QUANTIZATION_METHODS = ("auto", "none", "gguf", "int8")
"""`--quantization`; `auto`: `gguf` for a GGUF file on CPU at one rank, else none; `gguf`
runs on CUDA too, when asked for (engine/model/loader.py's `resolve_quantization`)."""

ACTIVATION_BITS = {"int16": 16, "int8": 8, "float": 32}
"""`--quantized-activations`: the bits decode rows are rounded to, per block of 32, before
they multiply quantized weights (32: kept float; engine/kernels/cpu/csrc/quant_linear.cpp)."""

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
"""`--kv-cache-dtype`; engine/model/dtype.py resolves `auto`."""

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority", "routing-key")
"""Queue orders of engine/sched/policy.py."""
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "auto", "none")
"""Structured output: a library, auto (per grammar, the library that enforces it:
engine/grammar/validate.py), or none (json_schema, regex and ebnf refused)."""

LPM_MAX_QUEUE_LEN: int = _env("LPM_MAX_QUEUE_LEN", 128)
"""Above this many waiting requests lpm falls back to fcfs: matching them all costs too much."""

REASONING_PARSERS = {"deepseek_r1": "</think>", "qwen3": "</think>"}
"""`--reasoning-parser` names (SGLang's and vLLM's), each with the token that ends the
reasoning section: a grammar constrains only what follows it."""

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
"""`--speculative-algorithm` (SGLang's names): NGRAM drafts from a token trie over prompts and
outputs (engine/speculative/ngram.py); STANDALONE from a smaller model of the same tokenizer
(engine/speculative/standalone.py)."""
SPEC_ROW_COST_RATIO: float = _env("SPEC_ROW_COST_RATIO", 3.0)
"""Adaptive drafting's cost model: what a decode step of one request spends outside its
row's arithmetic (reading the weights), over what one more row costs (a fifth to a third
of a step on CPU: docs/benchmarks/speculative.md). In a verify pass of a batch of B
requests a drafted row pays off when it is accepted with probability above
B / (B + ratio): a quarter alone, three quarters among 8. A request whose recent drafts
(an exponential average over about 3 drafted steps) were accepted less often than that
stops drafting for a while..."""
SPEC_MAX_VERIFY_ROWS: int = _env("SPEC_MAX_VERIFY_ROWS", 8)
"""Rows of a verify pass (every running request's root and drafts) at most. A quantized
matmul widens each weight block once for a tile of up to 8 rows (4 on AVX2): rows filling
the first tile are cheap, rows past it pay a second widening, and among 8 running requests
a drafted row measured dearer than a decoded token (docs/benchmarks/speculative.md). So a
batch of 8 running requests or more does not draft."""
SPEC_ADAPTIVE_WARMUP_STEPS: int = _env("SPEC_ADAPTIVE_WARMUP_STEPS", 4)
"""...judged only after this many drafted steps..."""
SPEC_ADAPTIVE_BACKOFF_STEPS: int = _env("SPEC_ADAPTIVE_BACKOFF_STEPS", 16)
"""...and tries again after this many decode steps, doubling up to 16 times as long each
time it fails again."""
