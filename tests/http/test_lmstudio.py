"""LM Studio's REST API v0: the model cards, and completions carrying stats, model_info, runtime.

Every response is compared field by field with the LM Studio shape in REFERENCE-API.md; the
streamed form carries the extras on its final chunk only (the one with ``finish_reason``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

import tinyloop
from tests.http.conftest import running_server, sse_events, tiny_engine
from tinyloop.settings import Settings

SETTINGS = Settings(port=0, max_batch_size=8, commit="abc123")
PROMPT = "Once upon a time"  # greedy on tiny_engine(): "Loader" "if" "if" ... "subprocess" ...
CHAT = [{"role": "user", "content": PROMPT}]
CARD_FIELDS = {"id", "object", "type", "publisher", "arch", "compatibility_type", "quantization",
               "state", "max_context_length"}


async def post(client: httpx.AsyncClient, path: str,
               body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The final object of a completion and the chunks before it.

    Non-streamed: (the response, []). Streamed: (the chunk with ``finish_reason``, the others),
    after checking the stream ends with ``[DONE]`` and no other chunk carries the extras.
    """
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    if not body.get("stream"):
        assert resp.headers["content-type"].startswith("application/json")
        return resp.json(), []
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    for c in chunks[:-1]:
        assert not {"stats", "model_info", "runtime"} & set(c), c
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    return chunks[-1], chunks[:-1]


def check_extras(out: dict[str, Any], *, stop_reason: str, loops: int, context: int) -> None:
    stats = out["stats"]
    assert stats["stop_reason"] == stop_reason
    for key in ("tokens_per_second", "time_to_first_token", "generation_time"):
        assert isinstance(stats[key], float) and stats[key] >= 0, (key, stats)
    assert 0 < stats["time_to_first_token"] < 30 and 0 < stats["generation_time"] < 30
    if stop_reason in ("maxPredictedTokensReached", "contextLengthReached"):  # several tokens
        assert stats["tokens_per_second"] > 0
    info = out["model_info"]
    assert {k: info[k] for k in ("arch", "quant", "format", "context_length", "kv_cache_mode", "loops")} == {
        "arch": "tinyloop-huginn", "quant": "float32", "format": "tinyloop", "context_length": context,
        "kv_cache_mode": "full", "loops": loops}
    # the model itself: family, size, dtype, the loop dial, the default exit rule
    assert info["family"] == "huginn" and info["parameters"] > 0 and info["quantization"] == "float32"
    assert (info["default_loops"], info["max_loops"]) == (4, 16)
    assert info["exit"] == {"kind": "none", "threshold": 0.0, "min_loops": 1, "check_every": 1,
                            "exited_kv": "copy_latest"}
    assert out["runtime"] == {"name": "tinyloop", "version": tinyloop.__version__,
                              "supported_formats": ["tinyloop"], "commit": "abc123"}


async def test_models_list_and_one_model() -> None:
    with trio.fail_after(30):
        async with running_server(SETTINGS) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            listing = (await client.get("/api/v0/models")).json()
            assert listing["object"] == "list" and len(listing["data"]) == 1
            card = listing["data"][0]
            assert CARD_FIELDS <= set(card)
            assert {k: card[k] for k in CARD_FIELDS} == {
                "id": "tiny", "object": "model", "type": "llm", "publisher": "tinyloop",
                "arch": "tinyloop-huginn", "compatibility_type": "tinyloop", "quantization": "float32",
                "state": "loaded", "max_context_length": srv.model.max_seq_len}
            one = await client.get("/api/v0/models/tiny")
            assert one.status_code == 200 and one.json() == card
            missing = await client.get("/api/v0/models/nope")
            assert missing.status_code == 404
            assert missing.json() == {"error": {"message": "The model `nope` does not exist.",
                                                "type": "invalid_request_error", "param": "model",
                                                "code": "model_not_found"}}
            # The OpenAI listing is the plain card: no LM Studio fields.
            plain = (await client.get("/v1/models")).json()["data"][0]
            assert not {"type", "arch", "state", "max_context_length"} & set(plain)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_chat_completion_with_stats_model_info_runtime(stream: bool) -> None:
    with trio.fail_after(30):
        async with running_server(SETTINGS) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            out, chunks = await post(client, "/api/v0/chat/completions", {
                "messages": CHAT, "max_tokens": 5, "temperature": 0, "loops": 2, "stream": stream})
            assert out["id"].startswith("chatcmpl-") and out["model"] == "tiny"
            assert isinstance(out["created"], int)
            check_extras(out, stop_reason="maxPredictedTokensReached", loops=2, context=256)
            if stream:
                assert out["object"] == "chat.completion.chunk" and out["usage"] is None
                assert out["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                           "finish_reason": "length"}]
                assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert len(chunks) == 6  # the role chunk and one per token
            else:
                assert out["object"] == "chat.completion"
                assert out["usage"]["completion_tokens"] == 5
                assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 5
                [choice] = out["choices"]
                assert choice["finish_reason"] == "length" and choice["logprobs"] is None
                assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
            # /v1 is the same completion without LM Studio's extras.
            plain = (await client.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 5, "temperature": 0, "loops": 2})).json()
            assert not {"stats", "model_info", "runtime"} & set(plain)
            if not stream:
                assert plain["choices"][0]["message"] == out["choices"][0]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_completion_with_stats_model_info_runtime(stream: bool) -> None:
    with trio.fail_after(30):
        async with running_server(SETTINGS) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            out, chunks = await post(client, "/api/v0/completions", {
                "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream})
            assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
            check_extras(out, stop_reason="maxPredictedTokensReached",
                         loops=srv.model.default_loops, context=256)
            if stream:
                assert out["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                           "finish_reason": "length"}]
                assert "".join(c["choices"][0]["text"] for c in chunks) == "Loaderififif"
            else:
                assert out["choices"] == [{"index": 0, "text": "Loaderififif", "logprobs": None,
                                           "finish_reason": "length"}]
                assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                                        "prompt_tokens_details": {"cached_tokens": 0}}


# (request fields, finish_reason, LM Studio stop_reason) on tiny_engine(max_seq_len=64)
STOPS = {
    "max_tokens": ({"max_tokens": 3}, "length", "maxPredictedTokensReached"),
    "stop_string": ({"max_tokens": 20, "stop": ["subprocess"]}, "stop", "stopStringFound"),
    "stop_token": ({"max_tokens": 20, "stop_token_ids": [1056]}, "stop", "eosFound"),
    "context": ({"max_tokens": -1, "ignore_eos": True}, "length", "contextLengthReached"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", list(STOPS))
async def test_stop_reason_vocabulary(case: str, stream: bool) -> None:
    fields, finish, stop_reason = STOPS[case]
    with trio.fail_after(30):
        async with (running_server(SETTINGS, tiny_engine(max_seq_len=64)) as srv,
                    httpx.AsyncClient(base_url=srv.url) as client):
            body = {"prompt": PROMPT, "temperature": 0, "stream": stream, **fields}
            if stream:
                body["stream_options"] = {"include_usage": True}
            resp = await client.post("/api/v0/completions", json=body)
            assert resp.status_code == 200, resp.text
            if stream:
                events = sse_events(resp.text)
                assert events[-1] == "[DONE]"
                usage = events[-2]["usage"]
                out = events[-3]
                text = "".join(e["choices"][0]["text"] for e in events[:-2])
            else:
                out = resp.json()
                usage, text = out["usage"], out["choices"][0]["text"]
            assert out["choices"][0]["finish_reason"] == finish
            check_extras(out, stop_reason=stop_reason, loops=srv.model.default_loops, context=64)
            match case:
                case "stop_string":
                    assert text == "Loaderififififififif"  # cut before "subprocess"
                case "stop_token":
                    assert text == "Loaderif" and usage["completion_tokens"] == 2
                case "context":
                    assert usage["total_tokens"] == 64


async def test_chat_stop_reason_context_length_when_streamed() -> None:
    with trio.fail_after(30):
        async with (running_server(SETTINGS, tiny_engine(max_seq_len=64)) as srv,
                    httpx.AsyncClient(base_url=srv.url) as client):
            resp = await client.post("/api/v0/chat/completions", json={
                "messages": CHAT, "max_tokens": -1, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}})
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]" and events[-2]["choices"] == []
            out, usage = events[-3], events[-2]["usage"]
            assert out["choices"][0]["finish_reason"] == "length"
            check_extras(out, stop_reason="contextLengthReached", loops=srv.model.default_loops,
                         context=64)
            prompt = (await client.post("/tokenize", json={"messages": CHAT})).json()["count"]
            assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == 64


async def test_speculation_reports_lm_studio_draft_counts() -> None:
    body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0,
            "speculation": {"draft_loops": 1, "draft_ahead": 3}}
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            out, _ = await post(client, "/api/v0/completions", body)
            plain, _ = await post(client, "/api/v0/completions", {**body, "speculation": None})
    stats = out["stats"]
    assert stats["total_draft_tokens_count"] > 0
    assert (stats["accepted_draft_tokens_count"] + stats["rejected_draft_tokens_count"]
            == stats["total_draft_tokens_count"])
    assert "total_draft_tokens_count" not in plain["stats"]
    assert out["choices"][0]["text"] == plain["choices"][0]["text"]
