"""The NGRAM trie: what it drafts after a suffix it has seen, in which order (BFS by
recency, PROB by frequency), within the budget and depth, and what capacity drops."""

from __future__ import annotations

import random

import pytest

from engine.speculative.ngram import NgramConfig, NgramState, NgramTrie


def fed(tokens: list[int], **config: object) -> tuple[NgramTrie, NgramState]:
    trie = NgramTrie(NgramConfig(**config))  # type: ignore[arg-type]
    state = NgramState()
    trie.feed(state, tokens)
    return trie, state


def chain(tree_tokens: list[int], parents: list[int]) -> bool:
    return parents == list(range(-1, len(parents) - 1))


def test_a_repeated_passage_drafts_its_continuation():
    passage = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    trie, state = fed([5, *passage, 6, 7, 11, 12, 13])
    tree = trie.draft(state, 13, budget=5, max_depth=5)
    assert tree.tokens == [13, 14, 15, 16, 17, 18]
    assert chain(tree.tokens, tree.parents)
    assert tree.depths == [0, 1, 2, 3, 4, 5]


def test_the_budget_and_the_depth_bound_the_tree():
    trie, state = fed(list(range(40)) + list(range(10)))
    assert trie.draft(state, 9, budget=3, max_depth=10).tokens == [9, 10, 11, 12]
    tree = trie.draft(state, 9, budget=10, max_depth=2)
    assert max(tree.depths) == 2 and tree.num_drafts == 2


def test_an_unseen_suffix_drafts_nothing():
    trie, state = fed([1, 2, 3, 4, 5])
    assert trie.draft(state, 5, budget=4, max_depth=4).num_drafts == 0


def test_bfs_takes_the_most_recent_continuations_first_as_siblings():
    # After "7": 8 (oldest), then 9, then 10 (newest); the longest match "6 7" saw only 8.
    trie, state = fed([1, 7, 8, 2, 7, 9, 3, 7, 10, 4, 7], max_bfs_breadth=3)
    tree = trie.draft(state, 7, budget=3, max_depth=1)
    assert tree.tokens == [7, 10, 9, 8]
    assert tree.parents == [-1, 0, 0, 0]


def test_prob_takes_the_most_frequent_path_first():
    seq = [1, 2, 3] + [1, 2, 4] * 3 + [1, 2]
    trie, state = fed(seq, match_type="PROB")
    tree = trie.draft(state, 2, budget=2, max_depth=4)
    assert tree.tokens[1] == 4  # seen 3 times after "1 2", against 3 once


def test_the_longest_match_drafts_before_shorter_ones():
    # "a b" was followed by c; "b" alone was followed by d more recently.
    a, b, c, d = 21, 22, 23, 24
    trie, state = fed([a, b, c, 9, b, d, 9, a, b], max_bfs_breadth=1, min_bfs_breadth=1)
    tree = trie.draft(state, b, budget=1, max_depth=1)
    assert tree.tokens == [b, c]


def test_feeding_token_by_token_equals_feeding_at_once():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    whole, whole_state = fed(tokens)
    parts = NgramTrie(NgramConfig())
    state = NgramState()
    for token in tokens:
        parts.feed(state, [token])
    assert state.fed == whole_state.fed == 300
    assert parts.size == whole.size
    assert (
        parts.draft(state, tokens[-1], 7, 7).tokens
        == whole.draft(whole_state, tokens[-1], 7, 7).tokens
    )


def test_capacity_drops_the_least_recent_subtrees_and_keeps_recent_drafts():
    rng = random.Random(1)
    trie = NgramTrie(NgramConfig(capacity=2048, max_trie_depth=8, max_match_window_size=4))
    old = NgramState()
    trie.feed(old, [rng.randrange(1000) for _ in range(2000)])
    assert trie.size <= 2048
    recent = NgramState()
    passage = [1001, 1002, 1003, 1004, 1005, 1006]
    trie.feed(recent, passage + [rng.randrange(1000) for _ in range(100)] + passage[:3])
    assert trie.size <= 2048
    assert trie.draft(recent, 1003, 3, 3).tokens == [1003, 1004, 1005, 1006]
    counted = 0
    stack = [trie.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        counted += 1
    assert counted - 1 == trie.size  # the count is exact: the root is not a node
    # A state holding dropped nodes keeps working: it forgets them and grows back.
    trie.feed(old, [7, 8, 9])
    assert all(node.tick >= 0 for node in old.suffixes)


@pytest.mark.parametrize(
    "config",
    [
        {"match_type": "DFS"},
        {"min_match_window_size": 0},
        {"min_match_window_size": 5, "max_match_window_size": 4},
        {"max_trie_depth": 12, "max_match_window_size": 12},
        {"min_bfs_breadth": 3, "max_bfs_breadth": 2},
        {"capacity": 10},
    ],
)
def test_bad_options_are_refused(config: dict[str, object]):
    with pytest.raises(ValueError, match="speculative_ngram"):
        NgramConfig(**config)  # type: ignore[arg-type]
