"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

The handlers take a ``lmstudio`` flag: LM Studio's ``/api/v0`` routes are the same objects plus
``stats``, ``model_info`` and ``runtime`` (on the final chunk when streaming).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from quart import Blueprint, Response, jsonify

from tinyloop.actors.stream import RequestStream
from tinyloop.http.formats import chat_logprobs, completion_logprobs, lmstudio_extras, model_card, usage
from tinyloop.http.schemas import ChatCompletionRequest, CompletionRequest, Sampling
from tinyloop.http.service import (
    DONE, Served, collect, interleave, make_requests, new_id, parse_body, served, sse, sse_guard,
    start_all,
)
from tinyloop.requests import GenerationChunk, GenerationResult

__all__ = ["blueprint", "chat_completions", "completions"]

blueprint = Blueprint("openai", __name__, url_prefix="/v1")


def speculation(body: Sampling) -> dict[str, Any]:
    """The request fields of ``body.speculation``: a chain, or a tree with several branches."""
    spec = body.speculation
    if spec is None:
        return {}
    return {"mode": "speculative" if spec.branches == 1 else "tree", "draft_loops": spec.draft_loops,
            "draft_ahead": spec.draft_ahead, "k_branches": spec.branches if spec.branches > 1 else None}


@blueprint.get("/models")
async def list_models() -> Response:
    return jsonify({"object": "list", "data": [model_card(served().model, lmstudio=False)]})


@blueprint.get("/models/<path:name>")
async def get_model(name: str) -> Response:
    model = served().model
    model.check_name(name)
    return jsonify(model_card(model, lmstudio=False))


@blueprint.post("/chat/completions")
async def chat_route() -> Response:
    return await chat_completions(lmstudio=False)


@blueprint.post("/completions")
async def completions_route() -> Response:
    return await completions(lmstudio=False)


def _stream_response(body: AsyncGenerator[bytes, None], streams: list[RequestStream]) -> Response:
    response = Response(sse_guard(body, streams), content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None
    return response


async def chat_completions(*, lmstudio: bool) -> Response:
    s = served()
    body: ChatCompletionRequest = await parse_body(ChatCompletionRequest)
    s.model.check_name(body.model)
    tokens = await s.model.encode_chat(body.messages)
    s.model.check_context(tokens, "messages")
    max_tokens = body.max_completion_tokens or body.max_tokens
    reqs = make_requests(body, s.model, tokens, max_tokens, body.n, seed=body.seed,
                         stop=body.stop_list(), logprobs=body.logprobs,
                         top_logprobs=body.top_logprobs or 0,
                         max_tokens_param="max_completion_tokens" if body.max_completion_tokens
                         else "max_tokens", **speculation(body))
    context_limited = max_tokens in (None, -1)
    streams = await start_all(s.runtime, reqs, body.priority, body.slo_ms, streaming=body.stream)
    rid, created = new_id("chatcmpl"), int(time.time())
    head = {"id": rid, "created": created, "model": s.model.id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream_response(_chat_events(s, streams, head, include_usage, lmstudio, context_limited),
                                streams)
    results = await collect(streams)
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                "logprobs": chat_logprobs(s.model.tokenizer, r.logprobs) if body.logprobs else None,
                "finish_reason": r.finish_reason} for i, r in enumerate(results)]
    out: dict[str, Any] = {**head, "object": "chat.completion", "system_fingerprint": None,
                           "choices": choices, "usage": usage(results)}
    if lmstudio:
        out.update(lmstudio_extras(s.model, results[0], s.settings.commit, context_limited))
    return jsonify(out)


async def _choice_events(streams: list[RequestStream],
                         token: Callable[[int, GenerationChunk], bytes | None],
                         end: Callable[[int, GenerationResult], bytes]) -> AsyncGenerator[bytes, None]:
    """The SSE body of every choice, interleaved as they decode: ``token`` renders a chunk of
    choice ``i`` (None: nothing to send), ``end`` its final event. What piled up for a slow
    connection goes out in one write."""
    async with aclosing(interleave(streams)) as turns:
        async for i, burst in turns:
            events = [e for c in burst if (e := token(i, c)) is not None]
            if not burst:
                result = streams[i].result
                assert result is not None
                events.append(end(i, result))
            if events:
                yield b"".join(events)


async def _chat_events(s: Served, streams: list[RequestStream], head: dict[str, Any],
                       include_usage: bool, lmstudio: bool,
                       context_limited: bool) -> AsyncGenerator[bytes, None]:
    base = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: Any = None, **extra: Any) -> bytes:
        return sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}], "usage": None, **extra})

    def token(i: int, c: GenerationChunk) -> bytes | None:
        lp = None if c.logprob is None else chat_logprobs(s.model.tokenizer, [c.logprob])
        return chunk(i, {"content": c.text}, logprobs=lp) if c.text or lp is not None else None

    def end(i: int, result: GenerationResult) -> bytes:
        extra = lmstudio_extras(s.model, result, s.settings.commit, context_limited) if lmstudio else {}
        return chunk(i, {}, result.finish_reason, **extra)

    yield b"".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(len(streams)))
    async with aclosing(_choice_events(streams, token, end)) as events:
        async for event in events:
            yield event
    results = [st.result for st in streams if st.result is not None]  # all ended
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(results)})
    yield DONE


async def completions(*, lmstudio: bool) -> Response:
    s = served()
    body: CompletionRequest = await parse_body(CompletionRequest)
    s.model.check_name(body.model)
    tokens = await s.model.encode_prompt(body.prompt)
    s.model.check_context(tokens, "prompt")
    want_lp = body.logprobs is not None
    reqs = make_requests(body, s.model, tokens, body.max_tokens, body.n, seed=body.seed,
                         stop=body.stop_list(), logprobs=want_lp, top_logprobs=body.logprobs or 0,
                         **speculation(body))
    context_limited = body.max_tokens in (None, -1)
    streams = await start_all(s.runtime, reqs, body.priority, body.slo_ms, streaming=body.stream)
    head = {"id": new_id("cmpl"), "created": int(time.time()), "model": s.model.id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream_response(
            _completion_events(s, streams, head, include_usage, lmstudio, context_limited), streams)
    results = await collect(streams)
    choices = [{"index": i, "text": r.text,
                "logprobs": completion_logprobs(s.model.tokenizer, r.logprobs) if want_lp else None,
                "finish_reason": r.finish_reason} for i, r in enumerate(results)]
    out: dict[str, Any] = {**head, "object": "text_completion", "system_fingerprint": None,
                           "choices": choices, "usage": usage(results)}
    if lmstudio:
        out.update(lmstudio_extras(s.model, results[0], s.settings.commit, context_limited))
    return jsonify(out)


async def _completion_events(s: Served, streams: list[RequestStream], head: dict[str, Any],
                             include_usage: bool, lmstudio: bool,
                             context_limited: bool) -> AsyncGenerator[bytes, None]:
    base = {**head, "object": "text_completion", "system_fingerprint": None}

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None,
              **extra: Any) -> bytes:
        return sse({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}], "usage": None, **extra})

    offsets = [0] * len(streams)

    def token(i: int, c: GenerationChunk) -> bytes | None:
        lp = None
        if c.logprob is not None:
            lp = completion_logprobs(s.model.tokenizer, [c.logprob], offsets[i])
        offsets[i] += len(c.text)
        return chunk(i, c.text, logprobs=lp) if c.text or lp is not None else None

    def end(i: int, result: GenerationResult) -> bytes:
        extra = lmstudio_extras(s.model, result, s.settings.commit, context_limited) if lmstudio else {}
        return chunk(i, "", result.finish_reason, **extra)

    async with aclosing(_choice_events(streams, token, end)) as events:
        async for event in events:
            yield event
    results = [st.result for st in streams if st.result is not None]  # all ended
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(results)})
    yield DONE
