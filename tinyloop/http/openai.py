"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Chat and text completions are one pipeline (parse, tokenise, check, admit, then JSON or SSE)
over a ``Flavour`` that says how the prompt is built and how a choice looks. ``install`` adds the
four routes to a blueprint: here under ``/v1``; LM Studio's ``/api/v0`` routes are the same with
``lmstudio=True`` (its model card, and ``stats``, ``model_info`` and ``runtime`` on each
response, on the final chunk when streaming).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from quart import Blueprint, Response, jsonify

from tinyloop.actors.stream import RequestStream
from tinyloop.http.formats import chat_logprobs, completion_logprobs, lmstudio_extras, model_card, usage
from tinyloop.http.schemas import ChatCompletionRequest, CompletionRequest, Sampling
from tinyloop.http.service import (
    DONE,
    ServedModel,
    collect,
    interleave,
    make_requests,
    new_id,
    parse_body,
    served,
    sse,
    sse_response,
    start_all,
)
from tinyloop.requests import GenerationResult, TokenLogprob
from tinyloop.tokenizer import Tokenizer

__all__ = ["CHAT", "TEXT", "Flavour", "blueprint", "complete", "install"]


@dataclass(frozen=True, slots=True)
class Flavour:
    """What chat and text completions do differently; the pipeline (``complete``) is shared."""

    schema: type[ChatCompletionRequest | CompletionRequest]
    id_prefix: str  # of the response id
    object: str  # of the response
    chunk_object: str  # of each streamed chunk
    prompt_param: str  # the field a prompt error names
    tokens: Callable[[ServedModel, Any], Awaitable[list[int]]]  # the body's prompt, tokenised
    max_tokens: Callable[[Any], tuple[int | None, str]]  # the limit (None, -1: to the context end), its field
    logprobs: Callable[[Any], tuple[bool, int]]  # whether logprobs are asked, how many alternatives
    render_logprobs: Callable[[Tokenizer, list[TokenLogprob] | None, int], dict[str, Any] | None]
    message: Callable[[str], dict[str, Any]]  # a whole choice's content
    delta: Callable[[str | None], dict[str, Any]]  # a streamed choice's new text (None: the last chunk)
    opening: dict[str, Any] | None = None  # each choice's first streamed chunk, before any token


CHAT = Flavour(
    ChatCompletionRequest, "chatcmpl", "chat.completion", "chat.completion.chunk", "messages",
    tokens=lambda model, body: model.encode_chat(body.messages),
    max_tokens=lambda body: (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
    else (body.max_tokens, "max_tokens"),
    logprobs=lambda body: (body.logprobs, body.top_logprobs or 0),
    render_logprobs=lambda tok, lps, offset: chat_logprobs(tok, lps),
    message=lambda text: {"message": {"role": "assistant", "content": text}},
    delta=lambda text: {"delta": {} if text is None else {"content": text}},
    opening={"delta": {"role": "assistant", "content": ""}})

TEXT = Flavour(
    CompletionRequest, "cmpl", "text_completion", "text_completion", "prompt",
    tokens=lambda model, body: model.encode_prompt(body.prompt),
    max_tokens=lambda body: (body.max_tokens, "max_tokens"),
    logprobs=lambda body: (body.logprobs is not None, body.logprobs or 0),
    render_logprobs=completion_logprobs,
    message=lambda text: {"text": text},
    delta=lambda text: {"text": text or ""})


def speculation(body: Sampling) -> dict[str, Any]:
    """The request fields of ``body.speculation``: a chain, or a tree with several branches."""
    spec = body.speculation
    if spec is None:
        return {}
    return {"mode": "speculative" if spec.branches == 1 else "tree", "draft_loops": spec.draft_loops,
            "draft_ahead": spec.draft_ahead, "k_branches": spec.branches if spec.branches > 1 else None}


def choice(index: int, content: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish}


Extras = Callable[[GenerationResult], dict[str, Any]]


async def complete(flavour: Flavour, *, lmstudio: bool) -> Response:
    """One chat or text completion: JSON, or SSE when ``stream``."""
    s = served()
    body = await parse_body(flavour.schema)
    s.model.check_name(body.model)
    tokens = await flavour.tokens(s.model, body)
    max_tokens, max_tokens_param = flavour.max_tokens(body)
    want_lp, top_lp = flavour.logprobs(body)
    reqs = make_requests(body, s.model, tokens, prompt_param=flavour.prompt_param, max_tokens=max_tokens,
                         max_tokens_param=max_tokens_param, n=body.n, seed=body.seed,
                         stop=body.stop_list(), logprobs=want_lp, top_logprobs=top_lp,
                         **speculation(body))
    streams = await start_all(s.runtime, reqs, body.priority, body.slo_ms, streaming=body.stream)
    head = {"id": new_id(flavour.id_prefix), "created": int(time.time()), "model": s.model.id}
    context_limited = max_tokens in (None, -1)

    def extras(result: GenerationResult) -> dict[str, Any]:
        return lmstudio_extras(s.model, result, s.settings.commit, context_limited) if lmstudio else {}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(flavour, s.model.tokenizer, streams, head, include_usage, extras)
        return sse_response(events, streams, {"X-Accel-Buffering": "no"})
    results = await collect(streams)
    tok = s.model.tokenizer
    choices = [choice(i, flavour.message(r.text), flavour.render_logprobs(tok, r.logprobs, 0) if want_lp
                      else None, r.finish_reason) for i, r in enumerate(results)]
    return jsonify({**head, "object": flavour.object, "system_fingerprint": None, "choices": choices,
                    "usage": usage(results), **extras(results[0])})


async def _events(flavour: Flavour, tok: Tokenizer, streams: list[RequestStream], head: dict[str, Any],
                  include_usage: bool, extras: Extras) -> AsyncGenerator[bytes, None]:
    """The SSE body: every choice's chunks, interleaved as they decode (what piled up for a slow
    connection goes out in one write), then the usage chunk when asked for, then [DONE]."""
    base = {**head, "object": flavour.chunk_object, "system_fingerprint": None}

    def chunk(index: int, content: dict[str, Any], logprobs: Any = None, finish: str | None = None,
              **extra: Any) -> bytes:
        return sse({**base, "choices": [choice(index, content, logprobs, finish)], "usage": None, **extra})

    if flavour.opening is not None:
        yield b"".join(chunk(i, flavour.opening) for i in range(len(streams)))
    offsets = [0] * len(streams)  # text so far, per choice (text logprobs' offsets)
    async with aclosing(interleave(streams)) as turns:
        async for i, burst in turns:
            events = []
            for c in burst:
                lp = None if c.logprob is None else flavour.render_logprobs(tok, [c.logprob], offsets[i])
                offsets[i] += len(c.text)
                if c.text or lp is not None:
                    events.append(chunk(i, flavour.delta(c.text), lp))
            if not burst:  # choice i ended
                result = streams[i].result
                assert result is not None
                events.append(chunk(i, flavour.delta(None), None, result.finish_reason, **extras(result)))
            if events:
                yield b"".join(events)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage([st.result for st in streams if st.result is not None])})
    yield DONE


def install(bp: Blueprint, *, lmstudio: bool) -> Blueprint:
    """Add the model and completion routes to ``bp`` (LM Studio's shapes with ``lmstudio``)."""

    async def list_models() -> Response:
        return jsonify({"object": "list", "data": [model_card(served().model, lmstudio=lmstudio)]})

    async def get_model(name: str) -> Response:
        model = served().model
        model.check_name(name)
        return jsonify(model_card(model, lmstudio=lmstudio))

    async def chat_completions() -> Response:
        return await complete(CHAT, lmstudio=lmstudio)

    async def completions() -> Response:
        return await complete(TEXT, lmstudio=lmstudio)

    bp.add_url_rule("/models", view_func=list_models, methods=["GET"])
    bp.add_url_rule("/models/<path:name>", view_func=get_model, methods=["GET"])
    bp.add_url_rule("/chat/completions", view_func=chat_completions, methods=["POST"])
    bp.add_url_rule("/completions", view_func=completions, methods=["POST"])
    return bp


blueprint = install(Blueprint("openai", __name__, url_prefix="/v1"), lmstudio=False)
