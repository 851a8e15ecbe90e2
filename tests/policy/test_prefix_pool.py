"""The prefix pool policy: longest match at the same loops and window, LRU eviction."""

from __future__ import annotations

from tinyloop.policy.prefix_pool import PrefixPool


def test_find_returns_the_longest_matching_prefix_at_the_same_loops_and_window() -> None:
    pool: PrefixPool[str] = PrefixPool(capacity=4)
    pool.add([1, 2], 4, 4, "short")
    pool.add([1, 2, 3, 4], 4, 4, "long")
    pool.add([1, 2, 3, 4, 5], 8, 8, "other-loops")
    assert pool.find([1, 2, 3, 4, 9], 4, 4) == (4, "long")
    assert pool.find([1, 2, 9], 4, 4) == (2, "short")
    assert pool.find([1, 2, 3, 4, 5, 6], 4, 2) is None  # window differs
    assert pool.find([7], 4, 4) is None
    s = pool.statistics()
    assert (s.lookups, s.matches, s.matched_tokens) == (4, 2, 6)


def test_adding_past_capacity_evicts_the_least_recently_used() -> None:
    pool: PrefixPool[str] = PrefixPool(capacity=2)
    assert pool.add([1], 4, 4, "a") == []
    assert pool.add([2], 4, 4, "b") == []
    assert pool.find([1, 5], 4, 4) == (1, "a")  # "a" is now the most recently used
    assert pool.add([3], 4, 4, "c") == ["b"]
    assert pool.size() == 2 and pool.find([2, 5], 4, 4) is None
    assert pool.add([3], 4, 4, "c2") == ["c"]  # re-registering replaces (and hands back) the old entry
    assert pool.statistics().evictions == 1
    assert sorted(pool.clear()) == ["a", "c2"] and pool.size() == 0
