"""The namespace of a prefix: every reason two equal token sequences must not share KV.

The radix tree keeps namespaces apart (a key matches only keys of its own namespace), the
KV events publish a namespace's `extra_keys` with each block and fold them into its hash,
so a router sees the same separation the tree makes.
"""

from __future__ import annotations

from dataclasses import dataclass

ExtraKey = tuple[str, str]
"""One (kind, value) pair, e.g. ("cache_salt", "tenant-a")."""


@dataclass(frozen=True, slots=True)
class PrefixNamespace:
    """A prefix's namespace. `None` stands for the default, shared one.

    `cache_salt` is the OpenAI-style field that isolates one client's prefixes from
    another's; later reasons (a LoRA adapter, a tenant) become fields here.
    """

    cache_salt: str | None = None

    def extra_keys(self) -> tuple[ExtraKey, ...]:
        """The namespace as (kind, value) pairs, in a fixed order, for hashes and events."""
        return () if self.cache_salt is None else (("cache_salt", self.cache_salt),)

    @classmethod
    def of(cls, cache_salt: str | None = None) -> PrefixNamespace | None:
        """The namespace of these fields, or None when they are all unset."""
        return None if cache_salt is None else cls(cache_salt=cache_salt)
