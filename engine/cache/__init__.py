"""RadixAttention: a radix tree over KV slots that shares prefixes across requests."""
