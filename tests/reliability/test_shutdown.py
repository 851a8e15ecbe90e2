"""Shutdown under load.

* ``tinyloop serve`` in its own process gets SIGTERM while several streams run: each stream
  completes, a new request is refused (503 or no connection), the process exits 0.
* In process, ``runtime.shutdown(drain=False)`` under load: queued requests fail with
  SchedulerShutdown (HTTP 503), running ones are cancelled, nothing keeps KV.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.http.conftest import running_server, tiny_engine
from tests.http.test_disconnect import record_streams
from tests.http.test_serve import STARTUP_S, clean_env, free_port, server_process, wait_healthy, wait_refused
from tests.reliability.conftest import assert_drained, wait_for
from tinyloop.requests import RequestState
from tinyloop.settings import Settings

STREAMS, TOKENS = 6, 40


@pytest.mark.slow
async def test_sigterm_under_load_finishes_the_streams_refuses_new_ones_and_exits_zero(
        tiny_artifact: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "tinyloop.cli", "serve", "--model", str(tiny_artifact), "--port", str(port),
            "--graceful-timeout", "60", "--max-batch-size", "4"]
    body = {"prompt": "hi", "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with trio.fail_after(STARTUP_S + 90):
        async with server_process(argv, log, clean_env(OMP_NUM_THREADS="1")) as proc:
            await wait_healthy(url, log, proc)
            started = trio.Event()
            n_started = 0
            usage: list[int] = []

            async def stream(client: httpx.AsyncClient) -> None:
                nonlocal n_started
                events: list[str] = []
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line.removeprefix("data: "))
                            if len(events) == 1:
                                n_started += 1
                                if n_started == STREAMS:
                                    started.set()
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert not any("error" in chunk for chunk in chunks), chunks[-1]
                usage.append(chunks[-1]["usage"]["completion_tokens"])

            limits = httpx.Limits(max_connections=STREAMS)
            async with (httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client,
                        trio.open_nursery() as nursery):
                for _ in range(STREAMS):  # max_batch_size 4: two of them wait in the queue
                    nursery.start_soon(stream, client)
                await started.wait()
                proc.send_signal(signal.SIGTERM)
                await wait_refused(url)
            assert usage == [TOKENS] * STREAMS
            with trio.fail_after(60):
                assert await proc.wait() == 0, log.read_text()


async def test_shutdown_without_drain_fails_queued_and_cancels_running_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(port=0, max_batch_size=2)
    body = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True}  # cannot finish in the test
    with trio.fail_after(30):
        async with (running_server(settings, tiny_engine(max_seq_len=4096)) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            streams = record_streams(srv, monkeypatch)
            answers: list[httpx.Response] = []

            async def post() -> None:
                answers.append(await client.post("/v1/completions", json=body))

            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(post)
                await wait_for(lambda: srv.runtime.statistics().in_flight == 2
                               and srv.runtime.statistics().queue_depth == 4)
                running = [s for s in streams if srv.runtime.request_state(s.request_id)
                           in (RequestState.DISPATCHED, RequestState.DECODING)]
                queued = [s for s in streams if srv.runtime.request_state(s.request_id) is RequestState.QUEUED]
                assert (len(running), len(queued)) == (2, 4)
                with trio.fail_after(5):
                    await srv.runtime.shutdown(drain=False)
            assert [a.status_code for a in answers] == [503] * 6, [a.text for a in answers]
            for answer in answers:
                error = answer.json()["error"]
                assert "shut" in error["message"] or "stopped" in error["message"], error
            for s in streams:
                assert srv.runtime.request_state(s.request_id) in (RequestState.CANCELLED, RequestState.ERROR)
            assert {srv.runtime.request_state(s.request_id) for s in running} == {RequestState.CANCELLED}
            assert (await client.get("/healthz")).status_code == 503
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert_drained(srv)
