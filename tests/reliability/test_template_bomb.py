"""A model whose chat template is a bomb cannot freeze the server.

The probe's scenario: a ``chat_template`` of two nested ``range(100000)`` loops, sent one small
chat, blocked the event loop (``/healthz`` timed out three times in a row) while the process
grew to ~5 GB: the render ran inline for a short chat and nothing bounded it. Now every render
runs in a worker thread under the model's ``render_limits``: a stream already running keeps its
pace, ``/healthz`` answers at once, the bomb's own request ends in a 500 when its time is up,
and a client that gives up stops the render.
"""

from __future__ import annotations

import httpx
import trio

from tests.http.conftest import running_server
from tests.reliability.conftest import poll_health, rss_kib, wait_for
from tinyloop.http.bodies import text_limiter
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings
from tinyloop.template_sandbox import RenderLimits
from tinyloop.testing import FakeEngine
from tinyloop.tokenizer import CHATML_TEMPLATE, default_tokenizer

# Passes the load check (an ordinary chat renders), goes off on a chat that says "boom".
BOMB = ("{% if messages[-1].content == 'boom' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}" + CHATML_TEMPLATE)
STREAM_TOKENS = 60  # at 20 ms a token: 1.2 s of stream, longer than the bombs run


def bomb_model(seconds: float) -> ServedModel:
    return ServedModel(id="fake", tokenizer=default_tokenizer(), chat_template=BOMB, max_seq_len=2048,
                       default_loops=4, max_loops=8, vocab_size=4096, render_limits=RenderLimits(seconds=seconds))


async def test_a_stream_and_healthz_carry_on_while_a_template_bomb_goes_off() -> None:
    model = bomb_model(seconds=0.6)
    model.check_chat_templates()  # the bomb is one the load check lets through
    engine = FakeEngine(latency_ms=20, token_latency_ms=20, stream_tokens=list(range(3, 3 + STREAM_TOKENS)))
    gaps: list[float] = []
    health_s: list[float] = []
    bombs: list[httpx.Response] = []
    done = trio.Event()
    rss_before = rss_kib()
    with trio.fail_after(60):
        async with running_server(Settings(port=0, max_batch_size=4), engine, model) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=30) as client:

            async def stream() -> None:
                async with client.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": STREAM_TOKENS,
                        "stream": True}) as resp:
                    last = None
                    async for _ in resp.aiter_lines():
                        now = trio.current_time()
                        if last is not None and not done.is_set():
                            gaps.append(now - last)
                        last = now

            async def bomb() -> None:
                bombs.append(await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "boom"}], "max_tokens": 4}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await trio.sleep(0.2)  # the stream is flowing
                nursery.start_soon(poll_health, client, done, health_s)
                async with trio.open_nursery() as bodies:
                    for _ in range(2):  # as many as there are text threads
                        bodies.start_soon(bomb)
                done.set()
    for resp in bombs:
        assert resp.status_code == 500, resp.text
        assert resp.json()["error"]["code"] == "chat_template_error"
        assert "time limit (0.6 s)" in resp.json()["error"]["message"]
    assert gaps and max(gaps) < 1.0, max(gaps)
    # /healthz answered all along, each within a second (on two busy cores an answer takes ~0.2 s
    # while the bombs' threads hold the GIL, so the 0.6 s the bombs run fit two or three answers)
    assert len(health_s) >= 2 and max(health_s) < 1.0, health_s
    assert rss_kib() - rss_before < 200 * 1024  # the probe's bomb grew the process by ~5 GB


async def test_a_client_that_gives_up_stops_the_render() -> None:
    limiter = text_limiter()
    with trio.fail_after(30):
        async with running_server(Settings(port=0), FakeEngine(), bomb_model(seconds=600)) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            with trio.move_on_after(0.5):
                await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "boom"}]})
            # the worker thread holds its limiter token until it ends: it ended, long before 600 s
            with trio.fail_after(5):
                await wait_for(lambda: limiter.statistics().borrowed_tokens == 0)
            ok = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2})
    assert ok.status_code == 200, ok.text
