"""Deterministic serving workloads: one seed gives every peer the same requests in the same
order, so two peers' figures differ only by the peer.

Prompts are random token ids, as in SGLang's `random` and `generated-shared-prefix`
datasets: speed does not depend on what the tokens say, and ids need no tokenizer to
build. What a workload controls is which prompt tokens repeat across requests, since that
is what a prefix cache can reuse.

- `shared-prefix`: `groups` system prompts of `system_len` tokens, each shared by
  `requests / groups` questions of `question_len` tokens; requests shuffled so that
  groups interleave, as independent users' requests do.
- `multi-turn`: `requests / turns` conversations of `turns` turns; turn k resends the
  whole history: every earlier user message (`user_len` tokens) and assistant reply
  (`output_len` tokens), then a new user message. The replies in the history are fixed
  random tokens, not what the peer generated, so all peers see the same prompts; a turn
  is sent only after the conversation's previous turn finished.
- `few-shot`: one exemplar block of `shots` examples of `shot_len` tokens shared by every
  request, then a question of `question_len` tokens.
- `random`: unique prompts of `random_len / 2` to `random_len` tokens; nothing shared
  beyond chance.
- `single-stream`: `stream_requests` unique prompts of `stream_prompt_len` tokens, each
  asking for `stream_output_len` tokens, one at a time (`FIXED_CONCURRENCY`): one user's
  speed, where batching cannot help.
- `long-prompt`: `long_prompt_repeats` unique prompts of `long_prompt_len` tokens asking for
  one token, one at a time: the TTFT of a long prompt's prefill, never served from a cache.

Every request asks for exactly its output length (`ignore_eos`): `output_len` tokens, except
in the last two.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

FIRST_TOKEN_ID = 100
"""Random ids start here: the special and byte tokens sit at the start of SmolLM2's
vocabulary (as of most BPE vocabularies), and a stray `<|im_end|>` in a prompt would make
a text prompt re-tokenize differently."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    after: int | None = None
    """Index of the request that must finish before this one is sent (the previous turn
    of its conversation), or None."""


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of every workload; the defaults are the comparison's (about 20 minutes for
    five peers on two cores). Each field is a flag: `system_len` is `--system-len`."""

    seed: int = 0
    requests: int = 32
    output_len: int = 32
    vocab_size: int = 49152
    groups: int = 4
    system_len: int = 512
    question_len: int = 32
    turns: int = 4
    user_len: int = 64
    shots: int = 8
    shot_len: int = 64
    random_len: int = 512
    stream_requests: int = 8
    stream_prompt_len: int = 256
    stream_output_len: int = 128
    long_prompt_len: int = 2048
    long_prompt_repeats: int = 3

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        for f in fields(self):
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                type=int,
                default=getattr(self, f.name),
                help=f"workload {f.name} (default: %(default)s)",
            )

    def from_flags(self, args: argparse.Namespace) -> WorkloadConfig:
        return replace(self, **{f.name: getattr(args, f.name) for f in fields(self)})


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def shared_prefix(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    per_group = max(1, cfg.requests // cfg.groups)
    systems = [_tokens(rng, cfg.system_len, cfg.vocab_size) for _ in range(cfg.groups)]
    requests = [
        BenchRequest(system + _tokens(rng, cfg.question_len, cfg.vocab_size), cfg.output_len)
        for system in systems
        for _ in range(per_group)
    ]
    rng.shuffle(requests)
    return requests


def multi_turn(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    """Turn-major order (every conversation's turn 0, then every turn 1, ...), so a static
    batch of at most `requests / turns` requests never holds two turns of one conversation."""
    conversations = max(1, cfg.requests // cfg.turns)
    histories: list[list[int]] = [[] for _ in range(conversations)]
    requests: list[BenchRequest] = []
    for turn in range(cfg.turns):
        for c in range(conversations):
            histories[c] = histories[c] + _tokens(rng, cfg.user_len, cfg.vocab_size)
            after = None if turn == 0 else len(requests) - conversations
            requests.append(BenchRequest(histories[c], cfg.output_len, after))
            histories[c] = histories[c] + _tokens(rng, cfg.output_len, cfg.vocab_size)
    return requests


def few_shot(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    exemplars = _tokens(rng, cfg.shots * cfg.shot_len, cfg.vocab_size)
    return [
        BenchRequest(exemplars + _tokens(rng, cfg.question_len, cfg.vocab_size), cfg.output_len)
        for _ in range(cfg.requests)
    ]


def random_unique(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest(
            _tokens(rng, rng.randint(max(1, cfg.random_len // 2), cfg.random_len), cfg.vocab_size),
            cfg.output_len,
        )
        for _ in range(cfg.requests)
    ]


def single_stream(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest(_tokens(rng, cfg.stream_prompt_len, cfg.vocab_size), cfg.stream_output_len)
        for _ in range(cfg.stream_requests)
    ]


def long_prompt(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest(_tokens(rng, cfg.long_prompt_len, cfg.vocab_size), 1)
        for _ in range(cfg.long_prompt_repeats)
    ]


def fixed_length(cfg: WorkloadConfig, n: int, length: int) -> list[BenchRequest]:
    """`n` unique prompts of exactly `length` tokens: a decode batch whose every request
    holds the same context (the decode-ceiling measurement)."""
    rng = random.Random(f"{cfg.seed}:fixed-{n}x{length}")
    return [BenchRequest(_tokens(rng, length, cfg.vocab_size), cfg.output_len) for _ in range(n)]


WORKLOADS: dict[str, Callable[[WorkloadConfig, random.Random], list[BenchRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "random": random_unique,
    "single-stream": single_stream,
    "long-prompt": long_prompt,
}
FIXED_CONCURRENCY = {"single-stream": 1, "long-prompt": 1}
"""Workloads that run at this concurrency whatever concurrencies a comparison asks for."""


def build(name: str, cfg: WorkloadConfig) -> list[BenchRequest]:
    """The requests of workload `name`; the same for the same `cfg`, whatever ran before
    (each workload draws from its own generator seeded by `cfg.seed` and its name)."""
    return WORKLOADS[name](cfg, random.Random(f"{cfg.seed}:{name}"))


def warmup_prompt(cfg: WorkloadConfig, length: int = 16) -> list[int]:
    """A short prompt from its own seed, so warming a server up seeds no workload prefix."""
    return _tokens(random.Random(f"{cfg.seed}:warmup"), length, cfg.vocab_size)
