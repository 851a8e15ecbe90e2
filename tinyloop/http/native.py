"""TinyLoop's native routes: ``/generate`` with every knob (and beam search, ``num_beams > 1``,
whose result adds ``beam_score``), its self-speculative variants (chain and tree, same response
plus the draft counts), tokenizer (``/tokenize``, ``/detokenize`` and vLLM's ``/tokenizer_info``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, Callable
from functools import lru_cache, partial
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any

from quart import Blueprint, Response, current_app, jsonify

from tinyloop.actors.stream import RequestStream
from tinyloop.http.bodies import off_loop
from tinyloop.http.errors import ApiError
from tinyloop.http.formats import draft_stats
from tinyloop.http.schemas import (
    DetokenizeRequest,
    GenerateBase,
    GenerateRequest,
    SpeculativeRequest,
    TokenizeRequest,
    TreeSpeculativeRequest,
)
from tinyloop.http.service import DONE, collect, make_requests, new_id, parse_body, served, sse, sse_response, start_all
from tinyloop.requests import GenerationChunk, GenerationResult
from tinyloop.tokenizer import Tokenizer, hf_tokenizer_config

__all__ = ["blueprint", "TokenizeBody"]

blueprint = Blueprint("native", __name__)


_OPTIONAL_FIELDS = ("draft_tokens", "accepted_draft_tokens", "rejected_draft_tokens", "beam_score", "prompt_logprobs")


def result_json(rid: str, r: GenerationResult) -> dict[str, Any]:
    """The result as JSON; the draft counts only for speculative requests, the score for beam."""
    out = dataclasses.asdict(r)
    for name in _OPTIONAL_FIELDS:
        if out[name] is None:
            del out[name]
    out["id"] = rid
    out["loops"] = out.pop("loops_used")
    if stats := draft_stats(r):  # a speculative result's counts, under LM Studio's stats names
        out["stats"] = stats
    if r.logprobs is not None:
        out["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                            "top": [[t, v] for t, v in lp.top]} for lp in r.logprobs]
    return out


@blueprint.post("/generate")
async def generate() -> Response:
    body: GenerateRequest = await parse_body(GenerateRequest)
    if body.num_beams > 1:
        return await _generate(body, "beam", num_beams=body.num_beams,
                               length_penalty=body.length_penalty)
    return await _generate(body, "generate")


async def _generate(body: GenerateBase, mode: str, rename: dict[str, str] | None = None,
                    **fields: Any) -> Response:
    """Run one native generation (plain, beam or speculative): JSON, or SSE when ``stream``
    (a beam search streams all its tokens in one burst, once it ends)."""
    s = served()
    text = body.prompt is not None
    tokens = await s.model.encode_prompt(body.prompt if body.prompt is not None else body.prompt_tokens or [])
    constraint = body.constraint()
    if constraint is not None:  # structured output: checked up front, blamed on its own field
        param = body.constraint_param()
        fields["constraint"] = await s.model.check_constraint(constraint, param)
        rename = {"response_format": param, **(rename or {})}
    reqs = make_requests(body, s.model, tokens, prompt_param="prompt" if text else "prompt_tokens",
                         seed=body.sample_seed, stop=tuple(body.stop or ()),
                         logprobs=body.logprobs or body.top_logprobs > 0,
                         top_logprobs=body.top_logprobs, mode=mode, rename=rename, **fields)
    streams = await start_all(s.runtime, reqs, body.priority, body.slo_ms, streaming=body.stream)
    rid = new_id("gen")
    if body.stream:
        return sse_response(_events(rid, streams[0]), streams)
    return jsonify(result_json(rid, (await collect(streams))[0]))


async def _events(rid: str, stream: RequestStream) -> AsyncGenerator[bytes, None]:
    head = b'data: {"id":' + json.dumps(rid).encode() + b',"index":'
    while burst := await stream.next_burst():  # what piled up goes out in one write
        yield b"".join([_chunk_event(head, rid, c) for c in burst])
    assert stream.result is not None
    yield sse({"done": True, **result_json(rid, stream.result)})
    yield DONE


def _chunk_event(head: bytes, rid: str, c: GenerationChunk) -> bytes:
    """One token's event, byte for byte what ``sse`` makes of its dict; the common case (no
    logprob, loops known) is spliced from ``head`` (the stream's prefix) without a dict."""
    if c.logprob is None and c.loops_used is not None:
        return b"%s%d,\"token_id\":%d,\"text\":%s,\"loops\":%d}\n\n" % (
            head, c.index, c.token_id, _json_str(c.text).encode(), c.loops_used)
    event: dict[str, Any] = {"id": rid, "index": c.index, "token_id": c.token_id, "text": c.text,
                             "loops": c.loops_used}
    if c.logprob is not None:
        event["logprob"] = c.logprob.logprob
    return sse(event)


@blueprint.post("/generate/speculative")
async def speculative() -> Response:
    """Chain self-speculative decoding: the /generate result plus the draft counts."""
    body: SpeculativeRequest = await parse_body(SpeculativeRequest)
    return await _speculate(body, "speculative")


@blueprint.post("/generate/tree_speculative")
async def tree_speculative() -> Response:
    """Tree self-speculative decoding (``K_branches`` first-level candidates)."""
    body: TreeSpeculativeRequest = await parse_body(TreeSpeculativeRequest)
    return await _speculate(body, "tree", k_branches=body.K_branches)


async def _speculate(body: SpeculativeRequest, mode: str, **fields: Any) -> Response:
    """``verify_loops`` is the request's loops (``loops`` is its alias): a limit on them names
    the one the client gave."""
    if body.verify_loops is not None and body.loops is not None and body.verify_loops != body.loops:
        raise ApiError(400, "verify_loops and loops disagree (give one of them)", param="verify_loops",
                       code="invalid_value")
    given = "verify_loops" if body.verify_loops is not None else "loops"
    body = body.model_copy(update={"loops": body.verify_loops or body.loops})
    return await _generate(body, mode, {"loops": given}, draft_loops=body.draft_loops,
                           draft_ahead=body.draft_ahead, **fields)


class TokenizeBody(TokenizeRequest):
    """``/tokenize``'s body: ``TokenizeRequest`` and vLLM's ``add_special_tokens`` (lm-eval sends
    false). True asks for the prompt's tokens as the completion routes run them, special tokens
    added around it included; false for the text's own tokens alone. TinyLoop adds none (a text
    prompt reaches the model as ``Tokenizer.encode`` gives it, no BOS, and the tokenizer it exports
    declares none), so both give the same ids today. A chat's tokens are its rendered template's."""

    add_special_tokens: bool = True


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    s = served()
    body: TokenizeBody = await parse_body(TokenizeBody)
    s.model.check_name(body.model)
    if body.messages is not None:
        tokens = await s.model.encode_chat(body.messages)
    elif body.add_special_tokens:
        tokens = await s.model.encode_prompt(body.prompt or "")
    else:
        prompt = body.prompt or ""
        tokens = await off_loop(s.model.tokenizer.encode, prompt, size=len(prompt))
    return await json_response({"tokens": tokens, "count": len(tokens),
                                "max_model_len": s.model.max_seq_len}, size=len(tokens))


@blueprint.get("/tokenizer_info")
@blueprint.get("/v1/tokenizer_info")
async def tokenizer_info() -> Response:
    """vLLM's ``/tokenizer_info`` (lm-eval's ``tokenizer_backend=remote`` reads ``eos_token``,
    ``bos_token``, ``pad_token`` and ``chat_template`` from it): the ``tokenizer_config.json`` that
    ``tinyloop export-tokenizer`` writes, with the served context as ``model_max_length``."""
    m = served().model
    return jsonify(_tokenizer_config(m.tokenizer, m.chat_template, m.max_seq_len))


@lru_cache(maxsize=4)
def _tokenizer_config(tokenizer: Tokenizer, chat_template: str, max_seq_len: int) -> dict[str, Any]:
    return hf_tokenizer_config(tokenizer, chat_template=chat_template, model_max_length=max_seq_len)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    s = served()
    body: DetokenizeRequest = await parse_body(DetokenizeRequest)
    s.model.check_name(body.model)
    bad = await off_loop(s.model.limits.outside_vocabulary, body.tokens, size=len(body.tokens))
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary ({s.model.limits.vocab_size})",
                       param="tokens", code="invalid_value")
    text = await off_loop(partial(s.model.tokenizer.decode, skip_special=False), body.tokens,
                          size=len(body.tokens))
    return await json_response({"text": text, "prompt": text}, size=len(text))


async def json_response(data: dict[str, Any], size: int) -> Response:
    """``data`` as a JSON response, serialised in a worker thread when it holds a long list or
    text (``size`` items or characters)."""
    build: Callable[..., Response] = current_app.json.response  # type: ignore[assignment]
    response: Response = await off_loop(build, data, size=size)
    return response
