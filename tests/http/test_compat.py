"""What real clients send: prompt arrays (LangChain, lm-eval), explicit nulls and no-op values
(the openai SDK), vLLM's extras, an agent's replayed history, per-chunk usage (aiperf), cached
prompt tokens, and the status line's reason phrase."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import trio

from tests.http.conftest import running_server, sse_events
from tests.http.test_openai_sdk import async_client

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.[\w.]+' was garbage collected:ResourceWarning")

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]
GREEDY = {"max_tokens": 4, "temperature": 0}


async def _texts(client: openai.AsyncOpenAI, prompt: Any, **kw: Any) -> list[str]:
    out = await client.completions.create(model="tiny", prompt=prompt, **{**GREEDY, **kw})
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.text for c in out.choices]


async def test_every_prompt_shape_gives_one_choice_group_per_prompt_in_openai_order() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            tok = srv.model.tokenizer
            a, b = "Once upon a time", "def main():"
            alone = [(await _texts(client, p))[0] for p in (a, b)]
            assert await _texts(client, [a, b]) == alone
            assert await _texts(client, tok.encode(a)) == alone[:1]
            assert await _texts(client, [tok.encode(a), tok.encode(b)]) == alone
            # n per prompt: index = prompt * n + choice (greedy choices agree)
            assert await _texts(client, [a, b], n=2) == [alone[0]] * 2 + [alone[1]] * 2
            out = await client.completions.create(model="tiny", prompt=[a, b], **GREEDY)
            assert out.usage is not None
            assert out.usage.prompt_tokens == len(tok.encode(a)) + len(tok.encode(b))
            assert out.usage.completion_tokens == 8
            stream = await client.completions.create(model="tiny", prompt=[a, b], stream=True, **GREEDY)
            streamed = ["", ""]
            async with stream:
                async for chunk in stream:
                    for c in chunk.choices:
                        streamed[c.index] += c.text
            assert streamed == alone


async def test_explicit_nulls_are_the_field_left_out() -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None,
             "frequency_penalty": None, "logprobs": None, "stream": None, "seed": None, "stop": None,
             "user": None, "top_logprobs": None, "response_format": None, "tools": None, "tool_choice": None,
             "logit_bias": None, "stream_options": None, "max_completion_tokens": None}
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as http:
            chat = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, **nulls})
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["finish_reason"] == "length"
            text_nulls = {k: v for k, v in nulls.items()
                          if k not in ("top_logprobs", "tools", "tool_choice")} | {"echo": None, "suffix": None}
            text = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **text_nulls})
            assert text.status_code == 200, text.text
            # completions' max_tokens null is "to the context's end" (vLLM), not the default 16
            long = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": None,
                                                             "ignore_eos": True, "temperature": 0})
            assert long.json()["usage"]["completion_tokens"] > 16


async def test_no_op_values_are_accepted_and_change_nothing() -> None:
    no_ops: dict[str, Any] = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                              "logit_bias": {}, "store": False, "metadata": {"run": "7"},
                              "parallel_tool_calls": True, "top_k": -1, "best_of": 1,
                              "prompt_cache_key": "k", "service_tier": "auto"}
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as http:
            plain = (await http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY})).json()
            same = await http.post("/v1/chat/completions", json={"messages": MESSAGES, **GREEDY, **no_ops})
            assert same.status_code == 200, same.text
            assert same.json()["choices"] == plain["choices"]
            text_ops = {k: v for k, v in no_ops.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
            text = await http.post("/v1/completions", json={"prompt": "hi", **GREEDY, **text_ops})
            assert text.status_code == 200, text.text


async def test_max_tokens_zero_scores_nothing_and_generates_nothing() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            out = await client.completions.create(model="tiny", prompt="hi there", max_tokens=0)
            assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "length")
            assert out.usage is not None and out.usage.completion_tokens == 0
            chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=0)
            assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "length"


async def test_an_agents_history_with_tool_calls_and_tool_results_renders() -> None:
    history: list[Any] = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C, sunny"},
    ]
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            out = await client.chat.completions.create(model="tiny", messages=history, **GREEDY)
            assert out.choices[0].finish_reason == "length"
            with pytest.raises(openai.BadRequestError) as orphan:
                await client.chat.completions.create(
                    model="tiny", messages=[{"role": "tool", "content": "18C"}], **GREEDY)  # type: ignore[list-item]
            assert orphan.value.param == "messages"


async def test_vllm_extras_reach_the_template_and_the_sampler() -> None:
    template_vars = {"enable_thinking": False}
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as http:
            ok = await http.post("/v1/chat/completions", json={
                "messages": MESSAGES, **GREEDY, "chat_template_kwargs": template_vars,
                "add_generation_prompt": False, "min_tokens": 2, "include_stop_str_in_output": False})
            assert ok.status_code == 200, ok.text
            clash = await http.post("/v1/chat/completions", json={
                "messages": MESSAGES, **GREEDY, "chat_template_kwargs": {"messages": []}})
            assert clash.status_code == 400 and "messages" in clash.json()["error"]["message"]
            # add_generation_prompt false drops the assistant's opening: a different prompt
            opened = (await http.post("/tokenize", json={"messages": MESSAGES})).json()["count"]
            closed = ok.json()["usage"]["prompt_tokens"]
            assert closed < opened


async def test_continuous_usage_stats_put_usage_on_every_chunk() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as http:
            resp = await http.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            events = [e for e in sse_events(resp.text) if e != "[DONE]"]
            per_chunk = [e["usage"] for e in events if e["choices"]]
            assert per_chunk and all(u is not None for u in per_chunk)
            assert [u["completion_tokens"] for u in per_chunk if u["completion_tokens"]][-1] == 4
            assert events[-1]["usage"]["completion_tokens"] == 4


async def test_cached_prompt_tokens_are_reported() -> None:
    prompt = "The same long prompt, sent twice, so that its full blocks are cached " * 3
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            first = await client.completions.create(model="tiny", prompt=prompt, **GREEDY)
            second = await client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < (second.usage.prompt_tokens_details.cached_tokens or 0) < second.usage.prompt_tokens


async def test_every_response_has_a_reason_phrase() -> None:
    with trio.fail_after(30):
        async with running_server() as srv:
            host, port = srv.url.removeprefix("http://").split(":")
            lines = []
            for request in (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                            b"GET /v1/nope HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Connection: close\r\n\r\n{}"):
                stream = await trio.open_tcp_stream(host, int(port))
                async with stream:
                    await stream.send_all(request)
                    data = b""
                    while b"\r\n" not in data:
                        piece = await stream.receive_some(4096)
                        if not piece:
                            break
                        data += piece
                lines.append(data.split(b"\r\n", 1)[0])
    assert lines == [b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 400 Bad Request"]
