from __future__ import annotations

import pytest

from tinyloop.policy import PriorityQueue, QueueStatistics


def drain(q: PriorityQueue[str], now_ms: float) -> list[str]:
    return [q.pop(now_ms) for _ in range(len(q))]


def test_higher_priority_first_and_fifo_within_a_priority() -> None:
    q: PriorityQueue[str] = PriorityQueue()
    for i, (name, prio) in enumerate([("a", 1), ("b", 5), ("c", 1), ("d", 5), ("e", 3)]):
        q.push(name, prio, now_ms=float(i))
    assert drain(q, 10.0) == ["b", "d", "e", "a", "c"]


def test_pop_and_peek_on_empty_raise_index_error() -> None:
    q: PriorityQueue[str] = PriorityQueue()
    with pytest.raises(IndexError):
        q.pop(0.0)
    with pytest.raises(IndexError):
        q.peek(0.0)


def test_peek_leaves_the_item() -> None:
    q: PriorityQueue[str] = PriorityQueue()
    q.push("x", 0, 0.0)
    assert q.peek(1.0) == "x"
    assert len(q) == 1
    assert q.pop(1.0) == "x"
    assert len(q) == 0


def test_aging_raises_effective_priority_linearly() -> None:
    q: PriorityQueue[str] = PriorityQueue(aging_ms=100.0)
    q.push("low", 1, 0.0)
    assert q.effective_priority("low", 0.0) == 1.0
    assert q.effective_priority("low", 250.0) == 3.5
    with pytest.raises(KeyError):
        q.effective_priority("missing", 0.0)


def test_an_aged_item_overtakes_a_newer_higher_priority_one() -> None:
    q: PriorityQueue[str] = PriorityQueue(aging_ms=100.0)
    q.push("old-low", 0, 0.0)
    q.push("new-high", 2, 250.0)  # effective 2.0 against 2.5 at t=250
    assert q.pop(250.0) == "old-low"


def test_equal_effective_priority_breaks_by_arrival() -> None:
    q: PriorityQueue[str] = PriorityQueue(aging_ms=100.0)
    q.push("first", 1, 0.0)
    q.push("second", 2, 100.0)  # both effective 2.0 at t=100, and equal forever after
    assert q.effective_priority("first", 500.0) == q.effective_priority("second", 500.0)
    assert q.pop(500.0) == "first"


def stream_until_low_pops(aging_ms: float, steps: int) -> int | None:
    """Push a low item at t=0, then each 10 ms push a high one and pop one; the low's step."""
    q: PriorityQueue[str] = PriorityQueue(aging_ms=aging_ms)
    q.push("low", 0, 0.0)
    for step in range(1, steps + 1):
        now = step * 10.0
        q.push(f"high-{step}", 5, now)
        if q.pop(now) == "low":
            return step
    return None


def test_aging_lets_low_priority_through_a_sustained_high_priority_stream() -> None:
    # The low item's lead is 5 levels * 100 ms = 500 ms = 50 steps; at step 50 the two tie and
    # the earlier arrival wins.
    assert stream_until_low_pops(aging_ms=100.0, steps=1000) == 50


def test_without_aging_the_low_priority_item_starves() -> None:
    assert stream_until_low_pops(aging_ms=0.0, steps=1000) is None


def test_remove_cancels_a_queued_item() -> None:
    q: PriorityQueue[list[int]] = PriorityQueue()
    a, b, c = [1], [1], [2]  # a == b: remove takes the earliest-pushed equal item
    for i, item in enumerate((a, b, c)):
        q.push(item, 0, float(i))
    assert q.remove([1]) is True
    assert len(q) == 2
    assert q.remove([3]) is False
    assert q.pop(5.0) is b
    assert q.pop(5.0) is c


def test_remove_keeps_heap_order() -> None:
    q: PriorityQueue[str] = PriorityQueue()
    for i, prio in enumerate([3, 9, 1, 7, 5, 8, 2]):
        q.push(f"p{prio}", prio, float(i))
    assert q.remove("p9") and q.remove("p2")
    assert drain(q, 10.0) == ["p8", "p7", "p5", "p3", "p1"]


def test_statistics_and_repr() -> None:
    q: PriorityQueue[str] = PriorityQueue(aging_ms=1000.0)
    assert q.statistics() == QueueStatistics(0, None, None, 0, 0, 0, 1000.0)
    q.push("a", 0, 10.0)
    q.push("b", 1, 30.0)
    q.push("c", 0, 40.0)
    q.remove("c")
    assert q.pop(50.0) == "b"
    stats = q.statistics()
    assert stats == QueueStatistics(depth=1, oldest_wait_ms=40.0, now_ms=50.0, pushed_total=3,
                                    popped_total=1, removed_total=1, aging_ms=1000.0)
    assert q.statistics(now_ms=110.0).oldest_wait_ms == 100.0
    assert repr(q) == ("<PriorityQueue depth=1 aging_ms=1000 head='a'@p0 oldest_wait_ms=40.0 "
                       "pushed=3 popped=1 removed=1>")


def test_negative_aging_is_refused() -> None:
    with pytest.raises(ValueError):
        PriorityQueue(aging_ms=-1.0)
