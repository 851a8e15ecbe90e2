"""The official ``openai`` SDK against ``/v1`` of a real server.

The sync client runs in a worker thread (``trio.to_thread.run_sync``) so the server's event loop
keeps running. ``AsyncOpenAI`` runs under Trio directly: it does its I/O through anyio (httpx2,
httpcore2). One wrinkle, in the SDK, not the server: its ``AsyncStream`` leaves its inner async
generators unexhausted after ``[DONE]``, and Trio's finalizer warns (``ResourceWarning``) when
they are collected; ``pytestmark`` ignores exactly those warnings.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.http.conftest import LiveServer, running_server
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings
from tinyloop.testing import FakeEngine
from tinyloop.tokenizer import CHATML_TEMPLATE, default_tokenizer

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.[\w.]+' was garbage collected:ResourceWarning")

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]
PROMPT = "Once upon a time"


def async_client(srv: LiveServer, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


async def drain(stream: Any) -> list[Any]:
    async with stream:
        return [chunk async for chunk in stream]


def chat_text(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks
                   if c.choices and c.choices[0].index == index)


async def test_sync_client_in_a_worker_thread() -> None:
    def calls(url: str) -> dict[str, Any]:
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
            chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                  temperature=0)
            with client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                temperature=0, stream=True) as stream:
                chunks = list(stream)
            text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
            with client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                           stream=True) as stream:
                text_chunks = list(stream)
            return {"models": [m.id for m in client.models.list()], "chat": chat,
                    "chunks": chunks, "text": text, "text_chunks": text_chunks}

    with trio.fail_after(30):
        async with running_server() as srv:
            out = await trio.to_thread.run_sync(calls, srv.url)
    assert out["models"] == ["tiny"]
    chat = out["chat"]
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (6, "length")
    assert chat_text(out["chunks"]) == chat.choices[0].message.content
    assert len({c.id for c in out["chunks"]}) == 1
    text = out["text"]
    assert text.object == "text_completion" and text.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in out["text_chunks"]) == text.choices[0].text


async def test_async_client_runs_under_trio() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            models = [m.id async for m in client.models.list()]
            chat = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                        max_tokens=6, temperature=0)
            chunks = await drain(await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stream=True))
            text = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                                   temperature=0)
            text_chunks = await drain(await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True))
    assert models == ["tiny"]
    assert chat.model == "tiny" and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens == 6
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 6
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert chat_text(chunks) == chat.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    assert len({(c.id, c.created) for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in text_chunks) == text.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"


async def test_two_choices_streamed_and_not() -> None:
    args: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "n": 2,
                            "temperature": 1.0, "seed": 11}
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            whole = await client.chat.completions.create(**args)
            chunks = await drain(await client.chat.completions.create(**args, stream=True))
            texts = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=2,
                                                    seed=11)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 10
    assert [c.index for c in texts.choices] == [0, 1]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert chat_text(chunks, index) == whole.choices[index].message.content
    assert all(len(c.choices) == 1 for c in chunks)
    # The choices decode together and stream interleaved: each one's text starts before any ends.
    order = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks
             if c.choices[0].delta.content or c.choices[0].finish_reason]
    first_end = next(k for k, (_, finish) in enumerate(order) if finish)
    assert {index for index, _ in order[:first_end]} == {0, 1}


async def test_stop_string_cuts_the_text_before_it() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            free = (await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                                    temperature=0)).choices[0].text
            stop = free[len(free) // 2:len(free) // 2 + 3]
            cut = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                                  temperature=0, stop=[stop])
            streamed = await drain(await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True))
            chat_free = (await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)).choices[0].message.content
            assert chat_free
            chat_stop = chat_free[len(chat_free) // 2:len(chat_free) // 2 + 3]
            chat_cut = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                            max_tokens=12, temperature=0, stop=chat_stop)
    expected = free[:free.index(stop)]
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert chat_cut.choices[0].message.content == chat_free[:chat_free.index(chat_stop)]
    assert chat_cut.choices[0].finish_reason == "stop"


async def test_seed_makes_sampling_reproducible() -> None:
    async def sample(client: openai.AsyncOpenAI, seed: int) -> str | None:
        r = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                 temperature=1.0, seed=seed)
        return r.choices[0].message.content

    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            first, again, other = await sample(client, 7), await sample(client, 7), await sample(client, 8)
    assert first == again
    assert first != other


async def test_logprobs_in_chat_and_legacy_completion_shapes() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                        temperature=0, logprobs=True, top_logprobs=2)
            chunks = await drain(await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                top_logprobs=2, stream=True))
            text = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                                   temperature=0, logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert b"".join(bytes(t.bytes) for t in content).decode() == chat.choices[0].message.content
    for t in content:
        assert isinstance(t.token, str) and t.logprob <= 0
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, pytest.approx(t.logprob))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]

    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == text.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(value)


async def test_include_usage_adds_one_final_chunk() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            chat = await drain(await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=3, stream=True, seed=1,
                stream_options={"include_usage": True}))
            text = await drain(await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=3, n=2, stream=True, seed=1,
                stream_options={"include_usage": True}))
    for chunks, completion_tokens in ((chat, 3), (text, 6)):
        *body, last = chunks
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == completion_tokens
        assert last.usage.total_tokens == last.usage.prompt_tokens + completion_tokens
        assert body and all(c.usage is None and c.choices for c in body)


async def test_max_completion_tokens() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            r = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                     max_completion_tokens=3)
            with pytest.raises(openai.BadRequestError) as too_many:
                await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                     max_completion_tokens=10_000)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    assert too_many.value.param == "max_completion_tokens"
    assert too_many.value.code == "context_length_exceeded"


async def test_tinyloop_knobs_through_extra_body_change_the_output() -> None:
    async def greedy(client: openai.AsyncOpenAI, **extra: Any) -> str | None:
        r = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body=extra or None)
        return r.choices[0].text

    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            default = await greedy(client)
            knobs = {"loops": 2, "cache_window": 1, "priority": 3}
            shallow, again = await greedy(client, **knobs), await greedy(client, **knobs)
            assert srv.engine.config.default_loops != 2
    assert shallow == again
    assert shallow != default


async def test_unsupported_parameters_are_bad_requests_naming_them() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            with pytest.raises(openai.BadRequestError) as audio:
                await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                     extra_body={"audio": {"voice": "alloy"}})
            with pytest.raises(openai.BadRequestError) as suffix:
                await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, suffix="end")
            with pytest.raises(openai.BadRequestError) as three:
                await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=1,
                    extra_body={"frobnicate": 1, "audio": {"voice": "alloy"}, "prediction": {"type": "content"}})
    for err, param in ((audio.value, "audio"), (suffix.value, "suffix"), (three.value, "frobnicate")):
        assert err.status_code == 400
        assert isinstance(err.body, dict) and err.body["param"] == param == err.param
        assert err.code == "unsupported_parameter" and err.type == "invalid_request_error"
        assert param in err.message
    assert all(f"'{name}'" in three.value.message for name in ("frobnicate", "audio", "prediction"))


async def test_unknown_model_is_not_found() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            with pytest.raises(openai.NotFoundError) as chat:
                await client.chat.completions.create(model="gpt-5", messages=MESSAGES, max_tokens=1)
            with pytest.raises(openai.NotFoundError) as card:
                await client.models.retrieve("gpt-5")
    for err in (chat.value, card.value):
        assert err.status_code == 404 and err.param == "model" and err.code == "model_not_found"
        assert "gpt-5" in err.message


async def test_api_key_guards_every_route_but_healthz() -> None:
    with trio.fail_after(30):
        async with running_server(Settings(port=0, api_key="k")) as srv:
            async with async_client(srv, key="wrong") as client:
                with pytest.raises(openai.AuthenticationError) as wrong:
                    await client.models.list()
            async with async_client(srv, key="k") as client:
                allowed = [m.id async for m in client.models.list()]
            async with httpx.AsyncClient(base_url=srv.url) as raw:
                health = await raw.get("/healthz")
                refused = [await raw.get("/v1/models"), await raw.get("/metrics"),
                           await raw.post("/v1/chat/completions", json={"messages": MESSAGES}),
                           await raw.post("/generate", json={"prompt": "hi"}),
                           await raw.get("/v1/models", headers={"Authorization": "Basic k"})]
                metrics = await raw.get("/metrics", headers={"Authorization": "Bearer k"})
    assert wrong.value.status_code == 401 and wrong.value.type == "authentication_error"
    assert allowed == ["tiny"]
    assert (health.status_code, health.text) == (200, "ok\n")
    for r in refused:
        assert r.status_code == 401, r.request.url
        assert r.json()["error"]["type"] == "authentication_error"
    assert metrics.status_code == 200


FAKE_MODEL = ServedModel(id="fake", tokenizer=default_tokenizer(), chat_template=CHATML_TEMPLATE,
                         max_seq_len=2048, default_loops=8, max_loops=64, vocab_size=4096)


async def test_a_full_queue_is_503_with_retry_after() -> None:
    settings = Settings(port=0, max_queue_depth=1, max_batch_size=1)
    engine = FakeEngine(latency_ms=60_000)  # the first request holds the only slot

    async def occupy(client: httpx.AsyncClient) -> None:
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})

    with trio.fail_after(30):
        async with running_server(settings, engine, FAKE_MODEL) as srv, \
                async_client(srv) as client, httpx.AsyncClient(base_url=srv.url) as raw, \
                trio.open_nursery() as nursery:
            for want in ((1, 0), (1, 1)):  # one running, then one queued (one at a time: a
                nursery.start_soon(occupy, raw)  # request still in transit to the queue counts)
                while (srv.runtime.statistics().in_flight, srv.runtime.statistics().queue_depth) != want:
                    await trio.sleep(0.005)
            with pytest.raises(openai.InternalServerError) as full:
                await client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=1)
            srv.runtime.refuse_new_requests()
            with pytest.raises(openai.InternalServerError) as closing:
                await client.completions.create(model="fake", prompt="hi", max_tokens=1)
            nursery.cancel_scope.cancel()
    for err, code in ((full.value, "QueueFullError"), (closing.value, "SchedulerShutdown")):
        assert err.status_code == 503 and err.code == code
        retry_after = err.response.headers.get("Retry-After")
        assert retry_after is not None and re.fullmatch(r"\d+(\.\d+)?", retry_after)
        assert 0 < float(retry_after) <= 120


async def test_speculation_through_the_sdk_gives_plain_decodings_tokens() -> None:
    plain: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with trio.fail_after(30):
        async with running_server() as srv, async_client(srv) as client:
            reference = await client.completions.create(**plain, extra_body={"loops": 8})
            chain = await client.completions.create(
                **plain, extra_body={"loops": 8, "speculation": {"draft_loops": 2, "draft_ahead": 3}})
            tree = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                extra_body={"speculation": {"draft_loops": 1, "branches": 2}})
            tree_plain = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
            with pytest.raises(openai.BadRequestError) as too_deep:
                await client.completions.create(**plain, extra_body={
                    "loops": 2, "speculation": {"draft_loops": 4}})
    assert chain.choices[0].text == reference.choices[0].text
    assert tree.choices[0].message.content == tree_plain.choices[0].message.content
    assert too_deep.value.param == "draft_loops"
