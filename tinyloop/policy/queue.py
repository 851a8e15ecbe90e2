"""A priority queue with FIFO ties and linear priority aging, free of I/O and clocks.

Effective priority of a queued item at time ``now_ms`` is::

    priority + (now_ms - pushed_ms) / aging_ms        (aging_ms == 0: just ``priority``)

Higher effective priority pops first; equal effective priorities pop in arrival order. Every
queued item ages at the same rate, so the difference between two items' effective priorities
never changes: the order is the same at every ``now_ms``. That lets the queue key each item once,
at push, on its *virtual arrival time* ``pushed_ms - priority * aging_ms`` (each priority level
is a head start of ``aging_ms``) and keep a plain binary heap: push and pop are O(log n). A
low-priority item therefore overtakes every higher-priority item that arrives more than
``(difference in priority) * aging_ms`` after it, so no sustained stream can starve it.

The caller passes the time in; the queue never reads a clock, so tests drive it with numbers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["PriorityQueue", "QueueStatistics"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    """A snapshot of a :class:`PriorityQueue`."""

    depth: int  # items queued now
    oldest_wait_ms: float | None  # wait of the longest-queued item as of ``now_ms``; None when empty
    now_ms: float | None  # the time the snapshot is taken at (the latest time the queue has seen)
    pushed_total: int  # items ever pushed
    popped_total: int  # items ever popped
    removed_total: int  # items removed (cancelled) while queued
    aging_ms: float  # ms per priority level gained while waiting (0 = aging off)


@dataclass(slots=True)
class _Entry(Generic[T]):
    item: T
    priority: int
    pushed_ms: float
    seq: int  # arrival order; breaks ties and keeps items themselves out of comparisons


class PriorityQueue(Generic[T]):
    """Higher priority first, FIFO within a priority, with optional priority aging.

    ``aging_ms`` is how long an item must wait to gain one priority level (0 turns aging off).
    ``remove`` and ``effective_priority`` find items by ``==`` (as ``list.remove`` does); queue
    items whose equality tells two requests apart (a request id, or identity).
    """

    def __init__(self, aging_ms: float = 0.0) -> None:
        if aging_ms < 0:
            raise ValueError("aging_ms must be >= 0")
        self._aging_ms = float(aging_ms)
        self._heap: list[tuple[tuple[float, int], _Entry[T]]] = []
        self._seq = 0
        self._now_ms: float | None = None
        self._popped = 0
        self._removed = 0

    @property
    def aging_ms(self) -> float:
        return self._aging_ms

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T, priority: int, now_ms: float) -> None:
        """Queue ``item`` at ``priority``, arriving at ``now_ms``."""
        self._see(now_ms)
        entry = _Entry(item, priority, float(now_ms), self._seq)
        self._seq += 1
        heapq.heappush(self._heap, (self._key(entry), entry))

    def pop(self, now_ms: float) -> T:
        """Remove and return the item with the highest effective priority; IndexError if empty."""
        self._see(now_ms)
        if not self._heap:
            raise IndexError("pop from an empty PriorityQueue")
        _, entry = heapq.heappop(self._heap)
        self._popped += 1
        return entry.item

    def peek(self, now_ms: float) -> T:
        """The item ``pop(now_ms)`` would return, left in place; IndexError if empty."""
        self._see(now_ms)
        if not self._heap:
            raise IndexError("peek at an empty PriorityQueue")
        return self._heap[0][1].item

    def remove(self, item: T) -> bool:
        """Remove ``item`` if it is queued (the earliest-pushed equal one); return whether it was.

        O(n): a scan, then a re-heapify.
        """
        matches = [i for i, (_, entry) in enumerate(self._heap) if entry.item == item]
        if not matches:
            return False
        index = min(matches, key=lambda i: self._heap[i][1].seq)
        last = self._heap.pop()
        if index < len(self._heap):
            self._heap[index] = last
            heapq.heapify(self._heap)
        self._removed += 1
        return True

    def effective_priority(self, item: T, now_ms: float) -> float:
        """``item``'s effective priority at ``now_ms``; KeyError if it is not queued."""
        for _, entry in self._heap:
            if entry.item == item:
                return self._effective(entry, now_ms)
        raise KeyError(item)

    def statistics(self, now_ms: float | None = None) -> QueueStatistics:
        """A snapshot as of ``now_ms`` (default: the latest time passed to push/pop/peek)."""
        now = self._now_ms if now_ms is None else float(now_ms)
        oldest = min((e.pushed_ms for _, e in self._heap), default=None)
        wait = None if oldest is None or now is None else max(0.0, now - oldest)
        return QueueStatistics(
            depth=len(self._heap),
            oldest_wait_ms=wait,
            now_ms=now,
            pushed_total=self._seq,
            popped_total=self._popped,
            removed_total=self._removed,
            aging_ms=self._aging_ms,
        )

    def __repr__(self) -> str:
        head = "-"
        if self._heap:
            entry = self._heap[0][1]
            head = f"{entry.item!r}@p{entry.priority}"
        s = self.statistics()
        return (f"<PriorityQueue depth={s.depth} aging_ms={s.aging_ms:g} head={head} "
                f"oldest_wait_ms={s.oldest_wait_ms} pushed={s.pushed_total} "
                f"popped={s.popped_total} removed={s.removed_total}>")

    def _key(self, entry: _Entry[T]) -> tuple[float, int]:
        # heapq pops the smallest key: the earliest virtual arrival, then the earliest push.
        if self._aging_ms == 0:
            return (-float(entry.priority), entry.seq)
        return (entry.pushed_ms - entry.priority * self._aging_ms, entry.seq)

    def _effective(self, entry: _Entry[T], now_ms: float) -> float:
        if self._aging_ms == 0:
            return float(entry.priority)
        return entry.priority + (now_ms - entry.pushed_ms) / self._aging_ms

    def _see(self, now_ms: float) -> None:
        now = float(now_ms)
        self._now_ms = now if self._now_ms is None else max(self._now_ms, now)
