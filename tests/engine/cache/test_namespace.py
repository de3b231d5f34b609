"""The prefix namespace: tenants and cache salts keep prefixes apart in the tree and in
the KV events' block hashes."""

from engine.cache.kv_events import block_hashes
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey

TOKENS = list(range(32))


def test_all_unset_is_the_shared_namespace():
    assert PrefixNamespace.of() is None
    assert PrefixNamespace.of(tenant="t1") == PrefixNamespace(tenant="t1")


def test_extra_keys_name_the_tenant_then_the_salt():
    both = PrefixNamespace(cache_salt="s", tenant="t1")
    assert both.extra_keys() == (("tenant", "t1"), ("cache_salt", "s"))
    assert PrefixNamespace(cache_salt="s").extra_keys() == (("cache_salt", "s"),)


def test_tenants_share_no_prefix_salted_or_not():
    keys = [
        RadixKey(TOKENS, PrefixNamespace.of(cache_salt=salt, tenant=tenant))
        for tenant in ("t1", "t2", None)
        for salt in ("s", None)
    ]
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert a.match(b) == 0
    assert keys[0].match(RadixKey(TOKENS, PrefixNamespace(cache_salt="s", tenant="t1"))) == 32


def test_block_hashes_differ_by_tenant():
    t1 = block_hashes(TOKENS, PrefixNamespace(tenant="t1"), 16)
    t2 = block_hashes(TOKENS, PrefixNamespace(tenant="t2"), 16)
    shared = block_hashes(TOKENS, None, 16)
    assert len(t1) == 2 and not set(t1) & set(t2) and not set(t1) & set(shared)
