"""Which drafted tokens the target model accepts, from the token it samples at every tree
node.

The sampler runs once over every row of a verify batch, exactly as it runs over a decode
batch: biases and masks, temperature, top-k / top-p / min-p, one draw per row (a seeded
request's row at depth d draws with the uniform of output index n + d, the index that
row's token takes if it is accepted). Each request then walks its tree from the root: it
takes the token sampled at the current node, moves to the child drafted with that token if
there is one, and stops where there is none. Every token it takes was sampled from the
target's own distribution at its own position, so the output is distributed exactly as
without speculation, and under greedy, or with a seed, it is the same tokens, given the
same logits.

This is SpecInfer's recursive rejection sampling for drafts that are point masses (an
n-gram proposes tokens, not distributions), with one uniform per node: trying the children
in turn, child c is accepted with probability p(c) / p(not yet rejected), and a token
outside them is drawn from the residual; the inverse-CDF draw at the node lands on c with
probability p(c), and outside every child with the residual's mass, the same outcome
distribution. Its acceptance rate is therefore the same too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.sampling.sampler import SamplerOutput
from engine.speculative.draft_tree import DraftTree


class VerifyOutput(NamedTuple):
    """Per request of the batch: its new tokens, and the tree rows (global rows of the
    batch) on the accepted path — row i's draw gave token i, and row i's K/V is kept at
    the position after the request's last one plus i."""

    tokens: list[list[int]]
    path_rows: list[list[int]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[list[tuple[float, int]]]] | None


def walk_trees(trees: Sequence[DraftTree], sampled: SamplerOutput) -> VerifyOutput:
    """`sampled` has one row per tree node, the trees' rows in order."""
    ids = sampled.next_token_ids.tolist()
    tokens, path_rows = [], []
    start = 0
    for tree in trees:
        node = start
        taken, path = [], []
        while True:
            token = ids[node]
            taken.append(token)
            path.append(node)
            child = tree.children[node - start].get(token)
            if child is None:
                break
            node = start + child
        tokens.append(taken)
        path_rows.append(path)
        start += len(tree)
    if sampled.next_token_logprobs is None:
        return VerifyOutput(tokens, path_rows, None, None)
    logprobs = sampled.next_token_logprobs.tolist()
    chosen = [[logprobs[r] for r in path] for path in path_rows]
    values, indices = sampled.next_token_top_logprobs_val, sampled.next_token_top_logprobs_idx
    if values is None or indices is None:
        return VerifyOutput(tokens, path_rows, chosen, None)
    pairs = [list(zip(v, i)) for v, i in zip(values.tolist(), indices.tolist())]
    return VerifyOutput(tokens, path_rows, chosen, [[pairs[r] for r in path] for path in path_rows])
