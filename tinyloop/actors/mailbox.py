"""An actor's pipeline inbox and its feedback inbox, read as one stream of messages.

The actors form a pipeline (admission -> queue -> dispatcher -> engine) with feedback flowing
back (``Pull``, ``SlotFreed``, ``Cancel``). Shutdown cascades down the pipeline by closing
channels: an actor whose pipeline inbox ends finishes what it holds, then closes its outbox,
which ends the next one. Feedback cannot share the pipeline inbox: its senders sit downstream
and close only after this actor has, so that inbox would never end. ``merged`` reads both and
turns the pipeline inbox's ``EndOfChannel`` into one ``UpstreamClosed`` item; the actor leaves
the ``async with`` when it is done, which stops reading the feedback.

Cancellation: the forwarding tasks die with the actor; feedback read but not yet taken is lost,
which only happens once the actor has decided to stop (nobody needs it then).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import trio

__all__ = ["UpstreamClosed", "merged"]

A = TypeVar("A")
B = TypeVar("B")


@dataclass(frozen=True, slots=True)
class UpstreamClosed:
    """The pipeline inbox ended: nothing more will come from upstream."""


@asynccontextmanager
async def merged(inbox: trio.MemoryReceiveChannel[A], feedback: trio.MemoryReceiveChannel[B],
                 ) -> AsyncIterator[trio.MemoryReceiveChannel[A | B | UpstreamClosed]]:
    """Both inboxes as one channel (buffer 0: the senders' own buffers do the buffering)."""
    send, receive = trio.open_memory_channel[A | B | UpstreamClosed](0)
    async with trio.open_nursery() as nursery, receive:
        nursery.start_soon(_forward, inbox, send.clone(), True)
        nursery.start_soon(_forward, feedback, send.clone(), False)
        send.close()
        yield receive
        nursery.cancel_scope.cancel()


async def _forward(source: trio.MemoryReceiveChannel[A], sink: trio.MemorySendChannel[A | B | UpstreamClosed],
                   report_end: bool) -> None:
    async with source, sink:
        try:
            async for msg in source:
                await sink.send(msg)
            if report_end:
                await sink.send(UpstreamClosed())
        except trio.BrokenResourceError:
            pass  # the actor stopped reading
