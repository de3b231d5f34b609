"""Model-runtime speed on the embedded SmolLM2-135M: radixserve's ModelRunner beside
transformers' forward on the same weights, same dtype, same shapes, in one run; or, with
`--baseline PATH`, beside another checkout of radixserve (a `git worktree`), interleaved,
on any model (`--model`).

Prefill: one 512-token prompt, tokens/s. Decode: one step for a batch of requests that
each hold `--decode-context` tokens of KV, ms/step (median). Random token ids: speed does
not depend on them. Every run measures the memory bandwidth (a 256 MiB copy) and reports
each decode step against its floor: the bytes the step must read (every weight once, plus
the batch's K/V) at that bandwidth. Results: docs/benchmarks/model.md.

    .venv/bin/python benchmarks/model_bench.py
    git worktree add /tmp/rs-main 9130455
    .venv/bin/python benchmarks/model_bench.py --baseline /tmp/rs-main
    .venv/bin/python benchmarks/model_bench.py --baseline /tmp/rs-main --shapes "8x200" --prefill 96
    .venv/bin/python benchmarks/model_bench.py --baseline /tmp/rs-main --background-load 20
    .venv/bin/python benchmarks/model_bench.py --baseline /tmp/rs-main --model gemma3-270m \
        --quantization gguf --dtypes bfloat16 --shapes "1x300"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

# isort: off
import engine  # first: it sets the OpenMP defaults of its checkout before torch loads OpenMP
import torch

# isort: on
from engine.model.runner import DTYPES, ModelRunner
from testing.batches import ExtendInput, build_forward_batch

REPO = Path(__file__).resolve().parents[1]
COPY_BYTES = 256 << 20


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_path() -> str:
    """This tree's CPU kernel path. Imported here, not at the top: a `--baseline` tree's
    decode workers import this file over an older `engine`, which may have no cpu_isa."""
    from engine.kernels.cpu.isa import cpu_isa

    return cpu_isa().path


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes/s of a 256 MiB tensor copy, read and write both counted (median of `repeats`)."""
    src = torch.ones(COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / median_seconds(partial(dst.copy_, src), repeats)


BURN_LOOP = """
import sys, time
busy, idle = float(sys.argv[1]), float(sys.argv[2])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


class BackgroundLoad:
    """A process that keeps one core busy `percent` % of the time in 0.5 ms bursts, as the
    server's tokenizer, detokenizer and HTTP clients take turns on the cores of a forward.
    Stopped (SIGSTOP) except inside `running()`, so that the bandwidth copies see an idle
    machine."""

    BURST = 0.5e-3

    def __init__(self, percent: float):
        idle = self.BURST * (100 - percent) / percent
        self.process = subprocess.Popen(
            [sys.executable, "-c", BURN_LOOP, str(self.BURST), str(idle)]
        )
        self.process.send_signal(signal.SIGSTOP)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.process.send_signal(signal.SIGCONT)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


class DecodeBench:
    """One ModelRunner holding a batch of requests with `context` tokens of KV for each
    decode shape, stepped on demand. The contexts are mapped to pool slots without a
    prefill (a step's cost does not depend on the K/V values; prefilling 32 x 512 tokens
    takes minutes on a small CPU). Uses only the ModelRunner calls that every checkout
    since the first wave has, so that `--baseline` can run it against an older tree."""

    def __init__(
        self,
        dtype: str,
        shapes: list[tuple[int, int]],
        max_steps: int,
        spare_tokens: int = 0,
        model: str = "embedded",
        **runner_options: Any,
    ):
        tokens = sum(b * (ctx + max_steps + 2) for b, ctx in shapes) + spare_tokens
        self.runner = runner = ModelRunner(
            model,
            dtype=dtype,
            # a hybrid model's sliding layers get 0.8 of these slots (`swa_full_tokens_ratio`)
            max_total_tokens=tokens * 5 // 4,
            max_running_requests=sum(b for b, _ in shapes) + 1,
            **runner_options,
        )
        self.batches: list[list[ExtendInput]] = []
        for batch_size, context in shapes:
            rows = runner.req_to_token_pool.alloc(batch_size)
            assert rows is not None, "max_running_requests covers every shape"
            for row in rows:
                slots = runner.token_to_kv_pool_allocator.alloc(context)
                assert slots is not None, "max_total_tokens covers every shape"
                runner.req_to_token_pool.write(row, 0, slots)
            self.batches.append([ExtendInput(r, context, [7]) for r in rows])

    def step_seconds(self, shape: int) -> float:
        """One decode step of batch `shape`, the forward alone (its batch is built first)."""
        batch = self.batches[shape]
        forward_batch = build_forward_batch(self.runner, batch)
        start = time.perf_counter()
        self.runner.forward(forward_batch)
        elapsed = time.perf_counter() - start
        self.batches[shape] = [ExtendInput(r.req_pool_idx, r.prefix_len + 1, [7]) for r in batch]
        return elapsed

    def prefill_seconds(self, shape: int, new_tokens: int) -> float:
        """One prefill of `new_tokens` per request of batch `shape` over its context (a turn
        of a conversation over its cached history), the forward alone; its KV is freed after."""
        runner = self.runner
        batch = [
            ExtendInput(r.req_pool_idx, r.prefix_len, [7] * new_tokens) for r in self.batches[shape]
        ]
        forward_batch = build_forward_batch(runner, batch)
        start = time.perf_counter()
        runner.forward(forward_batch)
        elapsed = time.perf_counter() - start
        runner.token_to_kv_pool_allocator.free(forward_batch.out_cache_loc)
        return elapsed

    def sizes(self) -> dict[str, int]:
        """Bytes a decode step reads: every weight once (the packed copies are not counted:
        a matmul reads one of the two), and per token of context its K and V in all layers."""
        config, model = self.runner.model_config, self.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        element = torch.empty((), dtype=self.runner.token_to_kv_pool.dtype).element_size()
        kv_token_bytes = (
            2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
        )
        return {"weight_bytes": weight_bytes, "kv_token_bytes": kv_token_bytes}


def decode_worker(args: argparse.Namespace) -> None:
    """`--decode-worker`: serve DecodeBench steps over stdin/stdout, one JSON line each way.
    Request `[shape, steps]`; reply the step times in seconds (prefills of `--prefill`
    tokens per request when it is set)."""
    shapes = parse_shapes(args.shapes)
    spare = max(b for b, _ in shapes) * args.prefill
    options = {"quantization": args.quantization} if args.quantization else {}
    if args.kv_cache_dtype:
        options["kv_cache_dtype"] = args.kv_cache_dtype
    bench = DecodeBench(args.dtypes[0], shapes, args.max_steps, spare, model=args.model, **options)
    print(json.dumps(bench.sizes()), flush=True)
    for line in sys.stdin:
        shape, steps = json.loads(line)
        if args.prefill:
            step = partial(bench.prefill_seconds, shape, args.prefill)
        else:
            step = partial(bench.step_seconds, shape)
        step()  # warm-up
        print(json.dumps([step() for _ in range(steps)]), flush=True)


class Worker:
    """A `--decode-worker` subprocess importing `engine` from `tree`; started at once, ready
    (model loaded, contexts prefilled) after `wait_ready`, so that workers load side by side."""

    def __init__(
        self,
        tree: Path,
        dtype: str,
        shapes: str,
        max_steps: int,
        prefill: int,
        quantization: str | None = None,
        model: str = "embedded",
        kv_cache_dtype: str | None = None,
    ):
        env = {k: v for k, v in os.environ.items() if k not in engine.OPENMP_SET_HERE}
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--decode-worker", "--dtypes", dtype, "--shapes", shapes]
            + ["--max-steps", str(max_steps), "--prefill", str(prefill)]
            + (["--quantization", quantization] if quantization else [])
            + (["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else [])
            + ["--model", model],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.sizes: dict[str, int] = {}

    def wait_ready(self) -> None:
        self.sizes = self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"decode worker exited with {self.proc.wait()}")
        return json.loads(line)

    def steps(self, shape: int, steps: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([shape, steps]) + "\n")
        self.proc.stdin.flush()
        times: list[float] = self._read()
        return times

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`"1x512 8x512"` -> [(1, 512), (8, 512)]: batch size x context tokens per request."""
    return [(int(b), int(c)) for b, c in (s.split("x") for s in text.split())]


def floor_seconds(sizes: dict[str, int], batch: int, context: int, bandwidth: float) -> float:
    return (sizes["weight_bytes"] + batch * context * sizes["kv_token_bytes"]) / bandwidth


def compare_with_baseline(args: argparse.Namespace) -> None:
    """This tree and `--baseline` in two worker processes, stepped in turns (the order
    alternating every round) with a bandwidth copy between rounds, so that both see the
    same background load."""
    shapes = parse_shapes(args.shapes)
    max_steps = args.rounds * (args.steps + 1)
    trees = {"this tree": REPO, "baseline": Path(args.baseline).resolve()}
    workers = {
        name: Worker(
            tree,
            args.dtypes[0],
            args.shapes,
            max_steps,
            args.prefill,
            args.quantization,
            args.model,
            args.kv_cache_dtype,
        )
        for name, tree in trees.items()
    }
    for worker in workers.values():
        worker.wait_ready()
    times: dict[tuple[str, int], list[float]] = {
        (n, s): [] for n in workers for s in range(len(shapes))
    }
    bandwidths = []
    load = BackgroundLoad(args.background_load) if args.background_load else None
    for round_ in range(args.rounds):
        bandwidths.append(copy_bandwidth(3))
        order = list(workers) if round_ % 2 == 0 else list(reversed(workers))
        with load.running() if load else contextlib.nullcontext():
            for shape in range(len(shapes)):
                for name in order:
                    times[name, shape] += workers[name].steps(shape, args.steps)
    if load:
        load.close()
    for worker in workers.values():
        worker.close()
    bandwidth = statistics.median(bandwidths)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtypes[0]}, "
        f"CPU kernel path {kernel_path()}; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (median of {len(bandwidths)}, "
        f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}); baseline {trees['baseline']}; "
        f"{args.rounds} rounds x {args.steps} steps"
        + (f"; a background load of {args.background_load:g} % of one core" if load else "")
        + "\n"
    )
    if args.prefill:  # compute-bound: no bandwidth floor
        print(
            "| prefill: batch x new tokens over context | this tree (ms) | baseline (ms) "
            "| this / baseline |"
        )
        print("|---|---:|---:|---:|")
        for shape, (batch, context) in enumerate(shapes):
            ours = statistics.median(times["this tree", shape]) * 1000
            base = statistics.median(times["baseline", shape]) * 1000
            print(
                f"| {batch} x {args.prefill} over {context} | {ours:.1f} | {base:.1f} "
                f"| {ours / base:.2f} |"
            )
        return
    print(
        "| decode batch x context | floor (ms) | this tree (ms) | x floor "
        "| baseline (ms) | x floor | this / baseline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape, (batch, context) in enumerate(shapes):
        floor = floor_seconds(workers["this tree"].sizes, batch, context, bandwidth) * 1000
        ours = statistics.median(times["this tree", shape]) * 1000
        base = statistics.median(times["baseline", shape]) * 1000
        print(
            f"| {batch} x {context} | {floor:.1f} | {ours:.1f} | {ours / floor:.2f} | "
            f"{base:.1f} | {base / floor:.2f} | {ours / base:.2f} |"
        )


def bench_ours(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    shapes = [(b, args.decode_context) for b in args.batch_sizes]
    bench = DecodeBench(dtype, shapes, args.steps + 1, spare_tokens=args.prompt_len)
    runner = bench.runner
    rows = runner.req_to_token_pool.alloc(1)
    assert rows is not None, "DecodeBench leaves a spare row"
    row = rows[0]
    prompt = torch.randint(runner.model_config.vocab_size, (args.prompt_len,)).tolist()

    def prefill() -> None:
        fb = build_forward_batch(runner, [ExtendInput(row, 0, prompt)])
        runner.forward(fb)
        runner.token_to_kv_pool_allocator.free(fb.out_cache_loc)

    results = {"prefill": args.prompt_len / median_seconds(prefill, args.steps)}
    results |= {k: float(v) for k, v in bench.sizes().items()}
    for shape, batch_size in enumerate(args.batch_sizes):
        bench.step_seconds(shape)  # warm-up
        step = statistics.median(bench.step_seconds(shape) for _ in range(args.steps))
        results[f"decode_{batch_size}"] = step * 1000
    return results


def hf_model(dtype: torch.dtype) -> Any:
    """transformers' Llama with the weights our loader reads from the embedded GGUF."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.model.loader import open_checkpoint

    checkpoint = open_checkpoint("embedded")
    c = checkpoint.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.context_len,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.load_state_dict(dict(checkpoint.weights()), strict=False)
    model.tie_weights()
    return model


def bench_hf(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    from transformers import DynamicCache

    model = hf_model(DTYPES[dtype])
    vocab = model.config.vocab_size
    results = {}
    prompt = torch.randint(vocab, (1, args.prompt_len))
    with torch.inference_mode():
        results["prefill"] = args.prompt_len / median_seconds(
            lambda: model(prompt, use_cache=True), args.steps
        )
        for batch_size in args.batch_sizes:
            cache = DynamicCache(config=model.config)
            model(
                torch.randint(vocab, (batch_size, args.decode_context)), cache=cache, use_cache=True
            )
            next_ids = torch.full((batch_size, 1), 7)
            results[f"decode_{batch_size}"] = (
                median_seconds(partial(model, next_ids, cache=cache, use_cache=True), args.steps)
                * 1000
            )
    return results


def compare_with_transformers(args: argparse.Namespace) -> None:
    bandwidth = copy_bandwidth()
    decode_cols = [f"decode b={b} (ms/step)" for b in args.batch_sizes]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"CPU kernel path {kernel_path()} (all paths side by side: benchmarks/cpu_paths.py); "
        f"decode context {args.decode_context} tokens/request; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    print(
        f"| engine | dtype | prefill {args.prompt_len} (tok/s) | " + " | ".join(decode_cols) + " |"
    )
    print("|---|---|---:|" + "---:|" * len(decode_cols))
    for dtype in args.dtypes:
        sizes: dict[str, int] = {}
        for name, bench in (("radixserve", bench_ours), ("transformers", bench_hf)):
            r = bench(dtype, args)
            sizes = sizes or {k: int(r[k]) for k in ("weight_bytes", "kv_token_bytes")}
            decode = " | ".join(f"{r[f'decode_{b}']:.1f}" for b in args.batch_sizes)
            print(f"| {name} | {dtype} | {r['prefill']:.0f} | {decode} |", flush=True)
        floors = " | ".join(
            f"{floor_seconds(sizes, b, args.decode_context, bandwidth) * 1000:.1f}"
            for b in args.batch_sizes
        )
        print(f"| floor | {dtype} | | {floors} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--baseline", help="another radixserve checkout: compare decode with it, interleaved"
    )
    parser.add_argument(
        "--shapes",
        default="1x512 8x512 32x512",
        help="with --baseline: decode shapes, batch x context tokens",
    )
    parser.add_argument("--rounds", type=int, default=6, help="with --baseline: turns each")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="with --baseline: time a prefill of this many new tokens per request over each "
        "shape's context instead of a decode step",
    )
    parser.add_argument(
        "--quantization",
        help="with --baseline: the runners' weight format (gguf, int8; default: the bf16/float "
        "copy, which every checkout can load)",
    )
    parser.add_argument(
        "--model",
        default="embedded",
        help="with --baseline: the model both trees run (embedded, gemma3-270m, a path)",
    )
    parser.add_argument(
        "--kv-cache-dtype", help="with --baseline: the runners' KV cache dtype (default: dtype)"
    )
    parser.add_argument(
        "--background-load",
        type=float,
        default=0,
        help="with --baseline: percent of one core that another process keeps busy while "
        "the trees step, in 0.5 ms bursts (a server's other processes on the same cores)",
    )
    parser.add_argument("--decode-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_worker:
        decode_worker(args)
    elif args.baseline:
        compare_with_baseline(args)
    else:
        compare_with_transformers(args)


if __name__ == "__main__":
    main()
