"""LoRA in the engine, against transformers + peft on the same adapters (made here with
random non-zero A and B): one batch mixing three adapters and the base model gives each
request its own adapter's greedy tokens (float32) and logits (float64, within 1e-6, every
row the engine computes), also after radix reuse, chunked prefill and retraction; the
radix tree never shares a prefix across adapters and drops an unloaded adapter's; bad
adapters are refused by status."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import constants
from engine.api import Engine
from engine.lora import LoRAError, LoRAManager
from engine.model.forward_batch import ForwardMode
from engine.model.runner import ModelRunner
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Admission, Req
from testing.batches import ExtendInput, build_forward_batch
from tests.engine.lora.conftest import ALL_TARGETS, Reference, peft, prompt

OPTIONS: dict[str, Any] = dict(
    device="cpu",
    skip_tokenizer_init=True,
    max_total_tokens=8192,
    chunked_prefill_size=32,
    max_loras_per_batch=3,
    enable_lora_runtime_update=True,
)
GREEDY = {"temperature": 0, "ignore_eos": True}


def greedy(
    reference: Reference,
    name: str | None,
    ids: list[int],
    n: int,
) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference(name, ids + out, torch.float32).argmax()))
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[Engine]:
    paths = " ".join(f"{name}={path}" for name, path in adapters.items())
    with Engine(str(tiny_model_dir), dtype="float32", lora_paths=paths, **OPTIONS) as engine:
        yield engine


def kv_idle_and_whole(engine: Engine) -> bool:
    cache = engine.scheduler.cache_manager
    cache.check_integrity()
    free = cache.allocator.available_size() + cache.tree_cache.evictable_size()
    return free == engine.scheduler.max_total_tokens and not engine.scheduler.has_work()


MIXED = [None, "attn", "mlp", "all"]


def test_mixed_batch_float64_logits_match_peft(
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    reference: Reference,
):
    runner = ModelRunner(
        tiny_model_dir,
        dtype="float64",
        max_total_tokens=1024,
        enable_lora=True,
        max_loras_per_batch=3,
    )
    manager = runner.lora_manager
    assert isinstance(manager, LoRAManager)
    for name, path in adapters.items():
        manager.load(name, str(path))
    prompts = [prompt(20 + i, 9 + i) for i in range(len(MIXED))]
    rows = runner.req_to_token_pool.alloc(len(prompts))
    assert rows is not None
    reqs = [ExtendInput(row, 0, ids) for row, ids in zip(rows, prompts)]
    batch = build_forward_batch(runner, reqs, ForwardMode.EXTEND)
    slots = torch.tensor(manager.acquire(MIXED))
    batch.lora_slots = slots
    logits = runner.forward(batch)
    for row, (name, ids) in enumerate(zip(MIXED, prompts)):
        expected = reference(name, ids, torch.float64)
        torch.testing.assert_close(logits[row], expected, rtol=0, atol=1e-6)
    base = reference(None, prompts[1], torch.float64)
    assert (logits[1] - base).abs().max() > 1e-3, "the adapter changes the output"
    # A mixed decode step over the cached prompts: one token each, read from the KV pool.
    tokens = logits.argmax(-1).tolist()
    steps = [ExtendInput(row, len(p), [t]) for row, p, t in zip(rows, prompts, tokens)]
    batch = build_forward_batch(runner, steps)
    batch.lora_slots = slots
    logits = runner.forward(batch)
    for row, (name, ids, token) in enumerate(zip(MIXED, prompts, tokens)):
        expected = reference(name, ids + [token], torch.float64)
        torch.testing.assert_close(logits[row], expected, rtol=0, atol=1e-6)


SHARED = prompt(0, 40)
CASES: dict[str, tuple[list[list[int]], int]] = {
    "mixed": ([prompt(1 + i, 6 + i) for i in range(4)], 6),
    "radix_reuse": ([SHARED + prompt(10 + i, 4) for i in range(4)], 6),
    "chunked_prefill": ([prompt(20 + i, 70) for i in range(4)], 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_batch_greedy_tokens_match_peft(
    case: str,
    engine: Engine,
    reference: Reference,
):
    prompts, n = CASES[case]
    if case == "radix_reuse":  # the shared prefix cached under every adapter first
        engine.generate([SHARED] * 4, {**GREEDY, "max_new_tokens": 1}, lora_name=MIXED)
    results = engine.generate(prompts, {**GREEDY, "max_new_tokens": n}, lora_name=MIXED)
    for name, ids, result in zip(MIXED, prompts, results):
        assert result.output_ids == greedy(reference, name, ids, n), name
        if case == "radix_reuse":
            assert result.meta.cached_tokens == len(SHARED)
    assert kv_idle_and_whole(engine)


def test_retraction_keeps_each_adapters_tokens(
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    reference: Reference,
):
    paths = " ".join(f"{name}={path}" for name, path in adapters.items())
    options = {**OPTIONS, "max_total_tokens": 200}
    with Engine(str(tiny_model_dir), dtype="float32", lora_paths=paths, **options) as engine:
        prompts = [prompt(30 + i, 20) for i in range(8)]
        names = MIXED * 2
        results = engine.generate(prompts, {**GREEDY, "max_new_tokens": 24}, lora_name=names)
        assert engine.scheduler.stats.num_retractions > 0
        for name, ids, result in zip(names, prompts, results):
            assert result.output_ids == greedy(reference, name, ids, 24), name
        assert kv_idle_and_whole(engine)


def test_speculative_drafts_are_verified_under_each_requests_adapter(
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
):
    """NGRAM drafts in a batch mixing three adapters and the base model: each request's
    tokens are its adapter's greedy tokens (peft's), the first time and the second, when the
    trie drafts the first run's outputs and the target accepts them."""
    monkeypatch.setattr(constants, "SPEC_MAX_VERIFY_ROWS", 1024)  # every request drafts
    paths = " ".join(f"{name}={path}" for name, path in adapters.items())
    with Engine(
        str(tiny_model_dir),
        dtype="float32",
        lora_paths=paths,
        speculative_algorithm="NGRAM",
        **OPTIONS,
    ) as engine:
        prompts = [prompt(20 + i, 12) for i in range(8)]
        names = MIXED * 2
        for _ in range(2):
            results = engine.generate(prompts, {**GREEDY, "max_new_tokens": 16}, lora_name=names)
            for name, ids, result in zip(names, prompts, results):
                assert result.output_ids == greedy(reference, name, ids, 16), name
        assert engine.scheduler.stats.spec_accepted_tokens > 8 * 16 // 3
        assert kv_idle_and_whole(engine)


Record = tuple[Req, int, torch.Tensor]
"""(request, context length, the logits for the token at that position)."""


def record_logits(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[Record]:
    """Every row of logits the scheduler's batches produce, with the request it belongs to
    and the context it was computed over (chunks and re-prefills after retraction too)."""
    scheduler = engine.scheduler
    records: list[Record] = []
    last: list[torch.Tensor] = []
    forward_output, run_batch = scheduler.model_runner.forward_output, scheduler.run_batch

    def forward_spy(forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        output = forward_output(forward_batch, *args, **kwargs)
        last.append(output.next_token_logits.clone())
        return output

    def run_spy(batch: Any) -> Any:
        pending = run_batch(batch)
        seq_lens = batch.forward_batch.seq_lens_cpu
        records.extend(zip(batch.reqs, seq_lens, last.pop()))
        return pending

    monkeypatch.setattr(scheduler.model_runner, "forward_output", forward_spy)
    monkeypatch.setattr(scheduler, "run_batch", run_spy)
    return records


FLOAT64_CASES: dict[str, tuple[list[list[int]], int, int]] = {
    "radix_reuse": (CASES["radix_reuse"][0], 6, 8192),
    "chunked_prefill": (CASES["chunked_prefill"][0], 4, 8192),
    "retraction": ([prompt(30 + i, 20) for i in range(8)], 24, 200),
}
"""case -> (prompts, max_new_tokens, max_total_tokens)."""


@pytest.mark.parametrize("case", list(FLOAT64_CASES))
def test_float64_logits_match_peft_after_reuse_chunking_and_retraction(
    case: str,
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
):
    """Every logits row the engine computes (float64), for the three adapters and the base
    model in mixed batches, is transformers + peft's at that context within 1e-6: prefixes
    read from the radix tree, prompts prefilled in chunks, requests retracted and
    re-prefilled."""
    prompts, n, max_total_tokens = FLOAT64_CASES[case]
    names = (MIXED * 2)[: len(prompts)]
    paths = " ".join(f"{name}={path}" for name, path in adapters.items())
    options = {**OPTIONS, "max_total_tokens": max_total_tokens}
    with Engine(str(tiny_model_dir), dtype="float64", lora_paths=paths, **options) as engine:
        if case == "radix_reuse":  # the shared prefix cached under every adapter first
            engine.generate([SHARED] * 4, {**GREEDY, "max_new_tokens": 1}, lora_name=MIXED)
        records = record_logits(engine, monkeypatch)
        results = engine.generate(prompts, {**GREEDY, "max_new_tokens": n}, lora_name=names)
        stats = engine.scheduler.stats
        assert kv_idle_and_whole(engine)
    if case == "radix_reuse":
        assert all(r.meta.cached_tokens == len(SHARED) for r in results)
    if case == "chunked_prefill":
        assert any(seq_len < len(req.origin_input_ids) for req, seq_len, _ in records)
    if case == "retraction":
        assert stats.num_retractions > 0
    assert len(records) >= len(prompts) * n
    for req, seq_len, logits in records:
        ids = (req.origin_input_ids + req.output_ids)[:seq_len]
        expected = reference(req.admission.lora_name, ids, torch.float64)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_adapters_wait_for_a_slot_never_fail(engine: Engine):
    """Four adapters in one call with three slots: the fourth waits, then swaps in."""
    engine.scheduler.load_lora_adapter("attn2", engine.scheduler.lora.adapters()["attn"])
    try:
        names = ["attn", "mlp", "all", "attn2"]
        results = engine.generate(
            [prompt(40, 8)] * 4, {**GREEDY, "max_new_tokens": 3}, lora_name=names
        )
        assert [r.meta.finish_reason.type for r in results] == ["length"] * 4
        assert results[0].output_ids == results[3].output_ids  # the same weights
    finally:
        engine.scheduler.unload_lora_adapter("attn2")
    assert kv_idle_and_whole(engine)


def test_no_prefix_is_shared_across_adapters(engine: Engine):
    ids = prompt(50, 30)
    params = {**GREEDY, "max_new_tokens": 2}
    engine.generate(ids, params, lora_name="attn")
    assert engine.generate(ids, params, lora_name="mlp")[0].meta.cached_tokens == 0
    assert engine.generate(ids, params)[0].meta.cached_tokens == 0
    assert engine.generate(ids, params, lora_name="attn")[0].meta.cached_tokens == len(ids) - 1
    assert kv_idle_and_whole(engine)


def test_unloading_an_adapter_frees_its_prefixes(engine: Engine, adapters: dict[str, Path]):
    scheduler = engine.scheduler
    scheduler.load_lora_adapter("extra", str(adapters["mlp"]))
    ids = prompt(60, 30)
    engine.generate(ids, {**GREEDY, "max_new_tokens": 2}, lora_name="extra")
    before = scheduler.cache_manager.tree_cache.evictable_size()
    scheduler.unload_lora_adapter("extra")
    assert scheduler.cache_manager.tree_cache.evictable_size() == before - (len(ids) + 1)
    assert "extra" not in scheduler.lora.adapters()
    with pytest.raises(LoRAError) as error:
        engine.generate(ids, {**GREEDY, "max_new_tokens": 2}, lora_name="extra")
    assert (error.value.status, error.value.param) == (404, "model")
    assert kv_idle_and_whole(engine)


def test_unload_while_a_request_uses_it_is_409(engine: Engine):
    scheduler = engine.scheduler
    req = Req(
        "busy",
        prompt(70, 5),
        SamplingParams(max_new_tokens=2),
        admission=Admission(lora_name="all"),
    )
    scheduler.add_request(req)
    with pytest.raises(LoRAError) as error:
        scheduler.unload_lora_adapter("all")
    assert error.value.status == 409
    scheduler.run_event_loop(should_stop=lambda: req.finished)
    assert "all" in scheduler.lora.adapters()
    assert kv_idle_and_whole(engine)


def bad_adapter(src: Path, dst: Path, edit: Callable[[dict[str, Any], Path], None]) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "adapter_config.json").read_text())
    edit(config, dst)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def _rank(config: dict[str, Any], _: Path) -> None:
    config["r"] = 64


def _targets(config: dict[str, Any], _: Path) -> None:
    config["target_modules"] = ["q_proj", "lm_head"]


def _shapes(config: dict[str, Any], _: Path) -> None:
    config["r"] = 3  # the tensors are rank 4


def _missing(config: dict[str, Any], path: Path) -> None:
    (path / "adapter_model.safetensors").unlink()


@pytest.mark.parametrize("edit", [_rank, _targets, _shapes, _missing], ids=lambda f: f.__name__)
def test_bad_adapters_are_refused_with_400(
    edit: Callable[[dict[str, Any], Path], None], engine: Engine, adapters: dict[str, Path]
):
    root = adapters["attn"].parent
    path = bad_adapter(adapters["attn"], root / f"bad{edit.__name__}", edit)
    with pytest.raises(LoRAError) as error:
        engine.scheduler.load_lora_adapter("bad", str(path))
    assert error.value.status == 400
    assert "bad" not in engine.scheduler.lora.adapters()
    result = engine.generate(prompt(80, 6), {**GREEDY, "max_new_tokens": 2}, lora_name="attn")
    assert result[0].meta.finish_reason.type == "length"


def test_paths_outside_the_root_and_duplicates_are_refused(
    engine: Engine, tmp_path: Path, adapters: dict[str, Path]
):
    outside = bad_adapter(adapters["attn"], tmp_path / "elsewhere", lambda c, p: None)
    with pytest.raises(LoRAError) as error:
        engine.scheduler.load_lora_adapter("x", str(outside))
    assert (error.value.status, error.value.param) == (400, "lora_path")
    with pytest.raises(LoRAError) as error:
        engine.scheduler.load_lora_adapter("attn", str(adapters["attn"]))
    assert (error.value.status, error.value.param) == (400, "lora_name")
    with pytest.raises(LoRAError) as error:
        engine.scheduler.unload_lora_adapter("nope")
    assert error.value.status == 404


@pytest.mark.timeout(180)
def test_tp2_mixed_batch_equals_tp1(
    engine: Engine, tiny_model_dir: Path, adapters: dict[str, Path]
):
    """Two ranks over gloo (adapters sharded like their layers; one loaded at run time,
    which every rank applies) give the tokens one rank gives."""
    prompts, n = CASES["mixed"]
    params = {**GREEDY, "max_new_tokens": n}
    names = ["late" if name == "all" else name for name in MIXED]
    expected = [r.output_ids for r in engine.generate(prompts, params, lora_name=MIXED)]
    paths = " ".join(f"{name}={adapters[name]}" for name in ("attn", "mlp"))
    with Engine(
        str(tiny_model_dir), dtype="float32", tp_size=2, lora_paths=paths, **OPTIONS
    ) as tp2:
        tp2.scheduler.load_lora_adapter("late", str(adapters["all"]))
        results = tp2.generate(prompts, params, lora_name=names)
        assert [r.output_ids for r in results] == expected
        tp2.scheduler.unload_lora_adapter("late")
        assert kv_idle_and_whole(tp2)


@pytest.mark.timeout(180)
def test_embedded_model_mixed_batch_matches_peft(tmp_path: Path):
    """The embedded SmolLM2 with a rank-8 adapter on all seven projections, beside the base
    model in one batch (float32 greedy tokens)."""
    from testing.models import embedded_hf_model

    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS)
    # A copy: the shared model stays as other tests expect it.
    hf = peft.get_peft_model(copy.deepcopy(embedded_hf_model()), config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.05)
    hf.save_pretrained(tmp_path / "chat")
    prompts = [[1, *prompt(90 + i, 12)] for i in range(2)]
    options = {**OPTIONS, "max_total_tokens": 1024, "lora_paths": f"chat={tmp_path / 'chat'}"}
    with Engine(None, dtype="float32", **options) as engine:
        results = engine.generate(
            prompts, {**GREEDY, "max_new_tokens": 4}, lora_name=[None, "chat"]
        )

    @torch.no_grad()
    def hf_greedy(ids: list[int]) -> list[int]:
        out: list[int] = []
        for _ in range(4):
            out.append(int(hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
        return out

    with hf.disable_adapter():
        assert results[0].output_ids == hf_greedy(prompts[0])
    assert results[1].output_ids == hf_greedy(prompts[1])


def test_deterministic_inference_gives_an_adapters_request_the_same_bits_in_any_batch(
    tiny_model_dir: Path, adapters: dict[str, Path]
):
    """--enable-deterministic-inference with LoRA: the LoRA terms go through the mode's
    row-invariant matmul too, so a request of one adapter gets the same tokens and logprobs
    alone as among requests of other adapters, of other lengths, chunked."""
    paths = " ".join(f"{name}={path}" for name, path in adapters.items())
    params = {**GREEDY, "max_new_tokens": 8, "logprobs": True, "top_logprobs_num": 2}
    probe = prompt(99, 70)
    with Engine(
        str(tiny_model_dir),
        dtype="float32",
        lora_paths=paths,
        enable_deterministic_inference=True,
        **OPTIONS,
    ) as engine:

        def answer(result: Any) -> tuple[Any, ...]:
            return result.output_ids, result.meta.output_token_logprobs

        alone = answer(engine.generate(probe, params, lora_name="all")[0])
        others = [prompt(seed, 5 + 9 * seed) for seed in range(6)]
        results = engine.generate(
            [*others[:3], probe, *others[3:]],
            [{**GREEDY, "max_new_tokens": 3 + seed} for seed in range(3)]
            + [params]
            + [{**GREEDY, "max_new_tokens": 3 + seed} for seed in range(3)],
            lora_name=[*MIXED[:3], "all", *MIXED[1:]],
        )
        assert answer(results[3]) == alone
