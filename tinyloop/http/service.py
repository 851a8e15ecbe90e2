"""What every router shares: the served model, request building, admission of n choices, SSE.

The HTTP layer only translates: it tokenises, validates limits (a 400 before anything is
queued), hands ``GenerationRequest``s to the runtime and formats what comes back.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

from quart import current_app, g, request

from tinyloop.actors.runtime import Runtime
from tinyloop.actors.stream import RequestStream
from tinyloop.errors import ConfigError, PromptTooLongError, RequestError
from tinyloop.vocabulary import ExitRule
from tinyloop.http.bodies import decode_body, off_loop
from tinyloop.http.errors import ApiError, from_exception
from tinyloop.requests import GenerationChunk, GenerationRequest, GenerationResult, SamplingParams
from tinyloop.settings import Settings
from tinyloop.tokenizer import Tokenizer

__all__ = ["ServedModel", "Served", "served", "sse", "DONE", "new_id", "start_all", "parse_body",
           "interleave"]

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ServedModel:
    """What clients see of the model: its id, tokenizer, limits and a description."""

    id: str
    tokenizer: Tokenizer
    chat_template: str
    max_seq_len: int
    default_loops: int
    max_loops: int
    vocab_size: int
    arch: str = "looped"
    quant: str = "float32"
    kv_cache_mode: str = "full"
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine: Any, settings: Settings, name: str | None = None) -> ServedModel:
        """Describe a loaded ``Engine`` (its KV mode, or the settings' for an engine without one)."""
        cfg = engine.config
        kv_mode = getattr(engine, "kv_mode", None)
        style = "ouro" if cfg.injection == "none" else "huginn"
        return cls(id=name or settings.served_model_name or engine.name, tokenizer=engine.tokenizer,
                   chat_template=engine.chat_template, max_seq_len=engine.max_seq_len,
                   default_loops=cfg.default_loops, max_loops=cfg.max_loops,
                   vocab_size=cfg.vocab_size, arch=f"tinyloop-{style}",
                   quant=str(engine.dtype).removeprefix("torch."),
                   kv_cache_mode=settings.kv_cache_mode if kv_mode is None else kv_mode.name)

    def check_name(self, name: str | None) -> None:
        if name is not None and name != self.id:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    async def encode_chat(self, messages: Sequence[Any]) -> list[int]:
        """The chat rendered with the template and tokenised (in a worker thread when long)."""
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        size = sum(len(t["content"]) for t in turns) + 16 * len(turns)
        return await off_loop(self._encode_chat, turns, size=size)

    def _encode_chat(self, turns: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.render_chat(turns, template=self.chat_template))

    async def encode_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Text tokenised, or token ids checked against the vocabulary (in a worker thread when
        long)."""
        if isinstance(prompt, str):
            tokens = await off_loop(self.tokenizer.encode, prompt, size=len(prompt))
        else:
            tokens = list(prompt)
            bad = await off_loop(self.outside_vocabulary, tokens, size=len(tokens))
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside the vocabulary ({self.vocab_size})",
                               param=param, code="invalid_value")
        if not tokens:
            raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
        return tokens

    def outside_vocabulary(self, tokens: Sequence[int]) -> int | None:
        """The first token id that is not in the vocabulary, or None."""
        return next((t for t in tokens if t >= self.vocab_size), None)

    def check_context(self, tokens: Sequence[int], param: str) -> None:
        """A prompt that leaves no room for one generated token is the prompt's fault (400 naming
        ``param``), whatever ``max_tokens`` says."""
        if len(tokens) >= self.max_seq_len:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens; this model's context is "
                           f"{self.max_seq_len} tokens, prompt and completion together",
                           param=param, code="context_length_exceeded")

    def max_tokens(self, prompt_len: int, asked: int | None, param: str = "max_tokens") -> int:
        """``asked`` checked against the context; None or -1 means up to the context's end.
        ``param`` is the field the client set (``max_tokens`` or ``max_completion_tokens``)."""
        if asked is None or asked == -1:
            asked = self.max_seq_len - prompt_len
            if asked < 1:
                raise from_exception(PromptTooLongError(prompt_len, 1, self.max_seq_len))
        if prompt_len + asked > self.max_seq_len:
            err = from_exception(PromptTooLongError(prompt_len, asked, self.max_seq_len))
            err.param = param
            raise err
        return asked

    def check_loops(self, loops: int | None) -> None:
        if loops is not None and loops > self.max_loops:
            raise ApiError(400, f"loops must be <= {self.max_loops} for this model", param="loops",
                           code="invalid_value")


@dataclass(frozen=True)
class Served:
    runtime: Runtime
    model: ServedModel
    settings: Settings


def served() -> Served:
    """The runtime and model of the app serving this request (503 while none is loaded)."""
    state: Served | None = current_app.extensions.get("tinyloop")
    if state is None:
        raise ApiError(503, "the model is not loaded yet", code="model_not_loaded",
                       headers={"Retry-After": "1"})
    return state


async def parse_body(model: type[Any]) -> Any:
    """The JSON body validated against ``model`` (400 naming the field otherwise; 413 past the
    text limits); a big body is decoded in a worker thread."""
    raw: bytes = await request.get_data(as_text=False)  # type: ignore[assignment]
    g.body_read = True  # the whole body arrived: the connection can be kept alive
    state: Served | None = current_app.extensions.get("tinyloop")
    return await decode_body(raw, model, state.settings if state is not None else Settings())


def sampling_from(body: Any, *, seed: int | None, stop: tuple[str, ...], logprobs: bool,
                  top_logprobs: int) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=seed, stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            logprobs=logprobs, top_logprobs=top_logprobs)
    except RequestError as exc:
        raise from_exception(exc) from None


def exit_rule(body: Any) -> ExitRule | None:
    """The body's ``exit`` object as an ExitRule (400 naming ``exit`` when inconsistent)."""
    spec = getattr(body, "exit", None)
    if spec is None:
        return None
    try:
        return ExitRule(kind=spec.kind, threshold=spec.threshold, min_loops=spec.min_loops)
    except ConfigError as exc:
        raise ApiError(400, f"Invalid value for 'exit': {exc}", param="exit", code="invalid_value") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def make_requests(body: Any, model: ServedModel, tokens: list[int], max_tokens: int | None,
                  n: int, *, seed: int | None, stop: tuple[str, ...], logprobs: bool,
                  top_logprobs: int, mode: str = "generate",
                  max_tokens_param: str = "max_tokens", **fields: Any) -> list[GenerationRequest]:
    """One request per choice; choice ``i`` samples with ``seed + i`` so choices differ.
    ``fields`` are further ``GenerationRequest`` fields (a mode's own: draft loops, beams)."""
    model.check_loops(body.loops)
    limit = model.max_tokens(len(tokens), max_tokens, max_tokens_param)
    out = []
    for i in range(n):
        choice_seed = None if seed is None else (seed + i) % 2**63
        sampling = sampling_from(body, seed=choice_seed, stop=stop, logprobs=logprobs,
                                 top_logprobs=top_logprobs)
        try:
            out.append(GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=limit, mode=mode,
                                         loops=body.loops, cache_window=body.cache_window,
                                         warm_start=body.warm_start, sampling=sampling,
                                         exit=exit_rule(body), **fields))
        except RequestError as exc:
            raise from_exception(exc) from None
    return out


@contextmanager
def _all_or_none(streams: Sequence[RequestStream]) -> Iterator[None]:
    """On any failure cancel every stream; TinyLoop errors become their HTTP error."""
    try:
        yield
    except BaseException as exc:
        for s in streams:
            s.cancel()
        if isinstance(exc, Exception):
            raise from_exception(exc) from exc
        raise


async def start_all(rt: Runtime, reqs: Sequence[GenerationRequest], priority: int,
                    slo_ms: float | None, *, streaming: bool) -> list[RequestStream]:
    """Admit every request (all or none: a refusal cancels the ones already admitted);
    ``streaming`` is the body's ``stream``: only streamed requests count in ``first_token_ms``.

    The choices are admitted one by one and each must find the queue below
    ``max_queue_depth``; the engine's free slots drain the queue only as fast as the dispatcher
    runs. So more than ``max_queue_depth + max_batch_size`` choices are never admitted, and
    more than ``max_queue_depth`` only by luck of timing on an idle server (never while every
    slot is busy). Such an ``n`` is the request's fault (400 naming ``n``, checked before
    anything is admitted), not an overload to retry (503 with ``Retry-After``)."""
    depth = rt.settings.max_queue_depth
    if len(reqs) > depth:
        raise ApiError(400, f"n={len(reqs)} choices cannot all be queued together: this server "
                       f"queues at most {depth} requests (--max-queue-depth)", param="n",
                       code="invalid_value")
    streams: list[RequestStream] = []
    with _all_or_none(streams):
        for req in reqs:
            stream = rt.submit_stream(req, priority=priority, slo_ms=slo_ms, stream=streaming)
            streams.append(stream)
            await stream.start()
    return streams


async def collect(streams: Sequence[RequestStream]) -> list[GenerationResult]:
    """Wait for every stream's result (they run concurrently in the engine)."""
    results = []
    with _all_or_none(streams):
        for s in streams:
            async for _ in s:
                pass
            assert s.result is not None
            results.append(s.result)
    return results


async def interleave(streams: Sequence[RequestStream]) -> AsyncGenerator[tuple[int, list[GenerationChunk]], None]:
    """``(choice, its new chunks)`` with the choices taking turns; ``[]`` once a choice ended
    (its ``result`` is then set). The choices of one request decode in the same batch, so each
    turn finds the next one's tokens ready; one that lags only delays the others, and what piled
    up comes in its next turn."""
    live = list(range(len(streams)))
    while live:
        for i in list(live):
            burst = await streams[i].next_burst()
            if not burst:
                live.remove(i)
            yield i, burst


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def sse_guard(events: AsyncGenerator[bytes, None],
              streams: Sequence[RequestStream]) -> AsyncIterator[bytes]:
    """Wrap an SSE body: a failure after streaming began becomes an error event then [DONE];
    a client that goes away cancels every stream; a graceful shutdown about to cut the stream
    (the app's ``Drain``) ends it the same way, with a ``shutting down`` error. Call it in the
    request context: the body runs after that context ended."""
    from tinyloop.errors import SchedulerShutdown
    from tinyloop.http.drain import DRAIN_KEY, Drain

    drain: Drain = current_app.extensions.get(DRAIN_KEY) or Drain()

    async def guarded() -> AsyncIterator[bytes]:
        try:
            # closed here when the client goes away mid-stream (not left to the GC, where Trio
            # warns about an unfinished async generator)
            async with aclosing(events):
                while True:
                    with drain.watch() as cut:  # no yield inside the scope
                        chunk = await anext(events, None)
                    if cut.cancelled_caught:
                        raise SchedulerShutdown("shutting down: the server's graceful timeout "
                                                "ends this stream")
                    if chunk is None:
                        return
                    yield chunk
        except Exception as exc:  # the stream already started: report in-band
            err = from_exception(exc)
            yield sse({"error": {"message": err.message, "type": "server_error" if err.status >= 500
                                 else "invalid_request_error", "param": err.param, "code": err.code}})
            yield DONE
        finally:
            for s in streams:
                s.cancel()

    return guarded()
