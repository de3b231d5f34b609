"""llama.cpp's own accuracy figure for the Gemma 3 270M GGUF (Q4_K_M), to sit beside
`benchmarks/quant_accuracy.py --model gemma3-270m`: `llama-perplexity --kl-divergence` of the
file against the same GGUF dequantized to float32, which is llama.cpp's counterpart of our
float32 reference (gguf's numpy dequantization, as radixserve's loader does it: the weights
as shipped, without the format's kernels), over benchmarks/data/held_text.txt.

llama-perplexity scores only the second half of each `-c` window and needs two windows; the
held text is 499 tokens to llama.cpp's tokenizer (the first 496 are ours), so `-c 248`
scores 2 x 123 tokens. The reference runs with a float32 KV cache, as ours does, and flash
attention off: with it on, llama.cpp casts a float32 cache to float16 for the attention. The
Q4_K_M file runs with llama.cpp's defaults (flash attention where it can, a float16 cache),
as llama-server serves it. Besides llama-perplexity's statistics (mean KLD, top-1 agreement
as "Same top p", delta p), the mean |delta logprob| of the text's tokens, our table's figure,
is computed from both models' saved log-probabilities (llama.cpp stores them in 16-bit
steps of at most 16/65535 nats).

    bash benchmarks/serving/build-llama-server-avx2.sh   # llama-server and llama-perplexity
    nice -n 19 .venv/bin/python -m benchmarks.llama_accuracy --ctx 248 --threads 2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.quant_accuracy import HELD_TEXT
from benchmarks.serving.llama_peer import default_binary
from engine.model.embedded import GEMMA3_MODEL, embedded_model_path

STATISTICS = ("Mean    KLD", "RMS Δp", "Same top p")
"""The summary lines of a `--kl-divergence` run that the table row takes."""


def write_f32_gguf(source: Path, target: Path) -> Path:
    """`source` with every tensor dequantized to float32 and every key/value (tokenizer
    included) copied, `general.file_type` set to all-F32; written once, under a temporary
    name, then renamed."""
    if target.is_file():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # virtual fields, and the one the writer adds itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return target


@dataclass(frozen=True)
class SavedLogprobs:
    """What `llama-perplexity --kl-divergence-base FILE` (without `--kl-divergence`) saved:
    the log-probability of each scored token and each scored position's most likely token."""

    targets: np.ndarray
    target_logprobs: np.ndarray
    top1: np.ndarray
    clamped: np.ndarray
    """Targets more than 16 nats below the top token: the file holds them at that floor."""


def read_logprobs(path: Path) -> SavedLogprobs:
    """Parse llama-perplexity's file: `_logits_`, int32 n_ctx, n_vocab, n_chunk, the
    n_chunk x n_ctx tokens, then for each of a chunk's last n_ctx - 1 - n_ctx/2 positions a
    float32 scale and minimum log-prob (4 uint16 slots) and n_vocab uint16 steps, padded
    to an even count."""
    with path.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity log-probability file")
        n_ctx, n_vocab, n_chunk = np.fromfile(f, dtype=np.int32, count=3)
        tokens = np.fromfile(f, dtype=np.int32, count=n_chunk * n_ctx).reshape(n_chunk, n_ctx)
        first = n_ctx // 2
        width = 2 * ((n_vocab + 1) // 2) + 4
        rows = np.fromfile(f, dtype=np.uint16).reshape(n_chunk * (n_ctx - 1 - first), width)
    scale, minimum = rows[:, :4].copy().view(np.float32).T
    steps = rows[:, 4 : 4 + n_vocab]
    targets = tokens[:, first + 1 :].reshape(-1)
    picked = steps[np.arange(len(targets)), targets]
    return SavedLogprobs(
        targets=targets,
        target_logprobs=minimum.astype(np.float64) + scale * picked,
        top1=steps.argmax(axis=1),
        clamped=picked == 0,
    )


def compare(served: SavedLogprobs, reference: SavedLogprobs) -> tuple[float, float]:
    """Mean |delta logprob| of the scored tokens and top-1 agreement, as quant_accuracy.py
    computes them."""
    if not np.array_equal(served.targets, reference.targets):
        raise ValueError("the two files scored different tokens")
    delta = np.abs(served.target_logprobs - reference.target_logprobs).mean()
    return float(delta), float((served.top1 == reference.top1).mean())


def statistics(output: str) -> dict[str, str]:
    """The STATISTICS lines of a `--kl-divergence` run, name to value as printed."""
    found = {}
    for line in output.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.rstrip() in STATISTICS:
            found[name.rstrip()] = value.strip()
    missing = [name for name in STATISTICS if name not in found]
    if missing:
        raise ValueError(f"llama-perplexity printed no {missing}:\n{output[-3000:]}")
    return found


def perplexity(binary: Path, model: Path, flags: list[str]) -> str:
    """Run llama-perplexity, echoing its command; its stdout and stderr together."""
    argv = [str(binary), "-m", str(model), *flags]
    print("$", " ".join(argv), flush=True)
    done = subprocess.run(argv, capture_output=True, text=True)
    output = done.stdout + done.stderr
    # A text too short for two windows is logged as an error, yet exits 0.
    if done.returncode != 0 or re.search(r" E (perplexity|kl_divergence):", output):
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}):\n{output[-3000:]}")
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-perplexity",
        type=Path,
        default=default_binary("avx2").with_name("llama-perplexity"),
    )
    parser.add_argument("--ctx", type=int, default=248, help="-c: a window; the text must hold two")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "radixserve-llama-accuracy",
        help="where the float32 GGUF (about 1 GB) and the log-probability files go",
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = embedded_model_path(GEMMA3_MODEL)
    f32 = write_f32_gguf(model, args.workdir / f"{model.stem}-f32.gguf")
    base, saved = args.workdir / "f32.kld", args.workdir / "q4_k_m.kld"
    common = ["-f", str(HELD_TEXT), "-c", str(args.ctx), "-b", str(args.ctx)]
    common += ["-t", str(args.threads)]
    perplexity(
        args.llama_perplexity,
        f32,
        [*common, "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(base)],
    )
    perplexity(args.llama_perplexity, model, [*common, "--kl-divergence-base", str(saved)])
    output = perplexity(
        args.llama_perplexity,
        model,
        [*common, "--kl-divergence-base", str(base), "--kl-divergence"],
    )
    stats = statistics(output)
    summary = output[output.find("====== Perplexity statistics") :]
    print(summary[: summary.find("\n", summary.find("Same top p"))])
    served, reference = read_logprobs(saved), read_logprobs(base)
    delta, agree = compare(served, reference)
    clamped = int((served.clamped | reference.clamped).sum())
    print(
        f"{GEMMA3_MODEL}: {len(served.targets)} tokens of {HELD_TEXT.name} scored "
        f"(-c {args.ctx}); {clamped} at the 16-nat floor in either file"
    )
    print("| llama.cpp | mean KLD | mean abs delta logprob | top-1 agreement | RMS delta p |")
    print("|---|---|---|---|---|")
    print(
        f"| Q4_K_M vs F32 | {stats['Mean    KLD']} | {delta:.4f} | {stats['Same top p']} "
        f"| {stats['RMS Δp']} |"
    )
    print(f"(top-1 agreement from the two saved files: {agree:.1%})")


if __name__ == "__main__":
    main()
