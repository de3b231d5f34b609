import pytest
import torch

from engine.cache.radix_key import RadixKey
from engine.sampling.sampling_params import SamplingParams
from engine.sched.cache_manager import CacheManager
from engine.sched.policy import SCHEDULE_POLICIES, SchedulePolicy
from engine.sched.req import Admission, Req
from testing.radix import insert_fresh, simulated_cache


def cache_with(*sequences: list[int]) -> CacheManager:
    cache = simulated_cache(num_slots=4096)
    for tokens in sequences:
        insert_fresh(cache, tokens)
    return cache


def rids(queue: list[Req]) -> list[str]:
    return [r.rid for r in queue]


SYSTEM = list(range(1000, 1100))  # a cached 100-token system prompt


def test_fcfs_keeps_arrival_order():
    queue = [Req(str(i), [i, i + 1]) for i in range(5)]
    SchedulePolicy("fcfs", cache_with()).calc_priority(queue)
    assert rids(queue) == ["0", "1", "2", "3", "4"]


def test_lpm_puts_the_longest_radix_hit_first():
    cache = cache_with(SYSTEM)
    queue = [Req("miss", [1, 2, 3]), Req("half", SYSTEM[:50] + [7]), Req("full", SYSTEM + [8])]
    SchedulePolicy("lpm", cache).calc_priority(queue)
    assert rids(queue) == ["full", "half", "miss"]


def test_lpm_falls_back_to_fcfs_above_128_waiting():
    cache = cache_with(SYSTEM)
    policy = SchedulePolicy("lpm", cache)
    queue = [Req(f"m{i}", [i]) for i in range(128)] + [Req("hit", SYSTEM + [1])]
    assert policy.active_policy(queue) == "fcfs"
    policy.calc_priority(queue)
    assert queue[-1].rid == "hit"
    del queue[0]  # 128 waiting: lpm again
    policy.calc_priority(queue)
    assert queue[0].rid == "hit"


def test_lpm_defers_queue_mates_sharing_a_prefix_so_one_representative_prefills_it():
    shared = list(range(5000, 5200))
    queue = [Req(f"q{i}", shared + [i]) for i in range(8)] + [Req("other", [1, 2, 3])]
    deferred = SchedulePolicy("lpm", cache_with()).calc_priority(queue)
    assert deferred == {f"q{i}" for i in range(1, 8)}
    assert rids(queue)[:2] == ["q0", "other"]


def test_lpm_defers_requests_whose_prefix_is_being_prefilled_in_flight():
    shared = list(range(5000, 5200))
    in_flight = [Req("running-representative", shared + [99])]
    queue = [Req("late", shared + [1]), Req("short-share", shared[:10] + [2])]
    deferred = SchedulePolicy("lpm", cache_with()).calc_priority(queue, in_flight_prefill=in_flight)
    assert deferred == {"late"}
    assert rids(queue) == ["short-share", "late"]


def test_requests_with_a_long_tree_hit_are_never_deferred():
    shared = list(range(5000, 5200))
    queue = [Req("a", shared + [1]), Req("b", shared + [2])]
    assert SchedulePolicy("lpm", cache_with(shared)).calc_priority(queue) == set()


def test_dfs_weight_runs_the_heaviest_subtree_first_and_keeps_subtrees_together():
    a, b = list(range(100, 140)), list(range(200, 240))
    cache = cache_with(a, b)
    queue = [
        Req("b1", b + [1]),
        Req("a1", a + [1]),
        Req("a2", a + [2]),
        Req("b2", b + [2]),
        Req("a3", a + [3]),
    ]
    SchedulePolicy("dfs-weight", cache).calc_priority(queue)
    assert rids(queue) == ["a1", "a2", "a3", "b1", "b2"]


def test_lof_puts_the_longest_output_first():
    queue = [Req(str(n), [1], SamplingParams(max_new_tokens=n)) for n in (16, 256, 64)]
    SchedulePolicy("lof", cache_with()).calc_priority(queue)
    assert rids(queue) == ["256", "64", "16"]


def test_priority_orders_by_value_then_arrival():
    queue = [
        Req("low", [1], admission=Admission(priority=0)),
        Req("high", [1], admission=Admission(priority=5)),
        Req("high-later", [1], admission=Admission(priority=5)),
    ]
    SchedulePolicy("priority", cache_with()).calc_priority(queue)
    assert rids(queue) == ["high", "high-later", "low"]


def test_routing_key_prefers_keys_common_in_the_running_batch():
    running = [
        Req("r1", [1], admission=Admission(routing_key="blue")),
        Req("r2", [1], admission=Admission(routing_key="blue")),
        Req("r3", [1], admission=Admission(routing_key="red")),
    ]
    queue = [
        Req("none", [1]),
        Req("red", [1], admission=Admission(routing_key="red")),
        Req("blue", [1], admission=Admission(routing_key="blue")),
    ]
    SchedulePolicy("routing-key", cache_with()).calc_priority(queue, running_reqs=running)
    assert rids(queue) == ["blue", "red", "none"]


def test_random_is_a_seeded_permutation():
    queue = [Req(str(i), [i]) for i in range(20)]
    SchedulePolicy("random", cache_with(), seed=1).calc_priority(queue)
    assert sorted(rids(queue), key=int) == [str(i) for i in range(20)] and rids(queue) != sorted(
        rids(queue), key=int
    )


def test_unknown_policy_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="fcfs, lpm"):
        SchedulePolicy("sjf", cache_with())
    assert set(SCHEDULE_POLICIES) == {
        "fcfs",
        "lpm",
        "dfs-weight",
        "lof",
        "random",
        "priority",
        "routing-key",
    }


def test_cache_aware_policies_fall_back_to_fcfs_without_a_radix_cache():
    cache = simulated_cache(disable_radix_cache=True)
    for policy in ("lpm", "dfs-weight"):
        assert SchedulePolicy(policy, cache).active_policy([Req("a", [1])]) == "fcfs"
    assert torch.equal(
        cache.tree_cache.match_prefix(RadixKey([1])).device_indices,
        torch.empty(0, dtype=torch.int64),
    )
