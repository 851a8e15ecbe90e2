"""Each engine's device work on a CUDA stream of its own.

Engines on one GPU (replicas, ``TINYLOOP_DEVICES=cuda,cuda``) each step in their own worker
thread; on one shared stream their kernels would queue behind each other. ``new_stream`` gives
an engine its stream and ``on_stream`` runs a method on it:

    caller's stream --wait--> engine stream: the method's kernels --wait--> caller's stream

The engine's stream waits for the caller's work before the method (its inputs, the weights and
pool the caller's stream wrote at load), and the caller's stream waits for the engine's after it
(a tensor the method returns is safe to read on the caller's stream, and is marked as used there
so that the allocator does not hand its memory back to the engine's stream too early). Nested
calls (``step`` calling ``decode``) are already on the stream and pass straight through. On the
CPU (no stream) the method runs as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch

__all__ = ["OnStream", "new_stream", "on_stream"]

P = ParamSpec("P")
R = TypeVar("R")


class OnStream(Protocol):
    """What ``on_stream`` reads of the object whose method it wraps."""

    device: torch.device
    stream: Any  # torch.cuda.Stream, or None on the CPU


def new_stream(device: torch.device) -> Any:
    """A stream of its own for an engine on ``device`` (None off CUDA), ordered after everything
    already queued on the device's current stream (the weights' and the KV pool's writes)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


S = TypeVar("S", bound="OnStream")


def on_stream(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` on ``self.stream`` (module docstring); as it is when that is None."""

    @functools.wraps(method)
    def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        stream = self.stream
        if stream is None:
            return method(self, *args, **kwargs)
        caller = torch.cuda.current_stream(self.device)
        if caller == stream:  # already on it (a nested call)
            return method(self, *args, **kwargs)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            out = method(self, *args, **kwargs)
        caller.wait_stream(stream)
        if isinstance(out, torch.Tensor) and out.device.type == "cuda":
            out.record_stream(caller)
        return out

    return run
