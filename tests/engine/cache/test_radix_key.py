import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey, common_prefix_len

TENANT_A = PrefixNamespace("tenant-a")


def naive_common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@given(
    st.lists(st.integers(0, 2), max_size=80),
    st.lists(st.integers(0, 2), max_size=80),
    st.integers(0, 80),
)
def test_galloping_match_equals_the_per_token_loop(a, b, shared):
    a = b[:shared] + a
    assert RadixKey(a).match(RadixKey(b)) == naive_common_prefix(a, b)


def test_ten_thousand_shared_tokens_cost_27_slice_comparisons():
    shared = list(range(10_000))
    a = RadixKey(shared + [1] * 10_000)
    b = RadixKey(shared + [2] * 10_000)
    result = common_prefix_len(a.token_ids, b.token_ids)
    assert result.length == 10_000
    assert result.comparisons == 27  # 14 galloping windows + 13 bisection steps


def test_keys_in_different_namespaces_never_match():
    assert (
        RadixKey([1, 2, 3], TENANT_A).match(RadixKey([1, 2, 3], PrefixNamespace("tenant-b"))) == 0
    )
    assert RadixKey([1, 2, 3], TENANT_A).match(RadixKey([1, 2, 3])) == 0
    assert RadixKey([1, 2, 3], TENANT_A).match(RadixKey([1, 2, 9], TENANT_A)) == 2


def test_slicing_is_zero_copy_and_keeps_the_namespace():
    key = RadixKey([5, 6, 7, 8], TENANT_A)
    tail = key[1:]
    assert tail.tolist() == [6, 7, 8] and tail.extra_key == TENANT_A
    assert tail.token_ids.obj is key.token_ids.obj
    assert key[2] == 7
    assert tail.child_key() == (TENANT_A, 6)


def test_keys_accept_tensors_and_reject_foreign_memoryviews():
    import array

    import torch

    assert RadixKey(torch.tensor([3, 4])).tolist() == [3, 4]
    with pytest.raises(TypeError, match="format"):
        RadixKey(memoryview(array.array("i", [1, 2])))
