"""The prefix pool: registered prompt prefixes whose KV is kept, found by longest match.

A plain LRU map (no I/O) from ``(tokens, loops, cache_window)`` to an opaque handle that holds
the prefilled KV (the engine's). ``find`` returns the longest registered prefix of a prompt at
the same loops and window; adding past ``capacity`` evicts the least recently used entries and
hands their handles back so the owner can free their KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["PrefixPool", "PrefixPoolStatistics"]

H = TypeVar("H")
Key = tuple[tuple[int, ...], int, int]


@dataclass(frozen=True, slots=True)
class PrefixPoolStatistics:
    size: int
    capacity: int
    lookups: int
    matches: int
    matched_tokens: int
    evictions: int


class PrefixPool(Generic[H]):
    """LRU pool of prefilled prefixes keyed by (tokens, loops, cache_window)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._entries: OrderedDict[Key, H] = OrderedDict()
        self._lookups = self._matches = self._matched_tokens = self._evictions = 0

    def size(self) -> int:
        return len(self._entries)

    __len__ = size

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def add(self, tokens: Sequence[int], loops: int, window: int, handle: H) -> list[H]:
        """Register a prefix; returns the handles evicted to make room (and a replaced one)."""
        key = (tuple(tokens), loops, window)
        evicted = []
        if key in self._entries:
            evicted.append(self._entries.pop(key))
        self._entries[key] = handle
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.popitem(last=False)[1])
            self._evictions += 1
        return evicted

    def find(self, prompt: Sequence[int], loops: int, window: int) -> tuple[int, H] | None:
        """The longest entry at ``loops``/``window`` whose tokens prefix ``prompt``, as
        ``(matched_length, handle)``; marks it most recently used."""
        self._lookups += 1
        best = self._longest(prompt, loops, window)
        if best is None:
            return None
        self._entries.move_to_end(best)
        self._matches += 1
        self._matched_tokens += len(best[0])
        return len(best[0]), self._entries[best]

    def peek(self, prompt: Sequence[int], loops: int, window: int) -> int:
        """How many tokens of ``prompt`` the longest entry covers (0: none), as ``find`` would
        match them, but without using the entry (no LRU move, no count): placement asks this
        of every engine's pool."""
        best = self._longest(prompt, loops, window)
        return 0 if best is None else len(best[0])

    def _longest(self, prompt: Sequence[int], loops: int, window: int) -> Key | None:
        prompt = tuple(prompt)
        best: Key | None = None
        for key in self._entries:
            tokens, k_loops, k_window = key
            if (k_loops, k_window) == (loops, window) and len(tokens) <= len(prompt) \
                    and prompt[:len(tokens)] == tokens and (best is None or len(tokens) > len(best[0])):
                best = key
        return best

    def handles(self) -> list[H]:
        """The registered prefixes' handles (least recently used first)."""
        return list(self._entries.values())

    def clear(self) -> list[H]:
        handles = list(self._entries.values())
        self._entries.clear()
        return handles

    def statistics(self) -> PrefixPoolStatistics:
        return PrefixPoolStatistics(len(self._entries), self.capacity, self._lookups, self._matches,
                                    self._matched_tokens, self._evictions)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<PrefixPool {s.size}/{s.capacity} lookups={s.lookups} matches={s.matches}>"
