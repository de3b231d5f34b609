"""The verify walk: greedy follows the target's argmax down the tree; sampled rows give
exactly the target's distribution at every depth whatever the drafts (a chi-square over
many walks of a tiny vocabulary), with the acceptance of recursive rejection sampling."""

from __future__ import annotations

import torch

from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRows
from engine.sampling.sampling_params import SamplingParams
from engine.speculative.draft_tree import DraftTree
from engine.speculative.verify import VerifyOutput, walk_trees

V = 6


def info_for(params: SamplingParams, rows: int) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_rows(SamplingRows.from_params([params] * rows, V), V)


def verify(logits: torch.Tensor, trees: list[DraftTree], params: SamplingParams) -> VerifyOutput:
    """The verify batch's sampling and walk, as the forward side runs them."""
    return walk_trees(trees, Sampler()(logits, info_for(params, len(logits))))


def tree() -> DraftTree:
    """Root (token 0) → drafts 2 and 4; 2 → draft 5."""
    t = DraftTree.root(0)
    two = t.add(0, 2)
    t.add(0, 4)
    t.add(two, 5)
    return t


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chance of a chi-square statistic this large if `counts` were drawn from `probs`
    (cells of zero probability must have no counts)."""
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token of zero probability came out"
    n = counts.sum()
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    kept = torch.zeros_like(probs)
    top = probs.topk(top_k)
    kept[top.indices] = top.values
    return kept / kept.sum()


def test_greedy_follows_the_argmax_and_ends_with_the_targets_token():
    t = tree()
    logits = torch.full((4, V), -5.0)
    logits[0, 2] = 5  # root: 2, a draft
    logits[1, 5] = 5  # after 2: 5, a draft
    logits[3, 1] = 5  # after 2 5: 1, the target's own
    logits[2, 3] = 5  # after 4 (not taken)
    out = verify(logits, [t], SamplingParams(temperature=0.0))
    assert out.tokens == [[2, 5, 1]]
    assert out.path_rows == [[0, 1, 3]]
    logits[0] = -5
    logits[0, 3] = 5  # no draft matches the root's argmax
    out = verify(logits, [t], SamplingParams(temperature=0.0))
    assert out.tokens == [[3]] and out.path_rows == [[0]]


def test_rejection_sampling_gives_the_targets_distribution():
    torch.manual_seed(0)
    n = 20_000
    rows = torch.randn(4, V)
    rows[0, 2] += 1.5  # drafts often but not always accepted
    params = SamplingParams(temperature=0.8, top_k=5)
    logits = rows.repeat(n, 1)
    trees = [tree() for _ in range(n)]
    out = verify(logits, trees, params)
    first = torch.tensor([tokens[0] for tokens in out.tokens])
    p_root = target(rows[0], 0.8, 5)
    assert chi_square_p(torch.bincount(first, minlength=V).double(), p_root) > 1e-3
    # After draft 2 was accepted, the next token is the target's at node 2 (row 1).
    after_two = torch.tensor([tokens[1] for tokens in out.tokens if tokens[0] == 2])
    p_two = target(rows[1], 0.8, 5)
    assert chi_square_p(torch.bincount(after_two, minlength=V).double(), p_two) > 1e-3
    assert 0 < len(after_two) < n
    lengths = torch.bincount(torch.tensor([len(tokens) for tokens in out.tokens]))
    assert lengths[2] > 0 and lengths[3] > 0  # drafts were accepted, one and two deep


def test_rejection_sampling_with_hopeless_drafts_still_gives_the_target():
    """Drafts the target never picks (top-k cuts them) are always rejected; the residual
    draw then carries the whole distribution."""
    torch.manual_seed(1)
    n = 10_000
    row = torch.tensor([3.0, 2.0, -9.0, 1.0, -9.0, 0.5])
    logits = torch.stack([row, row, row, row]).repeat(n, 1)
    params = SamplingParams(temperature=1.0, top_k=4)
    out = verify(logits, [tree() for _ in range(n)], params)
    assert all(len(tokens) == 1 for tokens in out.tokens)
    first = torch.tensor([tokens[0] for tokens in out.tokens])
    assert chi_square_p(torch.bincount(first, minlength=V).double(), target(row, 1.0, 4)) > 1e-3


def test_acceptance_is_that_of_recursive_rejection_sampling():
    """Point-mass drafts 2 and 4 at the root: the first is accepted with probability p(2),
    the second with p(4) / (1 - p(2)) of the rest; together, p(2) + p(4)."""
    torch.manual_seed(3)
    n = 20_000
    rows = torch.randn(4, V)
    out = verify(rows.repeat(n, 1), [tree() for _ in range(n)], SamplingParams(temperature=1.0))
    took_draft = sum(tokens[0] in (2, 4) for tokens in out.tokens) / n
    p = torch.softmax(rows[0], dim=-1)
    expected = float(p[2] + p[4])
    assert abs(took_draft - expected) < 4 * (expected * (1 - expected) / n) ** 0.5


def test_logprobs_come_from_the_rows_that_produced_each_token():
    t = tree()
    logits = torch.randn(4, V, dtype=torch.float64).float()
    logits[0, 2] = logits[1, 5] = 10.0
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs_num=2)
    out = verify(logits, [t], params)
    assert out.tokens[0][:2] == [2, 5]
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for k, (row, token) in enumerate(zip(out.path_rows[0], out.tokens[0])):
        assert out.logprobs[0][k] == float(expected[row, token])
        assert out.top_logprobs[0][k][0][1] == token
