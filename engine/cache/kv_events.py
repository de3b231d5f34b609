"""The radix tree as KV-cache events: what a precise prefix-aware router needs to know.

Routers such as llm-d's precise prefix scorer and Dynamo keep, per replica, the set of KV
blocks it holds, fed by vLLM's KV-cache events. radixserve's tree is token-granular, so it
publishes *virtual blocks*: every root→node path is cut into fixed runs of `block_size`
tokens from the root, and a block exists while all of its tokens are in the tree.

- A block is **stored** once its last token is inserted. A node owns the blocks whose last
  token lies on its edge, so an insert stores exactly the blocks ending on its new leaf.
- A block is **removed** as soon as eviction takes any of its tokens. Eviction takes whole
  leaves, and a leaf's tokens are the last ones of exactly the blocks it owns.
- A split moves no token, so it publishes nothing; the two halves divide the blocks.
- A reset (start-up, `/flush_cache`) publishes `AllBlocksCleared`.

The wire layout is vLLM's (`array_like=True, tag=True`). Hashes are
`block_hash(parent, token_ids, extra_keys)`: the first 8 bytes, big-endian, of SHA-256
over the msgpack array `[parent or None, token_ids, extra_keys]`, where extra_keys are the
prefix namespace's (kind, value) pairs. Equal prefixes in one namespace hash alike on
every replica and across restarts, and a router can recompute them from a prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from engine.cache.namespace import ExtraKey, PrefixNamespace

if TYPE_CHECKING:
    from engine.cache.tree_node import TreeNode

DEFAULT_BLOCK_SIZE = 16
MEDIUM_GPU = "GPU"
"""vLLM's name for the medium of device KV, whatever the device."""


class BlockStored(msgspec.Struct, array_like=True, tag=True, gc=False):
    """A chain of consecutive full blocks entered the cache, after `parent_block_hash`."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    """The blocks' tokens, `block_size` per block, in order."""
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[ExtraKey, ...] | None] | None
    """One entry per block: its namespace's (kind, value) pairs, None in the default one."""


class BlockRemoved(msgspec.Struct, array_like=True, tag=True, gc=False):
    """These blocks left the cache."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True, gc=False):
    """The cache is empty: forget every block of this replica."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: the events of one scheduler turn."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = 0


def block_hash(parent: int | None, token_ids: Sequence[int], extra_keys: Sequence[Any]) -> int:
    """The uint64 hash of one block (see the module docstring for the definition)."""
    encoded = msgspec.msgpack.encode([parent, list(token_ids), list(extra_keys)])
    return int.from_bytes(hashlib.sha256(encoded).digest()[:8], "big")


def block_hashes(
    token_ids: Sequence[int],
    namespace: PrefixNamespace | None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent: int | None = None,
) -> list[int]:
    """The hash chain of the full blocks of `token_ids`, as a router computes it for a
    prompt; `parent` continues a chain whose earlier blocks are already hashed."""
    extra = namespace.extra_keys() if namespace is not None else ()
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


class _NodeBlocks:
    """A node's depth (tokens from the root to the end of its edge) and the hashes of the
    blocks whose last token lies on its edge."""

    __slots__ = ("end", "hashes")

    def __init__(self, end: int, hashes: list[int]):
        self.end = end
        self.hashes = hashes


class BlockEventRecorder:
    """Follows the radix tree's surgery and records the virtual blocks' lifecycle.

    The tree calls the `on_*` hooks; the owner of the publisher takes the events once a
    scheduler turn with `take()`.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"kv_events_block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._nodes: dict[TreeNode, _NodeBlocks] = {}
        """Every node below the root; the root ends at depth 0 and owns no block."""
        self._pending: list[KVCacheEvent] = []

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._pending = self._pending, []
        return events

    def on_reset(self) -> None:
        """The cache is empty: start-up, or `/flush_cache`."""
        self._nodes = {}
        self._pending.append(AllBlocksCleared())

    def on_add_leaf(self, leaf: TreeNode, path: memoryview) -> None:
        """`leaf` was hung under its parent; `path` is every token from the root to its end."""
        parent = leaf.parent
        assert parent is not None
        start = self._nodes[parent].end if parent.parent is not None else 0
        end = start + len(leaf.key)
        size = self.block_size
        first, last = start // size, end // size
        if first == last:
            self._nodes[leaf] = _NodeBlocks(end, [])
            return
        parent_hash = self._last_hash_above(parent) if first > 0 else None
        namespace = leaf.key.extra_key
        tokens = path[first * size : last * size].tolist()
        hashes = block_hashes(tokens, namespace, size, parent_hash)
        self._nodes[leaf] = _NodeBlocks(end, hashes)
        extra = namespace.extra_keys() if namespace is not None else ()
        self._pending.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent_hash,
                token_ids=tokens,
                block_size=size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=namespace.lora if namespace is not None else None,
                extra_keys=[extra] * len(hashes) if extra else None,
            )
        )

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """`lower`'s edge was cut: `upper` took its first tokens and the blocks ending there."""
        blocks = self._nodes[lower]
        upper_end = blocks.end - len(lower.key)
        upper_start = upper_end - len(upper.key)
        taken = upper_end // self.block_size - upper_start // self.block_size
        self._nodes[upper] = _NodeBlocks(upper_end, blocks.hashes[:taken])
        blocks.hashes = blocks.hashes[taken:]

    def on_delete_leaf(self, leaf: TreeNode) -> None:
        blocks = self._nodes.pop(leaf)
        if blocks.hashes:
            self._pending.append(BlockRemoved(block_hashes=blocks.hashes, medium=MEDIUM_GPU))

    def _last_hash_above(self, node: TreeNode) -> int:
        """The hash of the last block ending at or above `node`'s end: the chain's parent."""
        while node.parent is not None:  # the root owns no block
            hashes = self._nodes[node].hashes
            if hashes:
                return hashes[-1]
            node = node.parent
        raise AssertionError("a block past the first has no parent block above it")
