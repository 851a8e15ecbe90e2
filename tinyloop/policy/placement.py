"""Which engine a request runs on, when one runtime drives several: no I/O, no clock.

The dispatcher asks a :class:`Placement` for every request it dispatches, with each usable
engine's :class:`Room` (free slots, free KV blocks). The rule:

1. **Prefix affinity.** The placement remembers which engines the recent prompts went to, as a
   chain of block keys per prompt (the same block size as the KV pool, salted with what a
   block's KV depends on besides its tokens: the loops and the KV window). A request goes to
   the engine holding the longest run of its leading blocks, when that engine has room and
   holds at most ``slack`` more requests than the least loaded one (a prefix every request
   shares, a system prompt, must not pile the whole load onto one engine). The prefix-pool
   entries registered on an engine count too (the dispatcher looks them up in each engine's
   pool).
2. **Load.** Otherwise (no block of the prompt seen, or the engine that has it is full) the
   least loaded engine with room: the most free slots, then the most free KV blocks, then the
   lowest index.

This is what the engine would cache, not what it does cache: an engine's prefix cache evicts
blocks on its own, so a remembered prefix can miss. A miss costs a prefill, never a wrong
answer, and the next request with that prompt is remembered again. The memory is an LRU of
``capacity`` block keys; each key knows the engines it was sent to.

Python's ``hash`` of integer tuples is deterministic, so the keys are the same in every run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Placement", "PlacementStatistics", "Room"]


@dataclass(frozen=True, slots=True)
class Room:
    """What one usable engine can take now."""

    engine: int  # the engine's index in the runtime
    free_slots: int  # batch slots not held by dispatched requests
    free_blocks: int | None = None  # KV blocks free in its pool (None: not known)


@dataclass(frozen=True, slots=True)
class PlacementStatistics:
    placed: int  # requests placed, ever
    by_prefix: int  # of them, on the engine that held a prefix of their prompt
    remembered_blocks: int  # block keys in the memory


class Placement:
    """The prefix memory and the placement rule for ``engines`` engines."""

    def __init__(self, engines: int, block_size: int, capacity: int = 65536, slack: int = 4) -> None:
        if engines < 1 or block_size < 1 or capacity < 1 or slack < 0:
            raise ValueError("engines, block_size and capacity must be positive, slack not negative")
        self.engines = engines
        self.slack = slack
        self.block_size = block_size
        self.capacity = capacity
        self._holders: OrderedDict[int, set[int]] = OrderedDict()  # block key -> engines, LRU first
        self.placed = 0
        self.by_prefix = 0

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Placement engines={self.engines} placed={s.placed} by_prefix={s.by_prefix} "
                f"blocks={s.remembered_blocks}>")

    def statistics(self) -> PlacementStatistics:
        return PlacementStatistics(self.placed, self.by_prefix, len(self._holders))

    def keys(self, prompt: Sequence[int], salt: Hashable) -> list[int]:
        """The chain of keys of ``prompt``'s full blocks: each key covers every block before it."""
        keys, parent = [], hash(("tinyloop-placement", salt))
        size = self.block_size
        for start in range(0, len(prompt) - size + 1, size):
            parent = hash((parent, *prompt[start:start + size]))
            keys.append(parent)
        return keys

    def matches(self, keys: Sequence[int]) -> dict[int, int]:
        """Engine -> how many leading blocks of the chain it was sent (engines with none left out)."""
        found: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, key in enumerate(keys, start=1):
            holders = self._holders.get(key, set())
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for engine in alive:
                found[engine] = depth
        return found

    def choose(self, prompt: Sequence[int], salt: Hashable, rooms: Sequence[Room], weight: int = 1,
               registered: Mapping[int, int] | None = None) -> int:
        """The engine for a request of ``weight`` slots: the longest prefix among the engines
        with room that are within ``slack`` slots of the least loaded, else the least loaded.
        ``rooms`` lists the usable engines (the dispatcher only pulls requests for free slots; a
        request wider than every engine's free slots goes to the least loaded). ``registered``:
        engine -> prompt tokens a prefix-pool entry registered there covers (they count as
        remembered blocks)."""
        least = max(rooms, key=_load_order)
        keys = self.keys(prompt, salt) if self.engines > 1 else []
        found = self.matches(keys)
        for engine, tokens in (registered or {}).items():
            found[engine] = max(found.get(engine, 0), tokens // self.block_size)
        near = [r for r in rooms if r.free_slots >= weight and least.free_slots - r.free_slots <= self.slack]
        best = max(near, key=lambda r: (found.get(r.engine, 0), *_load_order(r))) if near else least
        self.placed += 1
        if found.get(best.engine, 0):
            self.by_prefix += 1
        self._remember(keys, best.engine)
        return best.engine

    def forget_engine(self, engine: int) -> None:
        """The engine left the pool (it broke): no prefix draws requests to it any more."""
        for key, holders in list(self._holders.items()):
            holders.discard(engine)
            if not holders:
                del self._holders[key]

    def _remember(self, keys: Sequence[int], engine: int) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = {engine}
            else:
                holders.add(engine)
                self._holders.move_to_end(key)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)


def _load_order(room: Room) -> tuple[int, int, int]:
    """Larger is less loaded: more free slots, then more free KV blocks, then a lower index."""
    return room.free_slots, -1 if room.free_blocks is None else room.free_blocks, -room.engine
