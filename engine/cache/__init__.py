"""Prefix caches over KV slots: the RadixAttention tree that shares prefixes across
requests, and the cache that shares nothing (`--disable-radix-cache`)."""
