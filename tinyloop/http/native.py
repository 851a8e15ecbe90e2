"""TinyLoop's native routes: ``/generate`` with every knob, speculative variants, tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from quart import Blueprint, Response, jsonify

from tinyloop.actors.stream import RequestStream
from tinyloop.http.errors import ApiError
from tinyloop.http.schemas import (
    DetokenizeRequest, GenerateRequest, SpeculativeRequest, TokenizeRequest, TreeSpeculativeRequest,
)
from tinyloop.http.service import DONE, collect, make_requests, new_id, parse_body, served, sse, sse_guard, start_all
from tinyloop.requests import GenerationResult

__all__ = ["blueprint"]

blueprint = Blueprint("native", __name__)


def result_json(rid: str, r: GenerationResult) -> dict[str, Any]:
    out = dataclasses.asdict(r)
    out["id"] = rid
    out["loops"] = out.pop("loops_used")
    if r.logprobs is not None:
        out["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                            "top": [[t, v] for t, v in lp.top]} for lp in r.logprobs]
    return out


@blueprint.post("/generate")
async def generate() -> Response:
    s = served()
    body: GenerateRequest = await parse_body(GenerateRequest)
    tokens = s.model.encode_prompt(body.prompt if body.prompt is not None else body.prompt_tokens or [],
                                   "prompt" if body.prompt is not None else "prompt_tokens")
    s.model.check_context(tokens, "prompt" if body.prompt is not None else "prompt_tokens")
    reqs = make_requests(body, s.model, tokens, body.max_tokens, 1, seed=body.sample_seed,
                         stop=tuple(body.stop or ()), logprobs=body.logprobs or body.top_logprobs > 0,
                         top_logprobs=body.top_logprobs)
    streams = await start_all(s.runtime, reqs, body.priority, body.slo_ms)
    rid = new_id("gen")
    if body.stream:
        response = Response(sse_guard(_events(rid, streams[0]), streams),
                            content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        response.timeout = None
        return response
    return jsonify(result_json(rid, (await collect(streams))[0]))


async def _events(rid: str, stream: RequestStream) -> AsyncGenerator[bytes, None]:
    async for c in stream:
        event: dict[str, Any] = {"id": rid, "index": c.index, "token_id": c.token_id, "text": c.text,
                                 "loops": c.loops_used}
        if c.logprob is not None:
            event["logprob"] = c.logprob.logprob
        yield sse(event)
    assert stream.result is not None
    yield sse({"done": True, **result_json(rid, stream.result)})
    yield DONE


@blueprint.post("/generate/speculative")
async def speculative() -> Response:
    await parse_body(SpeculativeRequest)
    raise ApiError(501, "chain self-speculative decoding is not available in this build yet",
                   code="not_implemented")


@blueprint.post("/generate/tree_speculative")
async def tree_speculative() -> Response:
    await parse_body(TreeSpeculativeRequest)
    raise ApiError(501, "tree self-speculative decoding is not available in this build yet",
                   code="not_implemented")


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    s = served()
    body: TokenizeRequest = await parse_body(TokenizeRequest)
    s.model.check_name(body.model)
    if body.messages is not None:
        tokens = s.model.encode_chat(body.messages)
    else:
        tokens = s.model.tokenizer.encode(body.prompt or "")
    return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": s.model.max_seq_len})


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    s = served()
    body: DetokenizeRequest = await parse_body(DetokenizeRequest)
    s.model.check_name(body.model)
    bad = [t for t in body.tokens if t >= s.model.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary ({s.model.vocab_size})",
                       param="tokens", code="invalid_value")
    return jsonify({"text": s.model.tokenizer.decode(body.tokens, skip_special=False)})
