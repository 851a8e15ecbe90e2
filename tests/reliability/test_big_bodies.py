"""Big bodies do not stall the event loop, and text past the limits is refused by name.

The probe's scenario: a stream runs while several big ``/tokenize`` bodies are posted (each a
prompt at the server's character limit, about a second of tokenising). JSON parsing,
validation, tokenising and serialising the answer run in worker threads, so the stream's
tokens keep coming, ``/healthz`` answers at once and the loop never stops for long. Before,
each body held the loop (and the GIL) for its whole tokenisation: a stream gap of several
seconds.
"""

from __future__ import annotations

import json
import time

import httpx
import trio

from tests.http.conftest import running_server
from tests.reliability.conftest import poll_health, sse_events
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings
from tinyloop.testing import FakeEngine
from tinyloop.tokenizer import CHATML_TEMPLATE, default_tokenizer

JSON = {"Content-Type": "application/json"}
BIG_BODIES = 3
STREAM_TOKENS = 300  # at 20 ms a token: 6 s of stream, longer than the big bodies take


def fake_model() -> ServedModel:
    return ServedModel(id="fake", tokenizer=default_tokenizer(), chat_template=CHATML_TEMPLATE,
                       max_seq_len=2048, default_loops=8, max_loops=64, vocab_size=4096)


def prose(chars: int) -> str:
    return ("The quick brown fox jumps over the lazy dog; 12 foxes, 7 dogs. " * (chars // 60 + 1))[:chars]


async def loop_lag(lags: list[float], done: trio.Event) -> None:
    """How late 10 ms sleeps wake up: the longest time the event loop was not running tasks."""
    while not done.is_set():
        start = trio.current_time()
        await trio.sleep(0.01)
        lags.append(trio.current_time() - start - 0.01)


async def test_a_stream_keeps_flowing_while_big_bodies_are_tokenised() -> None:
    settings = Settings(port=0, max_batch_size=4)
    text = prose(settings.max_prompt_chars)  # at the limit: accepted, about a second of work
    body = json.dumps({"prompt": text}).encode()
    started = time.perf_counter()
    expected = await trio.to_thread.run_sync(default_tokenizer().encode, text)
    encode_s = time.perf_counter() - started  # what one body costs on this machine now
    engine = FakeEngine(latency_ms=20, token_latency_ms=20, stream_tokens=list(range(3, 3 + STREAM_TOKENS)))
    gaps: list[float] = []
    lags: list[float] = []
    health_s: list[float] = []
    answers: list[httpx.Response] = []
    done = trio.Event()
    with trio.fail_after(120):
        async with running_server(settings, engine, fake_model()) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=60) as client:

            async def stream() -> None:
                async with client.stream("POST", "/generate", json={
                        "prompt_tokens": [5], "max_tokens": STREAM_TOKENS, "stream": True}) as resp:
                    last = None
                    async for _ in resp.aiter_lines():
                        now = trio.current_time()
                        if last is not None and not done.is_set():
                            gaps.append(now - last)
                        last = now

            async def big() -> None:
                answers.append(await client.post("/tokenize", content=body, headers=JSON))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await trio.sleep(0.3)  # the stream is flowing
                nursery.start_soon(loop_lag, lags, done)
                nursery.start_soon(poll_health, client, done, health_s)
                async with trio.open_nursery() as bodies:
                    for _ in range(BIG_BODIES):
                        bodies.start_soon(big)
                done.set()
    assert [r.status_code for r in answers] == [200] * BIG_BODIES
    assert all(r.json()["tokens"] == expected for r in answers)
    # One body took encode_s of tokenising; the loop used to stop for all of that, per body.
    bound = max(0.5, encode_s / 2)
    assert gaps and max(gaps) < bound, (max(gaps), encode_s)
    assert health_s and max(health_s) < bound, (max(health_s), encode_s)
    assert lags and max(lags) < bound, (max(lags), encode_s)


async def test_text_past_the_limits_is_refused_by_name_without_stalling() -> None:
    settings = Settings(port=0, max_prompt_chars=1000, max_messages=8)
    msg = {"role": "user", "content": "hi"}
    cases = [  # path, body, param
        ("/v1/completions", {"prompt": "x" * 1001}, "prompt"),
        ("/api/v0/completions", {"prompt": "x" * 1001}, "prompt"),
        ("/generate", {"prompt": "x" * 1001}, "prompt"),
        ("/generate/speculative", {"prompt": "x" * 1001}, "prompt"),
        ("/tokenize", {"prompt": "x" * 1001}, "prompt"),
        ("/v1/chat/completions", {"messages": [msg] * 9}, "messages"),
        ("/api/v0/chat/completions", {"messages": [msg] * 9}, "messages"),
        ("/tokenize", {"messages": [msg] * 9}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}] * 2}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x" * 1001}]}]}, "messages"),
        # the probe's bodies: a 3.9 MB chat prompt, 100k messages
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3_900_000}]}, "messages"),
        ("/v1/chat/completions", {"messages": [msg] * 100_000}, "messages"),
    ]
    with trio.fail_after(60):
        async with running_server(settings) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            answers = [await client.post(path, content=json.dumps(body), headers=JSON)
                       for path, body, _ in cases]
            ok = await client.post("/v1/chat/completions", json={"messages": [msg] * 8, "max_tokens": 1})
            fits = await client.post("/tokenize", json={"prompt": "x" * 1000})
    for (path, _, param), resp in zip(cases, answers):
        assert resp.status_code == 413, (path, param, resp.text[:200])
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["param"], error["type"], error["code"]) == (
            param, "invalid_request_error", "request_too_large"), (path, error)
        assert "--max-" in error["message"], error
    assert ok.status_code == 200 and fits.status_code == 200


async def test_a_streamed_refusal_is_not_a_stream() -> None:
    """A refused stream request answers with the error object, not an SSE body."""
    settings = Settings(port=0, max_prompt_chars=10)
    with trio.fail_after(30):
        async with running_server(settings) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "x" * 11, "stream": True}) as resp:
                events = await sse_events(resp)
                status = resp.status_code
    assert status == 413 and events == []
