"""Test doubles for code that embeds the runtime.

``FakeEngine`` implements the engine port in pure Trio, so ``pytest-trio``'s ``autojump_clock``
drives every delay and a test of queueing, admission, cancellation or streaming is
deterministic and takes milliseconds::

    engine = FakeEngine(latency_ms=50, stream_tokens=[1, 2, 3])
    async with tinyloop.open_runtime(engine, Settings(max_batch_size=1)) as rt:
        result = await rt.submit(GenerationRequest(prompt_tokens=(1,), max_tokens=3))
        assert result.tokens == [1, 2, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from tinyloop.engine.sequence import TokenEvent
from tinyloop.limits import ModelLimits, Resolved
from tinyloop.model.kvcache import KVDemand, KVPoolStats
from tinyloop.requests import GenerationRequest, GenerationResult

__all__ = ["FakeEngine", "FakeSequence"]


@dataclass(eq=False, slots=True)
class FakeSequence:
    """What FakeEngine keeps per request: the tokens it will emit and how far it got."""

    request: GenerationRequest
    loops: int
    window: int
    script: list[int]
    started_at: float
    prefix: object | None = None
    output: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    error: BaseException | None = None
    finish_reason: str | None = None
    first_token_at: float | None = None
    prefill_only: bool = False  # a registered prefix: "prefilled" as soon as it starts
    prefilling: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return list(self.request.prompt_tokens)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix covered (the last one always runs, as in the engine)."""
        if not isinstance(self.prefix, FakeSequence):
            return 0
        return min(len(self.prefix.prompt), len(self.prompt) - 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        """The result timed from the sequence's start (the runtime asks ``FakeEngine.result``)."""
        ttft = None if self.first_token_at is None else (self.first_token_at - self.started_at) * 1000
        return self.timed_result((trio.current_time() - self.started_at) * 1000, ttft)

    def timed_result(self, wall_ms: float, time_to_first_token_ms: float | None) -> GenerationResult:
        n = len(self.output)
        length = self.finish_reason == "length"
        return GenerationResult(
            tokens=list(self.output), text="".join(self.text), finish_reason="length" if length else "stop",
            prompt_tokens=len(self.request.prompt_tokens), completion_tokens=n, wall_ms=wall_ms,
            stop_reason="length" if length else "eos", loops_used=self.loops,
            mean_loops=float(self.loops) if n else None, time_to_first_token_ms=time_to_first_token_ms)


@dataclass
class FakeEngine:
    """A pure-Trio engine: emits ``stream_tokens`` (up to ``max_tokens``) as chunks ``"<t>"``.

    ``latency_ms`` is the time of a step that starts a request (its prefill), ``token_latency_ms``
    the time of every later step. ``fail_with`` is raised by every step while set. ``started``
    records request ids in the order the engine started them; ``batches`` the batch size of
    each step. With ``kv_blocks`` set it counts KV like the real engine, one block per prompt
    or output token: ``kv_statistics`` reports the total and ``kv_start_blocks`` a request's
    prompt plus ``max_tokens``, held from its start (never preempted); ``peak_blocks`` is the most
    that live sequences ever held.
    """

    latency_ms: float = 10.0
    fail_with: BaseException | None = None
    stream_tokens: list[int] = field(default_factory=lambda: [1, 2, 3])
    max_seq_len: int = 2048
    default_loops: int = 8
    token_latency_ms: float = 0.0
    max_loops: int = 64
    started: list[str] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    prefixes: list[tuple[int, ...]] = field(default_factory=list)
    live: int = 0
    kv_blocks: int | None = None
    held_blocks: int = 0
    peak_blocks: int = 0
    _limits: tuple[tuple[int, int, int], ModelLimits] | None = field(default=None, repr=False)

    @property
    def limits(self) -> ModelLimits:
        """What the fake accepts: the context, ``max_loops`` (no vocabulary or KV limit); built
        again only when a test changed one of them."""
        key = (self.max_seq_len, self.default_loops, self.max_loops)
        if self._limits is None or self._limits[0] != key:
            self._limits = (key, ModelLimits(max_seq_len=self.max_seq_len, vocab_size=2**31,
                                             default_loops=self.default_loops, max_loops=self.max_loops))
        return self._limits[1]

    def check(self, req: GenerationRequest) -> Resolved:
        return self.limits.check(req)

    def start(self, req: GenerationRequest, prefix: object | None = None,
              resolved: Resolved | None = None) -> FakeSequence:
        loops = (resolved or self.check(req)).loops
        self.started.append(req.request_id)
        self.live += 1
        self.held_blocks += len(req.prompt_tokens) + req.max_tokens
        self.peak_blocks = max(self.peak_blocks, self.held_blocks)
        return FakeSequence(req, loops, min(req.cache_window or loops, loops),
                            list(self.stream_tokens[: req.max_tokens]), trio.current_time(), prefix)

    async def step(self, seqs: Sequence[FakeSequence]) -> list[TokenEvent]:
        fresh = any(not s.output for s in seqs)
        await trio.sleep((self.latency_ms if fresh else self.token_latency_ms) / 1000)
        if self.fail_with is not None:
            raise self.fail_with
        self.batches.append(len(seqs))
        events, now = [], trio.current_time()
        for seq in seqs:
            if not seq.script:
                seq.finish_reason = "stop"
                continue
            token = seq.script.pop(0)
            text = f"<{token}>"
            seq.output.append(token)
            seq.text.append(text)
            if seq.first_token_at is None:
                seq.first_token_at = now
            if not seq.script:
                seq.finish_reason = "length" if len(seq.output) >= seq.request.max_tokens else "stop"
            events.append(TokenEvent(seq, token, text, len(seq.output) - 1,  # type: ignore[arg-type]
                                     None, seq.loops, seq.finished))
        return events

    def result(self, seq: FakeSequence, wall_ms: float, time_to_first_token_ms: float | None) -> GenerationResult:
        return seq.timed_result(wall_ms, time_to_first_token_ms)

    def free(self, seq: FakeSequence) -> None:
        self.live -= 1
        self.held_blocks -= len(seq.request.prompt_tokens) + seq.request.max_tokens

    def start_prefix(self, tokens: Sequence[int], loops: int | None,
                     cache_window: int | None) -> FakeSequence:
        req = GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=1, loops=loops,
                                cache_window=cache_window)
        self.prefixes.append(tuple(tokens))
        seq = self.start(req)
        self.started.pop()
        seq.prefill_only = True
        return seq

    def preempt(self, seq: FakeSequence) -> None:
        raise ValueError("FakeEngine sequences set their KV aside at start: never preempted")

    def resume(self, seq: FakeSequence) -> None:
        pass

    def kv_statistics(self) -> KVPoolStats | None:
        if self.kv_blocks is None:
            return None
        used = min(self.held_blocks, self.kv_blocks)
        return KVPoolStats(self.kv_blocks, used, self.kv_blocks - used, 1, 0)

    def kv_start_blocks(self, req: GenerationRequest, resolved: Resolved | None = None) -> int | None:
        """Every FakeEngine request holds its worst case from the start (one block per prompt
        and output token), like the real engine's warm-start, exit and beam requests."""
        return None if self.kv_blocks is None else len(req.prompt_tokens) + req.max_tokens

    def kv_prefix_blocks(self, tokens: Sequence[int], loops: int | None,
                         cache_window: int | None) -> int | None:
        return None if self.kv_blocks is None else len(tokens) + 1

    def kv_demand(self, seq: FakeSequence) -> KVDemand | None:
        return None if self.kv_blocks is None else KVDemand(0, 0, False, 0)

    def kv_available(self) -> int | None:
        return None if self.kv_blocks is None else max(self.kv_blocks - self.held_blocks, 0)

    def kv_bytes_per_token(self) -> None:
        return None


