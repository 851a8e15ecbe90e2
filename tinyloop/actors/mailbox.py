"""An actor's inbox for its pipeline messages and the feedback that flows back to it.

The actors form a pipeline (admission, in callers' tasks -> queue -> dispatcher -> engine) with
feedback flowing back (``Pull``, ``SlotFreed``, ``Cancel``). Shutdown cascades down the pipeline
by closing channels: an actor whose upstream closed finishes what it holds, then closes its own
outbox, which ends the next one. Feedback shares the inbox (one channel: no forwarding task, no extra
hop per message), but its senders sit downstream and close only after this actor has, so the
channel itself cannot end while the actor runs. Hence the upstream actor's end is a ``Pipe``:
closing it puts one ``UpstreamClosed`` in the inbox after everything it sent, then closes its
channel end. The actor stops reading once it has seen that and finished its work; feedback
senders then meet a closed channel (``BrokenResourceError``), which they take as "it stopped".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import trio

__all__ = ["Pipe", "UpstreamClosed", "open_mailbox", "receive_all"]

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class UpstreamClosed:
    """The upstream actor closed its end: nothing more will come down the pipeline."""


class Pipe(Generic[M]):
    """The upstream actor's end of a mailbox: a send channel that says so when it is closed."""

    def __init__(self, send: trio.MemorySendChannel[M | UpstreamClosed]) -> None:
        self._send = send

    async def send(self, msg: M) -> None:
        await self._send.send(msg)

    def send_nowait(self, msg: M) -> None:
        self._send.send_nowait(msg)

    def close(self) -> None:
        """Announce the end, then close (idempotent; synchronous, so admission, which runs in
        callers' tasks, closes its pipe from ``Runtime.refuse_new_requests``)."""
        try:
            self._send.send_nowait(UpstreamClosed())  # the mailbox buffer is unbounded
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the reader is gone already, or the pipe was closed before
        self._send.close()

    async def aclose(self) -> None:
        """``close``, then a checkpoint that a cancelled upstream still gets through."""
        self.close()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def __aenter__(self) -> Pipe[M]:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


def open_mailbox() -> tuple[Pipe[Any], trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]]:
    """A mailbox: the upstream's ``Pipe``, a send end for feedback (clone it per sender), and
    the actor's receive end; the caller annotates them with its message types. Unbounded:
    feedback senders never block, and the pipeline's flow is bounded by the pulls that ask for
    it."""
    send, receive = trio.open_memory_channel[Any](math.inf)
    return Pipe(send), send.clone(), receive


async def receive_all(inbox: trio.MemoryReceiveChannel[M]) -> list[M]:
    """Every message waiting in ``inbox`` (waiting for the first): an actor handles what piled up
    in one wake-up instead of one scheduler round per message. ``EndOfChannel`` once it ended."""
    batch = [await inbox.receive()]
    while True:
        try:
            batch.append(inbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return batch
