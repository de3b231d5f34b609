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
    another's. `tenant` is set under `--cache-isolation tenant`: an opaque digest of the
    API key's tenant (never its name or key, since it travels in KV events), so tenants
    share nothing and `cached_tokens` reveals nothing across them. `lora` is the LoRA
    adapter's name: K/V computed under one adapter is wrong under any other. Any of them may
    be set together: a tenant's salted prefixes are apart from its unsalted ones.
    """

    cache_salt: str | None = None
    tenant: str | None = None
    lora: str | None = None

    def extra_keys(self) -> tuple[ExtraKey, ...]:
        """The namespace as (kind, value) pairs, in a fixed order, for hashes and events."""
        keys: tuple[ExtraKey, ...] = ()
        if self.tenant is not None:
            keys += (("tenant", self.tenant),)
        if self.cache_salt is not None:
            keys += (("cache_salt", self.cache_salt),)
        if self.lora is not None:
            keys += (("lora", self.lora),)
        return keys

    @classmethod
    def of(
        cls, cache_salt: str | None = None, tenant: str | None = None, lora: str | None = None
    ) -> PrefixNamespace | None:
        """The namespace of these fields, or None when they are all unset."""
        if cache_salt is None and tenant is None and lora is None:
            return None
        return cls(cache_salt=cache_salt, tenant=tenant, lora=lora)
