"""What the engine actor needs from an engine, and the adapter that runs ours in a thread.

``EnginePort`` is the async face of the engine contract. ``ThreadedEngine`` wraps the blocking
``Engine`` and runs each step in a worker thread (``trio.to_thread.run_sync``), translating
foreign errors at that boundary: out-of-memory and any other failure of a step become
``EngineError`` (the requests of that step fail, the engine stays usable). The pure-Trio
``tinyloop.testing.FakeEngine`` implements the same port.

Nothing here imports torch or the model: the actors and the HTTP layer load without them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import trio

from tinyloop.errors import EngineError, TinyLoopError
from tinyloop.limits import Resolved
from tinyloop.requests import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from tinyloop.engine.engine import Engine
    from tinyloop.engine.sequence import Sequence as Seq
    from tinyloop.engine.sequence import TokenEvent
    from tinyloop.model.kvcache import KVDemand, KVPoolStats

__all__ = ["EnginePort", "ThreadedEngine", "engine_errors"]


class EnginePort(Protocol):
    """The engine as the engine actor drives it."""

    max_seq_len: int
    default_loops: int

    def check(self, req: GenerationRequest) -> Resolved:
        """The one check of a request against the model (``tinyloop.limits``): raises
        ``RequestError`` naming the field, or resolves its loops, window and exit rule."""
        ...

    def start(self, req: GenerationRequest, prefix: Any = None, resolved: Resolved | None = None) -> Any:
        """Set up a sequence (cheap, no model work) for a request ``check`` resolved (checked
        again when ``resolved`` is None; RequestError). The sequence's ``cached_tokens`` says how
        many prompt tokens need no prefill."""
        ...

    async def step(self, seqs: Sequence[Any]) -> Sequence[TokenEvent]:
        """One iteration over the active sequences. It yields to the scheduler (any Trio
        sleep, thread or channel wait does): the engine actor takes no checkpoint of its own
        after a step that ran."""
        ...

    def result(self, seq: Any, wall_ms: float, time_to_first_token_ms: float | None) -> GenerationResult:
        """A finished sequence's result, its times those given (the runtime's clock, from
        submission: one clock for results and metrics)."""
        ...

    def free(self, seq: Any) -> None: ...

    def start_prefix(self, tokens: Sequence[int], loops: int | None, cache_window: int | None) -> Any:
        """A sequence that prefills ``tokens`` through ``step`` and stops there (``prefilling``
        turns False): a prefix-pool entry once done (no model work here)."""
        ...

    def preempt(self, seq: Any) -> None:
        """Free a growing sequence's KV; its next steps rebuild it (``KVDemand.preemptible``)."""
        ...

    def resume(self, seq: Any) -> None:
        """A preempted sequence runs again (take what the prefix cache kept of its KV)."""
        ...

    def kv_statistics(self) -> KVPoolStats | None: ...

    def kv_bytes_per_token(self) -> int | None: ...

    def kv_start_blocks(self, req: GenerationRequest, resolved: Resolved | None = None) -> int | None:
        """Blocks ``req`` needs to start (None: the engine does not count blocks)."""
        ...

    def kv_prefix_blocks(self, tokens: Sequence[int], loops: int | None,
                         cache_window: int | None) -> int | None:
        """Blocks a prefix registration of ``tokens`` holds."""
        ...

    def kv_demand(self, seq: Any) -> KVDemand | None:
        """What a running sequence asks of the pool next."""
        ...

    def kv_available(self) -> int | None:
        """Blocks the pool can hand out now (None: the engine does not count blocks)."""
        ...


def _out_of_memory() -> tuple[type[BaseException], ...]:
    """``MemoryError``, and torch's out-of-memory error once torch is loaded (an engine that
    raises it has loaded torch; nothing else needs it imported)."""
    torch = sys.modules.get("torch")
    return (MemoryError,) if torch is None else (MemoryError, torch.OutOfMemoryError)


class engine_errors:  # noqa: N801 (used as ``with engine_errors():``, like a function)
    """Map foreign failures of model work to EngineError (TinyLoop errors pass through). A
    plain context manager, not a ``contextmanager`` generator: the engine actor enters one per
    step."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None or isinstance(exc, TinyLoopError) or not isinstance(exc, Exception):
            return  # nothing raised, or passes through as it is
        if isinstance(exc, _out_of_memory()):
            raise EngineError(f"out of memory: {exc}") from exc
        raise EngineError(f"{type(exc).__name__}: {exc}") from exc


class ThreadedEngine:
    """``Engine`` behind the port: every model call in a worker thread, one at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.default_loops = engine.default_loops

    def __repr__(self) -> str:
        return f"<ThreadedEngine {self.engine!r}>"

    def check(self, req: GenerationRequest) -> Resolved:
        return self.engine.limits.check(req)

    def start(self, req: GenerationRequest, prefix: Seq | None = None,
              resolved: Resolved | None = None) -> Seq:
        return self.engine.start(req, prefix, resolved)

    async def step(self, seqs: Sequence[Seq]) -> list[TokenEvent]:
        with engine_errors():
            return await trio.to_thread.run_sync(self.engine.step, list(seqs))

    def result(self, seq: Seq, wall_ms: float, time_to_first_token_ms: float | None) -> GenerationResult:
        return seq.result().timed(wall_ms, time_to_first_token_ms)

    def free(self, seq: Seq) -> None:
        self.engine.free(seq)

    def start_prefix(self, tokens: Sequence[int], loops: int | None, cache_window: int | None) -> Seq:
        return self.engine.start_prefix(tokens, loops, cache_window)

    def preempt(self, seq: Seq) -> None:
        self.engine.preempt(seq)

    def resume(self, seq: Seq) -> None:
        self.engine.resume(seq)

    def kv_statistics(self) -> KVPoolStats:
        return self.engine.kv_statistics()

    def kv_bytes_per_token(self) -> int:
        return self.engine.kv_bytes_per_token()

    def kv_start_blocks(self, req: GenerationRequest, resolved: Resolved | None = None) -> int:
        return self.engine.kv_start_blocks(req, resolved)

    def kv_prefix_blocks(self, tokens: Sequence[int], loops: int | None, cache_window: int | None) -> int:
        return self.engine.kv_prefix_blocks(tokens, loops, cache_window)

    def kv_demand(self, seq: Seq) -> KVDemand:
        return self.engine.kv_demand(seq)

    def kv_available(self) -> int:
        return self.engine.kv_available()
