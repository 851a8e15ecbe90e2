"""Which waiting sequences start and which running ones give their KV back: no I/O, no clock.

The engine actor asks a :class:`KVPlanner` before every step, with what it knows in blocks:

* **Running** sequences either *grow* (their KV is taken as they go: the next step needs
  ``next_blocks`` more; they can be *preempted*: their KV freed and recomputed later, which
  reproduces it exactly) or are *reserved* (warm start, adaptive exit, beam search, a registered
  prefix: KV that a recompute would not reproduce, so their worst case was set aside at start
  and ``outstanding`` blocks of it are not held yet).
* **Waiting** entries (dispatched requests not started, and preempted sequences to resume) need
  ``blocks`` to start: a growing one its context plus one token, a reserved one its worst case.

``available`` is what the pool can hand out now (free blocks plus idle prefix-cache blocks).

**Preemption** (:meth:`KVPlanner.preempt`): while the running sequences' next steps and the
reserved ones' outstanding blocks do not fit in ``available``, the youngest growing sequence
(latest started) is preempted, as vLLM does, one at a time until they fit.

**Starting** (:meth:`KVPlanner.admit`): entries start in dispatch order while they fit beside
the running ones' next steps, the outstanding reservations and a headroom of one block row per
growing sequence (so a start does not force a preemption at the next block boundary). An entry
that does not fit does not block the ones behind it: a later one that fits starts first. Once
the blocked entry has waited ``aging_s`` seconds, nothing behind it starts until it does, so a
large request is not starved by a stream of small ones. With nothing running an entry always
starts (admission refused what can never fit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KVPlanner", "Running", "Waiting"]


@dataclass(frozen=True, slots=True)
class Running:
    """A running sequence as the planner sees it."""

    key: int
    order: int  # start order: higher started later (is younger)
    next_blocks: int  # blocks its next step may take beyond what it holds
    outstanding: int = 0  # reserved kinds: blocks of the worst case not held yet
    preemptible: bool = True  # False for reserved kinds
    headroom: int = 0  # blocks one more block row of growth takes (its slot count)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A dispatched entry that has not started (or a preempted one to resume)."""

    key: int
    blocks: int  # blocks it needs to start
    since: float  # when it began waiting, in seconds (any clock, the caller's)


@dataclass(slots=True)
class KVPlanner:
    """Start and preemption decisions over block counts (see the module docstring)."""

    aging_s: float = 2.0

    def preempt(self, running: Sequence[Running], available: int) -> int | None:
        """The youngest preemptible sequence when the running ones' next steps do not fit in
        ``available``, else None. The caller preempts it, measures ``available`` again (a
        block shared with another sequence is not freed) and asks again."""
        if sum(r.next_blocks + r.outstanding for r in running) <= available:
            return None
        victims = [r for r in running if r.preemptible]
        return max(victims, key=lambda r: r.order).key if victims else None

    def admit(self, waiting: Sequence[Waiting], running: Sequence[Running], available: int,
              now: float) -> list[int]:
        """The waiting entries to start now, in the order to start them."""
        room = available - sum(r.next_blocks + r.outstanding + r.headroom for r in running)
        started: list[int] = []
        anyone = bool(running)
        for entry in waiting:
            if entry.blocks <= room or not anyone:
                started.append(entry.key)
                room -= entry.blocks
                anyone = True
            elif now - entry.since >= self.aging_s:
                break  # it has waited long enough: nothing behind it goes first
        return started
