"""`radixserve radix-demo`: the quickest look at prefix sharing, with no model.

A few token sequences go into a small tree over CPU slots, one match is locked as a running
request would lock it, and the tree is printed with each edge's lock count and hits.
"""

from __future__ import annotations

from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey
from engine.mem.allocator import TokenToKVPoolAllocator


def format_tree(tree: RadixCache) -> str:
    """Each edge's tokens, length, lock count and hits, indented by depth; then the sizes."""
    lines = ["root"]
    stack = [(child, 1) for child in reversed(tree.root_node.children.values())]
    while stack:
        node, depth = stack.pop()
        namespace = f" ns={node.key.extra_key!r}" if node.key.extra_key is not None else ""
        lines.append(
            f"{'  ' * depth}{node.key.tolist()} len={len(node.key)} "
            f"lock_ref={node.lock_ref} hits={node.hit_count}{namespace}"
        )
        stack.extend((child, depth + 1) for child in reversed(node.children.values()))
    lines.append(
        f"#tokens: {len(tree.cached_slots())}, evictable: {tree.evictable_size()}, "
        f"protected: {tree.protected_size()}"
    )
    return "\n".join(lines)


def demo() -> None:
    allocator = TokenToKVPoolAllocator(64)
    tree = RadixCache(allocator)
    for tokens in ([1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
        slots = allocator.alloc(len(tokens))
        assert slots is not None, "64 slots hold every sequence"
        allocator.free(slots[: tree.insert(RadixKey(tokens), slots).prefix_len])
    match = tree.match_prefix(RadixKey([1, 2, 4, 5, 6, 99]))
    tree.inc_lock_ref(match.last_node)
    print(
        f"match [1, 2, 4, 5, 6, 99] -> slots {match.device_indices.tolist()} "
        "(the edge [6, 7] was split)"
    )
    print(format_tree(tree))
    tree.check_integrity()
