"""The blocking convenience API: run requests to completion on the caller's thread.

``generate``, ``generate_stream`` and ``generate_many`` drive an engine's ``start``/``step``/
``free`` in a loop (one continuous batch); the runtime does the same from its engine actor. The
``Engine`` methods of the same names delegate here.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

from tinyloop.engine.sequence import Sequence, TokenEvent
from tinyloop.requests import GenerationChunk, GenerationRequest, GenerationResult

__all__ = ["Stepper", "generate", "generate_many", "generate_stream"]


class Stepper(Protocol):
    """What the blocking API needs of an engine."""

    def start(self, req: GenerationRequest, prefix: Sequence | None = None) -> Sequence: ...

    def step(self, seqs: Seq[Sequence]) -> list[TokenEvent]: ...

    def free(self, seq: Sequence) -> None: ...


def generate(engine: Stepper, req: GenerationRequest) -> GenerationResult:
    """Run one request to completion."""
    return generate_many(engine, [req])[0]


def generate_stream(engine: Stepper, req: GenerationRequest,
                    emit: Callable[[GenerationChunk], None]) -> GenerationResult:
    """Run one request, calling ``emit`` with each chunk as its token is sampled."""
    return generate_many(engine, [req], emit=lambda _i, chunk: emit(chunk))[0]


def generate_many(engine: Stepper, reqs: Seq[GenerationRequest],
                  emit: Callable[[int, GenerationChunk], None] | None = None) -> list[GenerationResult]:
    """Run several requests as one continuous batch; results in request order."""
    seqs = [engine.start(r) for r in reqs]
    index = {id(s): i for i, s in enumerate(seqs)}
    try:
        while not all(s.finished for s in seqs):
            for ev in engine.step([s for s in seqs if not s.finished]):
                if emit is not None:
                    emit(index[id(ev.sequence)], ev.chunk())
        for s in seqs:
            if s.error is not None:
                raise s.error
    finally:
        for s in seqs:
            engine.free(s)
    return [s.result() for s in seqs]
