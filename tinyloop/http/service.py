"""What every router shares: the served model, request building, admission of n choices, SSE.

The HTTP layer only translates: it tokenises, validates limits (a 400 before anything is
queued), hands ``GenerationRequest``s to the runtime and formats what comes back.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from quart import Response, current_app, g, request

from tinyloop.actors.runtime import Runtime
from tinyloop.actors.stream import RequestStream
from tinyloop.errors import ChatTemplateError, ConfigError, RequestError, TokenizerError
from tinyloop.http.bodies import decode_body, off_loop, text_limiter
from tinyloop.http.errors import ApiError, from_exception
from tinyloop.http.tools import template_supports_tools
from tinyloop.limits import KVLimits, ModelLimits
from tinyloop.requests import Constraint, GenerationChunk, GenerationRequest, GenerationResult, SamplingParams
from tinyloop.settings import Settings
from tinyloop.template_sandbox import RenderLimits
from tinyloop.tokenizer import Tokenizer
from tinyloop.vocabulary import ExitRule

__all__ = [
    "DONE",
    "Served",
    "ServedModel",
    "ChatOptions",
    "Choices",
    "asked_max_tokens",
    "collect",
    "interleave",
    "make_requests",
    "new_id",
    "parse_body",
    "render_limits",
    "served",
    "sse",
    "sse_response",
    "start_all",
]

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ServedModel:
    """What clients see of the model: its id, tokenizer, limits and a description.

    ``limits`` (built from the numbers, the model's exit rule and its KV pool) checks every
    generation request once, before anything is queued. ``chat_template`` is the model's
    default template, ``chat_templates`` its other named ones (``tool_use``: for chats with
    tools); every render runs under ``render_limits``."""

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
    exit: ExitRule = field(default_factory=ExitRule)  # the model's own rule (gate: it has a gate)
    kv: KVLimits | None = None  # the KV pool (None: the KV worst case is left to the engine)
    parameters: int | None = None  # the model's parameter count (None: not known)
    gate: bool = False  # the model has an exit gate although its own rule is not ``gate`` (Ouro)
    chat_templates: Mapping[str, str] = field(default_factory=dict, hash=False)  # named, beside the default
    render_limits: RenderLimits = field(default_factory=RenderLimits)  # what one chat template render may spend
    trained_context: int | None = None  # the context the model was built for (None: not known)
    limits: ModelLimits = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "limits", ModelLimits(
            max_seq_len=self.max_seq_len, vocab_size=self.vocab_size, default_loops=self.default_loops,
            max_loops=self.max_loops, exit=self.exit, kv=self.kv, gate=self.gate,
            trained_context=self.trained_context))

    @classmethod
    def from_engine(cls, engine: Any, settings: Settings, name: str | None = None,
                    trained_context: int | None = None) -> ServedModel:
        """Describe a loaded ``Engine`` (its KV mode, or the settings' for an engine without one);
        its chat templates render under ``render_limits(settings)``. ``trained_context``: the
        context its artifact says the model was built for (a loaded engine's config may hold the
        served context instead, extended past it)."""
        cfg = engine.config
        limits = ModelLimits.from_engine(engine)
        kv_mode = getattr(engine, "kv_mode", None)
        style = ("inkling2" if cfg.architecture == "inkling2" else "ouro" if cfg.injection == "none"
                 else "parcae" if cfg.injection == "diagonal" else "retrofit" if cfg.loop_norm == "none" else "huginn")
        return cls(id=name or settings.served_model_name or engine.name, tokenizer=engine.tokenizer,
                   chat_template=engine.chat_template, max_seq_len=limits.max_seq_len,
                   default_loops=limits.default_loops, max_loops=limits.max_loops,
                   vocab_size=limits.vocab_size, arch=f"tinyloop-{style}",
                   quant=str(engine.dtype).removeprefix("torch."),
                   kv_cache_mode=settings.kv_cache_mode if kv_mode is None else kv_mode.name,
                   exit=limits.exit, kv=limits.kv, parameters=_parameters(engine), gate=limits.gate,
                   chat_templates=dict(getattr(engine.tokenizer, "chat_templates", {})),
                   render_limits=render_limits(settings), trained_context=trained_context)

    def check_name(self, name: str | None) -> None:
        if name is not None and name != self.id:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    async def encode_chat(self, messages: Sequence[Any], chat: ChatOptions | None = None) -> list[int]:
        """The chat (``ChatMessage``s) rendered with the template and tokenised (in a worker thread when long)."""
        return await self.encode_text(await self.render_chat([m.turn() for m in messages], chat))

    def template_for(self, tools: bool) -> str:
        """The template a chat renders with: the ``tool_use`` one when the request has tools and
        the model has one (as transformers picks), else the default."""
        return self.chat_templates.get("tool_use", self.chat_template) if tools else self.chat_template

    async def render_chat(self, turns: list[dict[str, Any]], chat: ChatOptions | None = None) -> str:
        """The chat's prompt text: the turns (``ChatMessage.turn``) through the template, with
        ``chat``'s tools, template variables and generation prompt.

        Always in a worker thread, however short the chat: the template is the model's code, and
        its cost depends on it, not on the chat (``render_limits`` bounds it). A caller cancelled
        meanwhile (the client left) returns at once and the render stops at its next check."""
        stop = threading.Event()
        try:
            return await trio.to_thread.run_sync(self._render_chat, turns, chat or ChatOptions(), stop,
                                                 limiter=text_limiter(), abandon_on_cancel=True)
        finally:
            stop.set()

    def _render_chat(self, turns: list[dict[str, Any]], chat: ChatOptions, stop: threading.Event | None = None,
                     limits: RenderLimits | None = None) -> str:
        template = self.chat_template if chat.template is None else chat.template
        return self.tokenizer.render_chat(turns, template=template, tools=chat.tools,
                                          add_generation_prompt=chat.add_generation_prompt,
                                          variables=chat.variables, limits=limits or self.render_limits, stop=stop)

    def check_chat_templates(self, limits: RenderLimits | None = None) -> None:
        """Render a sample chat (``SAMPLE_CHAT``) through each of the model's templates under
        ``limits`` (default ``SAMPLE_LIMITS``), as requests will: without tools, and with ``SAMPLE_TOOL`` where the
        template reads ``tools`` (the ``tool_use`` one only with it). ConfigError, naming the
        template and the problem, when one fails, overruns or refuses every sample (some take
        no system turn, so the chat without one is tried next). Run it once, at load."""
        for name, template in {"default": self.chat_template, **self.chat_templates}.items():
            offered = [SAMPLE_TOOL] if template_supports_tools(template) else None
            try:
                for tools in ([] if name == "tool_use" else [None]) + ([offered] if offered else []):
                    self._sample_render(ChatOptions(tools=tools, template=template), limits or SAMPLE_LIMITS)
            except TokenizerError as exc:
                raise ConfigError(f"the model's chat template {name!r} cannot serve chats: {exc}") from exc

    def _sample_render(self, options: ChatOptions, limits: RenderLimits) -> None:
        refusal: TokenizerError | None = None
        for turns in (SAMPLE_CHAT, SAMPLE_CHAT[1:]):
            try:
                self._render_chat(list(turns), options, limits=limits)
                return
            except ChatTemplateError:
                raise
            except TokenizerError as exc:  # the template's raise_exception: try the next sample
                refusal = exc
        raise ChatTemplateError(f"it refuses every sample chat ({refusal})")

    async def encode_text(self, text: str) -> list[int]:
        """``text`` tokenised (in a worker thread when long)."""
        return await off_loop(self.tokenizer.encode, text, size=len(text))

    async def check_constraint(self, constraint: Constraint, param: str = "response_format") -> Constraint:
        """``constraint`` checked up front (a bad schema, regex or grammar is a 400 naming
        ``param``); compiled grammars are cached, so the engine's compile is a cache hit. A big
        source compiles in a worker thread (llguidance releases the GIL meanwhile)."""
        from tinyloop.grammar import validate

        try:
            await off_loop(validate, constraint, self.tokenizer, size=len(constraint.source), inline=2048)
        except RequestError as exc:
            raise ApiError(400, f"Invalid value for '{param}': {exc}", param=param, code="invalid_value") from None
        return constraint

    async def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Text tokenised (in a worker thread when long), or the token ids as given (the
        vocabulary is one of the limits, checked with the others)."""
        if isinstance(prompt, str):
            return await off_loop(self.tokenizer.encode, prompt, size=len(prompt))
        return list(prompt)


@dataclass(frozen=True)
class ChatOptions:
    """How a chat becomes a prompt beyond its messages: the tools handed to the template
    (``tools=`` as transformers passes them; None: none), whether the assistant's turn is
    opened, extra template variables (vLLM's ``chat_template_kwargs``) and the template
    (None: the model's default; ``ServedModel.template_for`` picks)."""

    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    variables: Mapping[str, Any] = field(default_factory=dict)
    template: str | None = None


# What a model's chat templates must render at load (``ServedModel.check_chat_templates``).
SAMPLE_CHAT: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
)
SAMPLE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SAMPLE_LIMITS = RenderLimits(chars=256 * 1024, seconds=1.0)  # a legitimate template needs a millisecond


def render_limits(settings: Settings) -> RenderLimits:
    """What one chat template render may spend: twice the most text a request may bring (its
    body or its prompt characters, whichever limit is larger) and ``chat_template_timeout``."""
    return RenderLimits(chars=2 * max(settings.max_prompt_chars, settings.max_body_bytes),
                        seconds=settings.chat_template_timeout)


def _parameters(engine: Any) -> int | None:
    model = getattr(engine, "model", None)
    return None if model is None else sum(p.numel() for p in model.parameters())


def describe(model: ServedModel) -> dict[str, Any]:
    """What clients are told about the model beyond its id: family, size, dtype, the loop dial
    and the exit rule it runs by default."""
    return {"family": model.arch.removeprefix("tinyloop-"), "parameters": model.parameters,
            "quantization": model.quant, "default_loops": model.default_loops, "max_loops": model.max_loops,
            "exit": {"kind": model.exit.kind, "threshold": model.exit.threshold,
                     "min_loops": model.exit.min_loops, "check_every": model.exit.check_every,
                     "exited_kv": model.exit.exited_kv}}


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
    """The body's sampling fields (``top_k`` -1 is vLLM's "off", as 0; the OpenAI routes'
    ``logit_bias``, ``min_tokens`` and ``include_stop_str_in_output`` where the body has them)."""
    bias = body.bias() if hasattr(body, "bias") else ()
    return SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=seed, stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=bias,
        min_tokens=getattr(body, "min_tokens", 0),
        include_stop_str_in_output=getattr(body, "include_stop_str_in_output", False))


def exit_rule(body: Any) -> ExitRule | None:
    """The body's ``exit`` object as an ExitRule (400 naming ``exit`` when inconsistent)."""
    spec = getattr(body, "exit", None)
    if spec is None:
        return None
    try:
        return ExitRule.of(spec.kind, spec.threshold, min_loops=spec.first_loop(),
                           check_every=spec.check_every, exited_kv=spec.exited_kv)
    except ConfigError as exc:
        raise ApiError(400, f"Invalid value for 'exit': {exc}", param="exit", code="invalid_value") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def asked_max_tokens(body: Any, name: str = "max_tokens") -> tuple[int | None, int | None]:
    """The body's ``name`` as the client sent it (None when it sent none: null and -1 mean the
    same, up to the context's end) and, when it sent none, the route's own default (its schema's:
    16 on ``/v1/completions``, 64 on ``/generate``, none on chat)."""
    if name in body.model_fields_set:
        value = getattr(body, name)
        return (None if value == -1 else value), None
    return None, type(body).model_fields[name].default


def make_requests(body: Any, model: ServedModel, tokens: list[int], *, prompt_param: str,
                  max_tokens_param: str = "max_tokens", n: int = 1,
                  seed: int | None, stop: tuple[str, ...], logprobs: bool, top_logprobs: int,
                  mode: str = "generate", rename: Mapping[str, str] | None = None,
                  **fields: Any) -> Choices:
    """One request per choice; choice ``i`` samples with ``seed + i`` so choices differ.
    The body's ``max_tokens_param`` field is the limit; where the client set none
    (``asked_max_tokens``) the request gets the route's default, at most what is left of the
    model's own context after the prompt (``ModelLimits.max_tokens``). ``fields`` are further
    ``GenerationRequest`` fields (a mode's own: draft loops, beams). The model's limits check
    them at admission (``start_all``), and a refusal is a 400 naming the field the client set:
    ``prompt_param`` for the prompt, ``max_tokens_param`` for ``max_tokens``, ``rename`` for the
    rest."""
    if not tokens:
        raise ApiError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
    asked, default = asked_max_tokens(body, max_tokens_param)
    room = model.limits.max_seq_len - len(tokens)
    if room < 1 and asked != 0:  # the prompt's fault, whatever max_tokens says (0: only scored)
        raise ApiError(400, f"the prompt is {len(tokens)} tokens; this model's context is "
                       f"{model.limits.max_seq_len} tokens, prompt and completion together",
                       param=prompt_param, code="context_length_exceeded")
    limit = model.limits.max_tokens(len(tokens), asked, default)
    out = []
    blame = {"prompt": prompt_param, "max_tokens": max_tokens_param, **(rename or {})}
    with _blaming(blame):
        for i in range(n):
            choice_seed = None if seed is None else (seed + i) % 2**63
            sampling = sampling_from(body, seed=choice_seed, stop=stop, logprobs=logprobs,
                                     top_logprobs=top_logprobs)
            out.append(GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=limit, mode=mode,
                                         loops=body.loops, cache_window=body.cache_window,
                                         warm_start=bool(body.warm_start),
                                         warm_start_from="normed" if body.warm_start == "normed" else "raw",
                                         sampling=sampling,
                                         exit=exit_rule(body), **fields))
    return Choices(out, blame)


@dataclass(frozen=True)
class Choices:
    """The requests of one body (one per choice) and the body's name for each request field."""

    requests: list[GenerationRequest]
    blame: Mapping[str, str]


@contextmanager
def _blaming(rename: Mapping[str, str]) -> Iterator[None]:
    """A ``RequestError`` becomes its 400, naming the body's field for the request's."""
    try:
        yield
    except RequestError as exc:
        err = from_exception(exc)
        err.param = rename.get(err.param, err.param) if err.param is not None else None
        raise err from None


@contextmanager
def _all_or_none(streams: Sequence[RequestStream]) -> Iterator[None]:
    """On any failure cancel every stream; TinyLoop errors become their HTTP error."""
    try:
        yield
    except BaseException as exc:
        for s in streams:
            s.cancel()
        if isinstance(exc, Exception) and not isinstance(exc, ApiError):
            raise from_exception(exc) from exc
        raise


async def start_all(rt: Runtime, choices: Choices, priority: int,
                    slo_ms: float | None, *, streaming: bool) -> list[RequestStream]:
    """Admit every request (all or none: a refusal cancels the ones already admitted; the
    runtime's check against the model's limits is a 400 naming the body's field);
    ``streaming`` is the body's ``stream``: only streamed requests count in ``first_token_ms``.

    The choices are admitted one by one and each must find the queue below
    ``max_queue_depth``; the engine's free slots drain the queue only as fast as the dispatcher
    runs. So more than ``max_queue_depth + max_batch_size`` choices are never admitted, and
    more than ``max_queue_depth`` only by luck of timing on an idle server (never while every
    slot is busy). Such an ``n`` is the request's fault (400 naming ``n``, checked before
    anything is admitted), not an overload to retry (503 with ``Retry-After``)."""
    reqs = choices.requests
    depth = rt.settings.max_queue_depth
    if len(reqs) > depth:
        raise ApiError(400, f"n={len(reqs)} choices cannot all be queued together: this server "
                       f"queues at most {depth} requests (--max-queue-depth)", param="n",
                       code="invalid_value")
    streams: list[RequestStream] = []
    with _all_or_none(streams), _blaming(choices.blame):
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


def sse_response(events: AsyncGenerator[bytes, None], streams: Sequence[RequestStream],
                 headers: Mapping[str, str] | None = None) -> Response:
    """An SSE response over ``events`` (guarded by ``sse_guard``), with no response timeout."""
    response = Response(sse_guard(events, streams), content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", **(headers or {})})
    response.timeout = None
    return response


def sse_guard(events: AsyncGenerator[bytes, None],
              streams: Sequence[RequestStream]) -> AsyncIterator[bytes]:
    """Wrap an SSE body: a failure after streaming began becomes an error event then [DONE];
    a client that goes away cancels every stream; a graceful shutdown about to cut the stream
    (the app's ``Drain``) ends it the same way, with a ``shutting down`` error. The drain's
    cancel scope is only set up around a wait for the engine: while every stream has a chunk
    (or its end) ready, the cut-off is checked by the clock instead. Call it in the request
    context: the body runs after that context ended."""
    from tinyloop.errors import SchedulerShutdown
    from tinyloop.http.drain import DRAIN_KEY, Drain

    drain: Drain = current_app.extensions.get(DRAIN_KEY) or Drain()

    def cut_off() -> SchedulerShutdown:
        return SchedulerShutdown(f"shutting down: {drain.reason}")

    async def guarded() -> AsyncIterator[bytes]:
        try:
            # closed here when the client goes away mid-stream (not left to the GC, where Trio
            # warns about an unfinished async generator)
            async with aclosing(events):
                while True:
                    if all(s.ready for s in streams):  # no wait for the engine: no scope needed
                        if trio.current_time() >= drain.cut_at:
                            raise cut_off()
                        chunk = await anext(events, None)
                    else:
                        with drain.watch() as cut:  # no yield inside the scope
                            chunk = await anext(events, None)
                        if cut.cancelled_caught:
                            raise cut_off()
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
