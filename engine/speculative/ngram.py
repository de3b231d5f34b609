"""SGLang's NGRAM drafter: a token trie over every request's prompt and output, matched
against each request's suffix to propose the tokens that followed that suffix before.

The trie holds every n-gram of length up to `max_trie_depth` seen so far, with how often
(`count`) and how lately (`tick`) it was seen. A request keeps its match state: the trie
nodes of its suffixes of length 1, 2, … ending at its last token (`NgramState`). Feeding
it one more token extends each of those suffixes by that token — inserting the n-grams that
end there and, in the same step, finding the nodes of the new suffixes — so insertion and
matching cost O(max_trie_depth) per token, whatever the length of the request or the
size of the trie. A draft then starts at the longest matched suffix (within the match
window) whose node has children: its subtree is what followed that suffix, expanded
breadth-first by recency (`BFS`) or best-first by frequency (`PROB`).

Capacity bounds the node count: past it, the least recently extended subtrees are dropped
until a quarter of the capacity is free again, one pass over the trie each time, so the
cost per inserted node stays constant. A request's state may hold a dropped node; it is
recognised (`tick` -1): that suffix and the longer ones are forgotten, and grow back from
the shorter ones as tokens come.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.speculative.draft_tree import DraftTree

MATCH_TYPES = ("BFS", "PROB")


class TrieNode:
    __slots__ = ("children", "count", "tick")

    def __init__(self) -> None:
        self.children: dict[int, TrieNode] = {}
        self.count = 0
        self.tick = 0
        """When an n-gram ending here was last inserted; -1 once the node is dropped."""


@dataclass
class NgramState:
    """One request's place in the trie."""

    suffixes: list[TrieNode] = field(default_factory=list)
    """The nodes of its suffixes of length 1, 2, … ending at its last fed token."""
    fed: int = 0
    """How many of its tokens the trie has seen."""


@dataclass(frozen=True)
class NgramConfig:
    """SGLang's `--speculative-ngram-*` options (`EngineArgs` documents each)."""

    max_trie_depth: int = 18
    capacity: int = 1_000_000
    min_match_window_size: int = 1
    max_match_window_size: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"

    def __post_init__(self) -> None:
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"speculative_ngram_match_type must be one of {MATCH_TYPES}")
        if not 1 <= self.min_match_window_size <= self.max_match_window_size:
            raise ValueError(
                "speculative_ngram_min_match_window_size must be >= 1 and at most "
                "speculative_ngram_max_match_window_size"
            )
        if self.max_trie_depth <= self.max_match_window_size:
            raise ValueError(
                "speculative_ngram_max_trie_depth must exceed "
                "speculative_ngram_max_match_window_size: a match needs room for drafts below it"
            )
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError(
                "speculative_ngram_min_bfs_breadth must be >= 1 and at most "
                "speculative_ngram_max_bfs_breadth"
            )
        if self.capacity < 1024:
            raise ValueError("speculative_ngram_capacity must be at least 1024 nodes")


class NgramTrie:
    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.root = TrieNode()
        self.size = 0
        self.tick = 0

    def feed(self, state: NgramState, tokens: Iterable[int]) -> None:
        """Insert the n-grams ending at each of `tokens`, which follow the request's fed
        tokens, and move its state past them."""
        root, max_depth = self.root, self.config.max_trie_depth
        suffixes = state.suffixes
        for token in tokens:
            self.tick += 1
            extended = []
            for node in (root, *suffixes[: max_depth - 1]):
                if node.tick < 0:  # dropped: the longer suffixes grow back from the shorter ones
                    break
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = TrieNode()
                    self.size += 1
                child.count += 1
                child.tick = self.tick
                extended.append(child)
            suffixes = extended
            state.fed += 1
        state.suffixes = suffixes
        if self.size > self.config.capacity:
            self._prune(self.config.capacity * 3 // 4)

    def draft(self, state: NgramState, root_token: int, budget: int, max_depth: int) -> DraftTree:
        """Up to `budget` drafted tokens after the request's last fed token (`root_token`,
        the tree's root), none deeper than `max_depth`: from the longest matched suffix
        down to the shortest in the match window, each match's continuations added until
        the budget is spent."""
        tree = DraftTree.root(root_token)
        config = self.config
        longest = min(len(state.suffixes), config.max_match_window_size)
        for length in range(longest, config.min_match_window_size - 1, -1):
            if tree.num_drafts >= budget:
                break
            node = state.suffixes[length - 1]
            if node.tick < 0 or not node.children:
                continue
            depth = min(max_depth, config.max_trie_depth - length)
            if config.match_type == "BFS":
                self._expand_bfs(tree, node, budget, depth, self._breadth(length))
            else:
                self._expand_prob(tree, node, budget, depth)
        return tree

    def _breadth(self, match_length: int) -> int:
        """Children taken per node: the widest for the shortest match, the narrowest for
        the longest (a long match says more about what comes next)."""
        c = self.config
        span = max(1, c.max_match_window_size - c.min_match_window_size)
        frac = (match_length - c.min_match_window_size) / span
        return round(c.max_bfs_breadth - (c.max_bfs_breadth - c.min_bfs_breadth) * frac)

    @staticmethod
    def _expand_bfs(
        tree: DraftTree, start: TrieNode, budget: int, max_depth: int, breadth: int
    ) -> None:
        level = [(start, 0)]  # (trie node, its draft tree node)
        for _ in range(max_depth):
            following = []
            for node, at in level:
                newest = sorted(node.children.items(), key=lambda kv: kv[1].tick, reverse=True)
                for token, child in newest[:breadth]:
                    if child.tick < 0:
                        continue
                    if tree.num_drafts >= budget:
                        return
                    following.append((child, tree.add(at, token)))
            if not following:
                return
            level = following

    @staticmethod
    def _expand_prob(tree: DraftTree, start: TrieNode, budget: int, max_depth: int) -> None:
        """Best-first by the path's frequency-estimated probability."""
        heap: list[tuple[float, int, TrieNode, int, int]] = []
        order = 0

        def push(node: TrieNode, at: int, prob: float, depth: int) -> None:
            nonlocal order
            if depth >= max_depth:
                return
            total = sum(c.count for c in node.children.values() if c.tick >= 0)
            for token, child in node.children.items():
                if child.tick >= 0:
                    order += 1
                    heapq.heappush(heap, (-prob * child.count / total, order, child, at, token))

        push(start, 0, 1.0, 0)
        while heap and tree.num_drafts < budget:
            neg_prob, _, node, at, token = heapq.heappop(heap)
            added = tree.add(at, token)
            push(node, added, -neg_prob, tree.depths[added])

    def _prune(self, target: int) -> None:
        """Drop the least recently extended subtrees until at most `target` nodes remain."""
        recency: list[tuple[int, TrieNode, TrieNode, int]] = []  # (latest tick below, …)
        stack: list[tuple[TrieNode, bool]] = [(self.root, False)]
        latest: dict[int, int] = {}
        while stack:  # post-order: a node's latest tick is its subtree's
            node, done = stack.pop()
            if not done:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
                continue
            newest = max((latest[id(c)] for c in node.children.values()), default=node.tick)
            latest[id(node)] = max(newest, node.tick)
            for token, child in node.children.items():
                recency.append((latest[id(child)], child, node, token))
        recency.sort(key=lambda item: item[0])
        removed = 0
        excess = self.size - target
        for _, child, parent, token in recency:
            if removed >= excess:
                break
            if child.tick < 0 or parent.children.get(token) is not child:
                continue  # inside a subtree already dropped
            del parent.children[token]
            removed += self._drop(child)
        self.size -= removed

    @staticmethod
    def _drop(node: TrieNode) -> int:
        """Mark `node`'s subtree dropped; how many nodes it held."""
        count, stack = 0, [node]
        while stack:
            current = stack.pop()
            current.tick = -1
            count += 1
            stack.extend(current.children.values())
        return count
