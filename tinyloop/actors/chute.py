"""A request's result channel: many items in, one reader out, the writer never blocks.

Every request has one (``Ticket``), and every token crosses it, so it is cheaper than a trio
memory channel where that costs: one object of four slots instead of a channel state and two
channel ends, and a send that is a ``deque.append`` (or one ``reschedule`` when the reader waits).
It keeps the memory channel's contract for what a ticket needs: ``send_nowait`` raises
``ClosedResourceError`` once the writer closed and ``BrokenResourceError`` once the reader did;
``receive`` is a checkpoint (like every Trio await) and raises ``EndOfChannel`` once the writer
closed and every item was read; ``receive_nowait`` raises ``WouldBlock``. Unbounded: a ticket
holds at most ``max_tokens + 2`` items, and nobody waits on a full one.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import outcome
import trio

__all__ = ["Chute"]

T = TypeVar("T")


class Chute(Generic[T]):
    """One writer side (``send_nowait``, ``close``), one reader (``receive``, ``receive_nowait``,
    ``close_receiver``)."""

    __slots__ = ("_items", "_waiter", "_closed", "_receiver_closed")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: trio.lowlevel.Task | None = None
        self._closed = False  # the writer's end
        self._receiver_closed = False

    def __repr__(self) -> str:
        return (f"<Chute {len(self._items)} items{' closed' if self._closed else ''}"
                f"{' receiver-closed' if self._receiver_closed else ''}>")

    # -- the writer ----------------------------------------------------------------------------
    def send_nowait(self, item: T) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the chute's writer closed it")
        if self._receiver_closed:
            raise trio.BrokenResourceError("the chute's reader went away")
        if self._waiter is not None:
            task, self._waiter = self._waiter, None
            trio.lowlevel.reschedule(task, outcome.Value(item))
        else:
            self._items.append(item)

    def close(self) -> None:
        """No more items (idempotent): the reader gets ``EndOfChannel`` after the last one."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            task, self._waiter = self._waiter, None
            trio.lowlevel.reschedule(task, outcome.Error(trio.EndOfChannel()))

    # -- the reader ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """``receive`` would not wait: an item is buffered, or the writer closed."""
        return bool(self._items) or self._closed or self._receiver_closed

    def receive_nowait(self) -> T:
        if self._receiver_closed:
            raise trio.ClosedResourceError("the chute's reader closed it")
        if self._items:
            return self._items.popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.ready:  # no WouldBlock raised and caught on the way to a wait
            value = self.receive_nowait()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return value
        if self._waiter is not None:
            raise trio.BusyResourceError("another task is already reading this chute")
        self._waiter = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        item: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return item

    def close_receiver(self) -> None:
        """Stop reading (idempotent): what is buffered is dropped, later sends are refused."""
        self._receiver_closed = True
        self._items.clear()
        if self._waiter is not None:
            task, self._waiter = self._waiter, None
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError("the chute's reader closed it")))
