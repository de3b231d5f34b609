"""A request's draft for one verify step: a token tree rooted at its last sampled token.

Node 0 is the root, the token the step would decode anyway; every other node is a drafted
continuation of its parent, added after it. The verify pass gives every node one row: the
target model's logits after the node's path from the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    """`parents[i]` is node i's parent (-1 for the root)."""
    depths: list[int] = field(default_factory=list)
    children: list[dict[int, int]] = field(default_factory=list)
    """Per node, child token → child node."""

    def __post_init__(self) -> None:
        if not self.depths:
            self.depths = [0]
            self.children = [{}]
            for i in range(1, len(self.tokens)):
                self._link(i)

    @classmethod
    def root(cls, token: int) -> DraftTree:
        return cls([token], [-1])

    def add(self, parent: int, token: int) -> int:
        """Node `token` under `parent` (the existing one if there is one); its index."""
        existing = self.children[parent].get(token)
        if existing is not None:
            return existing
        self.tokens.append(token)
        self.parents.append(parent)
        self._link(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def _link(self, i: int) -> None:
        parent = self.parents[i]
        assert 0 <= parent < i, "a parent precedes its children"
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.children[parent][self.tokens[i]] = i

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`, both included."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]
