"""Automatic prefix caching: full KV blocks kept after their sequence ends, found by hash chain.

vLLM's scheme on our loop-slot pool. Block index ``i`` of a sequence covers positions
``[i*bs, (i+1)*bs)`` in every one of its ``n_slots`` tables; once those positions hold computed
KV, the ``n_slots`` blocks are keyed by

    key(i) = sha256(key(i-1) | tokens[i*bs:(i+1)*bs] | (loops, window, noise_seed, kv mode))

so a key names the whole token prefix up to the block's end. The KV of a prompt prefix depends
on nothing else (the initial state is randn by position, ``NOISE_SEED``), so a later sequence
whose prompt starts with the same tokens at the same loops and window can share the blocks.

Ownership: the cache holds **one reference of its own** on every block it keeps (the pool's
ordinary refcount). A cached block no sequence holds has refcount 1 and is *idle*: neither free
nor in use, and evictable. A sequence sharing it raises the count, so it is never evicted while
held, and the pool's copy-on-write (refcount > 1) keeps a writer from changing cached KV.
Eviction is least recently used, by entry (all slots of a block index together), and only of
idle entries; the pool asks for it when its free list runs dry.

The idle count is kept as it changes, never recounted: ``holders[b]`` says how many entries
hold block ``b`` (0 or 1 in practice), and a block is idle when ``holders[b] > 0`` and its
refcount is 1 (``refcount >= holders`` always, so a block in two entries is never idle). The
cache updates ``idle`` when an entry comes or goes; the pool's ``incref``/``release`` update it
when a held block's refcount crosses 1. So ``idle_blocks()`` is O(1) and reads one int: safe
from the event loop while the engine's worker thread inserts and evicts (iterating the entries
there raised "OrderedDict mutated during iteration").

The chain is SHA-256, not Python's ``hash``: an int tuple's ``hash`` is the same in every
process and cheap to collide on purpose, and a collision would hand one client's KV to another
prompt (the prefix-caching hash collision vLLM fixed the same way).

Plain bookkeeping over block ids: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["BlockCache", "block_keys"]


def block_keys(tokens: Sequence[int], block_size: int, n_blocks: int,
               salt: tuple[object, ...]) -> list[bytes]:
    """The SHA-256 chain of the first ``n_blocks`` full blocks of ``tokens`` under ``salt``
    (whose ``repr`` must be deterministic: ints, strings and their tuples)."""
    keys, tail = [], repr(salt).encode()
    parent = hashlib.sha256(tail).digest()
    for i in range(n_blocks):
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block + tail).digest()
        keys.append(parent)
    return keys


class BlockCache:
    """Hash-chain keyed entries of ``n_slots`` block ids each, in LRU order (oldest first).

    ``refcount`` is the pool's list (read to tell idle entries from held ones); ``incref`` and
    ``release`` are the pool's, so the cache's references are ordinary ones.
    """

    def __init__(self, refcount: list[int], incref: Callable[[list[int]], None],
                 release: Callable[[list[int]], None]) -> None:
        self._refcount = refcount
        self._incref, self._release = incref, release
        self._entries: OrderedDict[bytes, list[int]] = OrderedDict()
        self.holders = [0] * len(refcount)  # entries holding each block
        self.idle = 0  # blocks only the cache references (see the module docstring)
        self.hits = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<BlockCache entries={len(self)} idle_blocks={self.idle_blocks()} hits={self.hits}>"

    def idle_blocks(self) -> int:
        """Blocks only the cache holds (evictable; counted neither used nor free). O(1)."""
        return self.idle

    def _hold(self, blocks: Sequence[int]) -> None:
        """An entry takes ``blocks``: one reference each, and they count as held."""
        self._incref(list(blocks))
        for b in blocks:
            self.holders[b] += 1
            if self.holders[b] == 1 and self._refcount[b] == 1:
                self.idle += 1

    def _drop(self, blocks: list[int]) -> None:
        """An entry lets go of ``blocks``: no longer held (first, so no block ever counts both
        idle and free), then its references go back to the pool."""
        for b in blocks:
            if self.holders[b] == 1 and self._refcount[b] == 1:
                self.idle -= 1
            self.holders[b] -= 1
        self._release(blocks)

    def insert(self, keys: Sequence[bytes], columns: Sequence[list[int]]) -> None:
        """Keep ``columns[i]`` (block ids of every slot at block index i) under ``keys[i]``.

        A key already cached keeps its blocks (another sequence computed the same KV first).
        """
        for key, blocks in zip(keys, columns):
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._hold(blocks)
            self._entries[key] = list(blocks)

    def lookup(self, keys: Sequence[bytes]) -> list[list[int]]:
        """The longest run of cached entries for ``keys`` from the first, one reference taken on
        each of their blocks for the caller; marks them recently used."""
        found: list[list[int]] = []
        for key in keys:
            blocks = self._entries.get(key)
            if blocks is None:
                break
            found.append(blocks)
        # Newest last, parents after children: the tail of a chain is evicted before its head,
        # which would otherwise strand the tail (reachable only through the head).
        for key in reversed(keys[:len(found)]):
            self._entries.move_to_end(key)
        for blocks in found:
            self._incref(blocks)
        self.hits += len(found)
        return found

    def evict(self, n_blocks: int) -> int:
        """Release idle entries, least recently used first, until ``n_blocks`` blocks went back
        to the free list (or none is left); returns how many did."""
        freed = 0
        for key in list(self._entries):
            if freed >= n_blocks:
                break
            blocks = self._entries[key]
            if all(self._refcount[b] == 1 for b in blocks):
                del self._entries[key]
                self._drop(blocks)
                freed += len(blocks)
                self.evictions += 1
        return freed

    def clear(self) -> None:
        """Drop every entry (held blocks stay with their sequences)."""
        for blocks in self._entries.values():
            self._drop(blocks)
        self._entries.clear()
