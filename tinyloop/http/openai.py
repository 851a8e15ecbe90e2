"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Chat and text completions are one pipeline (parse, build the prompts, check, admit, then JSON or
SSE) over a ``Flavour`` that says how the prompts are built and how a choice looks. A text
completion may carry several prompts (a list of strings or of token-id lists): each is a group
of ``n`` choices, ``index = prompt * n + choice`` as OpenAI numbers them, all admitted together
(all or none). ``install`` adds the four routes to a blueprint: here under ``/v1``; LM Studio's
``/api/v0`` routes are the same with ``lmstudio=True`` (its model card, and ``stats``,
``model_info`` and ``runtime`` on each response, on the final chunk when streaming).

What a chat reply becomes (reasoning split off, tool calls parsed) is ``chat.py``'s; the echo
and prompt logprobs of a text completion are ``formats.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from quart import Blueprint, Response, jsonify

from tinyloop.actors.stream import RequestStream
from tinyloop.errors import TokenizerError
from tinyloop.http.chat import ChatPlan, Reply, plan_chat
from tinyloop.http.errors import ApiError
from tinyloop.http.formats import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    lmstudio_extras,
    model_card,
    prompt_logprobs,
    usage,
)
from tinyloop.http.schemas import ChatCompletionRequest, CompletionRequest, OpenAIBase
from tinyloop.http.service import (
    DONE,
    Choices,
    ServedModel,
    asked_max_tokens,
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
from tinyloop.requests import Constraint, GenerationResult, TokenLogprob
from tinyloop.tokenizer import Tokenizer

__all__ = ["CHAT", "TEXT", "Flavour", "blueprint", "complete", "install"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a body: its tokens, and its text (what ``echo`` repeats)."""

    tokens: list[int]
    text: str


@dataclass(frozen=True, slots=True)
class Plan:
    """A body made ready: its prompts, the constraint on the output, how replies are shaped."""

    prompts: list[Prompt]
    constraint: Constraint | None
    reply: Callable[[], Reply]  # a new reply shaper per choice


@dataclass(frozen=True, slots=True)
class Flavour:
    """What chat and text completions do differently; the pipeline (``complete``) is shared."""

    schema: type[ChatCompletionRequest | CompletionRequest]
    id_prefix: str  # of the response id
    object: str  # of the response
    chunk_object: str  # of each streamed chunk
    prompt_param: str  # the field a prompt error names
    plan: Callable[[ServedModel, Any], Awaitable[Plan]]
    max_tokens_param: Callable[[Any], str]  # the body's field that holds the limit
    logprobs: Callable[[Any], tuple[bool, int]]  # whether logprobs are asked, how many alternatives
    render_logprobs: Callable[[Tokenizer, list[TokenLogprob] | None, int], dict[str, Any] | None]
    opening: dict[str, Any] | None = None  # each choice's first streamed chunk, before any token


async def _chat_plan(model: ServedModel, body: ChatCompletionRequest) -> Plan:
    chat: ChatPlan = await plan_chat(model, body)
    return Plan([Prompt(chat.tokens, chat.prompt_text)], chat.constraint, chat.reply)


async def _text_plan(model: ServedModel, body: CompletionRequest) -> Plan:
    prompts = []
    for p in body.prompts():
        tokens = await model.encode_prompt(p)
        prompts.append(Prompt(tokens, p if isinstance(p, str) else _echoed(model, tokens) if body.echo else ""))
    return Plan(prompts, body.constraint(), Reply.text)


def _echoed(model: ServedModel, tokens: list[int]) -> str:
    """The text of a token prompt, for ``echo`` (400 naming ``prompt`` for an id past the vocabulary)."""
    try:
        return model.tokenizer.decode(tokens, skip_special=False)
    except TokenizerError as exc:
        raise ApiError(400, str(exc), param="prompt", code="invalid_value") from None


def _max_tokens_param(body: Any) -> str:
    return "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"


CHAT = Flavour(
    ChatCompletionRequest, "chatcmpl", "chat.completion", "chat.completion.chunk", "messages",
    plan=_chat_plan, max_tokens_param=_max_tokens_param,
    logprobs=lambda body: (body.logprobs, body.top_logprobs or 0),
    render_logprobs=lambda tok, lps, offset: chat_logprobs(tok, lps),
    opening={"delta": {"role": "assistant", "content": ""}})

TEXT = Flavour(
    CompletionRequest, "cmpl", "text_completion", "text_completion", "prompt",
    plan=_text_plan, max_tokens_param=_max_tokens_param,
    logprobs=lambda body: (body.logprobs is not None, body.logprobs or 0),
    render_logprobs=completion_logprobs)


def speculation(body: OpenAIBase) -> dict[str, Any]:
    """The request fields of ``body.speculation``: a chain, or a tree with several branches."""
    spec = body.speculation
    if spec is None:
        return {}
    return {"mode": "speculative" if spec.branches == 1 else "tree", "draft_loops": spec.draft_loops,
            "draft_ahead": spec.draft_ahead, "k_branches": spec.branches if spec.branches > 1 else None}


def choice(index: int, content: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish}


Extras = Callable[[GenerationResult], dict[str, Any]]


def _prompt_logprobs_wanted(flavour: Flavour, body: Any) -> int | None:
    """How many alternatives each prompt token's logprob needs (None: not asked): an echo
    with logprobs asks as many as the completion's, vLLM's ``prompt_logprobs`` its own."""
    wanted = [body.prompt_logprobs] if body.prompt_logprobs is not None else []
    if flavour is TEXT and body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    return max(wanted) if wanted else None


async def complete(flavour: Flavour, *, lmstudio: bool) -> Response:
    """One chat or text completion: JSON, or SSE when ``stream``."""
    s = served()
    body = await parse_body(flavour.schema)
    s.model.check_name(body.model)
    plan = await flavour.plan(s.model, body)
    max_tokens_param = flavour.max_tokens_param(body)
    want_lp, top_lp = flavour.logprobs(body)
    fields = {**speculation(body), "prompt_logprobs": _prompt_logprobs_wanted(flavour, body)}
    if plan.constraint is not None:
        fields["constraint"] = await s.model.check_constraint(plan.constraint)
    groups = [make_requests(body, s.model, p.tokens, prompt_param=flavour.prompt_param,
                            max_tokens_param=max_tokens_param, n=body.n, seed=body.seed,
                            stop=body.stop_list(), logprobs=want_lp, top_logprobs=top_lp, **fields)
              for p in plan.prompts]
    reqs = Choices([r for g in groups for r in g.requests], groups[0].blame)
    streams = await start_all(s.runtime, reqs, body.priority, body.slo_ms, streaming=body.stream)
    head = {"id": new_id(flavour.id_prefix), "created": int(time.time()), "model": s.model.id}
    context_limited = asked_max_tokens(body, max_tokens_param) == (None, None)  # no limit but the context
    echo = [p for p in plan.prompts for _ in range(body.n)] if flavour is TEXT and body.echo else None

    def extras(result: GenerationResult) -> dict[str, Any]:
        return lmstudio_extras(s.model, result, s.settings.commit, context_limited) if lmstudio else {}

    if body.stream:
        opts = body.stream_options
        events = _events(flavour, s.model.tokenizer, streams, head, plan, echo, body.n,
                         bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats), extras)
        return sse_response(events, streams, {"X-Accel-Buffering": "no"})
    results = await collect(streams)
    tok = s.model.tokenizer
    choices = []
    for i, r in enumerate(results):
        content, finish = plan.reply().whole(r.text, r.finish_reason)
        logprobs = flavour.render_logprobs(tok, r.logprobs, 0) if want_lp else None
        if echo is not None:
            content = {"text": echo[i].text + content["text"]}
            if want_lp:
                logprobs = echo_logprobs(tok, echo[i].tokens, r.prompt_logprobs, r.logprobs)
        c = choice(i, content, logprobs, finish)
        if body.prompt_logprobs is not None and flavour is TEXT:
            c["prompt_logprobs"] = prompt_logprobs(tok, r.prompt_logprobs, body.prompt_logprobs)
        choices.append(c)
    out = {**head, "object": flavour.object, "system_fingerprint": None, "choices": choices,
           "usage": usage(results, body.n)}
    if body.prompt_logprobs is not None and flavour is CHAT:  # vLLM: one list for the chat's one prompt
        out["prompt_logprobs"] = prompt_logprobs(tok, results[0].prompt_logprobs, body.prompt_logprobs)
    return jsonify({**out, **extras(results[0])})


async def _events(flavour: Flavour, tok: Tokenizer, streams: list[RequestStream], head: dict[str, Any],
                  plan: Plan, echo: list[Prompt] | None, n: int, include_usage: bool, continuous: bool,
                  extras: Extras) -> AsyncGenerator[bytes, None]:
    """The SSE body: every choice's chunks, interleaved as they decode (what piled up for a slow
    connection goes out in one write), then the usage chunk when asked for, then [DONE]. With
    ``continuous`` (vLLM's ``continuous_usage_stats``) every chunk carries its choice's usage so far."""
    base = {**head, "object": flavour.chunk_object, "system_fingerprint": None}
    prompt_sizes = [len(p.tokens) for p in plan.prompts for _ in range(n)]
    produced = [0] * len(streams)

    def chunk(index: int, content: dict[str, Any], logprobs: Any = None, finish: str | None = None,
              **extra: Any) -> bytes:
        so_far = None
        if continuous:
            so_far = {"prompt_tokens": prompt_sizes[index], "completion_tokens": produced[index],
                      "total_tokens": prompt_sizes[index] + produced[index]}
        return sse({**base, "choices": [choice(index, content, logprobs, finish)], "usage": so_far, **extra})

    replies = [plan.reply() for _ in streams]
    if flavour.opening is not None:
        yield b"".join(chunk(i, flavour.opening) for i in range(len(streams)))
    if echo is not None:
        yield b"".join(chunk(i, {"text": p.text}) for i, p in enumerate(echo))
    offsets = [len(p.text) for p in echo] if echo is not None else [0] * len(streams)  # text so far, per choice
    async with aclosing(interleave(streams)) as turns:
        async for i, burst in turns:
            events: list[bytes] = []
            for c in burst:
                produced[i] += 1
                lp = None if c.logprob is None else flavour.render_logprobs(tok, [c.logprob], offsets[i])
                offsets[i] += len(c.text)
                deltas = replies[i].feed(c.text)
                if lp is not None and not deltas:
                    deltas = [replies[i].empty()]
                events.extend(chunk(i, d, lp if k == 0 else None) for k, d in enumerate(deltas))
            if not burst:  # choice i ended
                result = streams[i].result
                assert result is not None
                tail, finish = replies[i].finish(result.finish_reason)
                events.extend(chunk(i, d) for d in tail)
                events.append(chunk(i, replies[i].last(), None, finish, **extras(result)))
            if events:
                yield b"".join(events)
    if include_usage:
        done = [st.result for st in streams if st.result is not None]
        yield sse({**base, "choices": [], "usage": usage(done, n)})
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
