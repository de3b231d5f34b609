"""The verify batch: every running request's draft tree laid out as one forward pass,
each tree node a row whose attention sees its ancestors only (`tree_ancestors`)."""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine.grammar import allocate_vocab_mask
from engine.mem.swa_kv_pool import KVPool
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sched.batch import ScheduleBatch
from engine.sched.cache_manager import CacheManager
from engine.sched.mask_filler import VocabMask
from engine.sched.req import Req
from engine.sched.running_batch import RunningBatch
from engine.speculative.draft_tree import DraftTree
from engine.speculative.grammar import fill_tree_masks


def prepare_verify(
    decodes: RunningBatch,
    trees: list[DraftTree],
    cache_manager: CacheManager,
    token_to_kv_pool: KVPool,
    eos_token_ids: Collection[int],
) -> ScheduleBatch:
    """A verify step of every running request: its draft tree's nodes as new tokens,
    node 0 (the last sampled token, known here: nothing is in flight) where a decode
    step's input would be. The slots are taken for every node but not written into
    the requests' rows: which of them a request keeps is known only after the pass
    (`CacheManager.keep_verified`)."""
    reqs = decodes.reqs
    sizes = [len(tree) for tree in trees]
    depths = _ints([depth for tree in trees for depth in tree.depths])
    device = token_to_kv_pool.device
    forward_batch = ForwardBatch.from_host(
        ForwardMode.TARGET_VERIFY,
        _ints([token for tree in trees for token in tree.tokens]),
        decodes.req_pool_indices,
        decodes.seq_lens,
        _ints(sizes),
        cache_manager.alloc_slots(sum(sizes)),
        cache_manager.req_to_token_pool,
        token_to_kv_pool,
        tree_depths=depths,
    )
    forward_batch.tree_ancestors = _ancestor_table(trees).to(device, non_blocking=True)
    token_req = torch.repeat_interleave(torch.arange(len(reqs)), _ints(sizes))
    rows = decodes.sampling_rows.select(token_req)
    sampling_info = SamplingBatchInfo.from_rows(rows, decodes.vocab_size, device)
    faults: list[tuple[Req, Exception]] = []
    if decodes.num_req_state:  # only requests without drafts have any (`Drafter._drafts`)
        row_reqs = [req for req, size in zip(reqs, sizes) for _ in range(size)]
        if bool(rows.needs_req_state.any()):
            sampling_info.add_req_state(row_reqs, rows, eos_token_ids)
            seeded = sampling_info.seeded_rows
            if seeded is not None and sampling_info.seed_steps is not None:
                # A node at depth d samples the output token n + d, if accepted.
                offsets = depths.index_select(0, seeded.cpu()).to(device)
                sampling_info.seed_steps = sampling_info.seed_steps + offsets
        sampling_info.vocab_mask, faults = build_tree_vocab_mask(
            reqs, trees, decodes.vocab_size, device
        )
    return ScheduleBatch(
        reqs, sizes, 0, frozenset(), forward_batch, sampling_info, faults, trees=trees
    )


def _ancestor_table(trees: list[DraftTree]) -> torch.Tensor:
    """`[nodes, max depth + 1]`: for each node of the batch, the batch row of its ancestor
    at each depth (itself at its own), -1 deeper."""
    width = max(max(tree.depths) for tree in trees) + 1
    table: list[list[int]] = []
    start = 0
    for tree in trees:
        for node in range(len(tree)):
            path = [start + n for n in tree.path(node)]
            table.append(path + [-1] * (width - len(path)))
        start += len(tree)
    return torch.tensor(table, dtype=torch.int64)


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def build_tree_vocab_mask(
    reqs: list[Req], trees: list[DraftTree], vocab_size: int, device: torch.device
) -> VocabMask:
    """The grammar bitmask of a verify batch, filled at once (the drafts are walked on the
    matchers): each grammar request's rows are its tree's nodes, each masked with the
    grammar's state after the node's path."""
    if all(r.grammar.matcher is None for r in reqs):
        return VocabMask(None, [])
    vocab_mask = allocate_vocab_mask(sum(len(tree) for tree in trees), vocab_size)
    faults: list[tuple[Req, Exception]] = []
    start = 0
    for req, tree in zip(reqs, trees):
        grammar = req.grammar.matcher
        if grammar is not None:
            try:
                fill_tree_masks(tree, grammar, vocab_mask, start)
            except Exception as e:
                vocab_mask[start : start + len(tree)] = -1
                faults.append((req, e))
        start += len(tree)
    return VocabMask(vocab_mask.to(device, non_blocking=True), faults)
