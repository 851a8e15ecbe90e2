"""What the server says: the startup banner, the access log (off by default; ``--access-log`` /
``TINYLOOP_ACCESS_LOG=1``) and a line per step of the shutdown's drain."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest
import trio

from tests.http.inproc import TRAINED, serving, settings_for, short_context_artifact
from tinyloop.banner import browser_url
from tinyloop.cli import build_parser
from tinyloop.http.access import access_line
from tinyloop.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ACCESS = re.compile(r'^127\.0\.0\.1:\d+ "(GET|POST) (\S+) HTTP/1\.1" (\d{3}) \d+\.\d ms( incomplete)?$')


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return short_context_artifact(tmp_path_factory.mktemp("logs") / "short.tinyloop")


def _lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


async def test_the_banner_says_what_serves_where(artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tinyloop")
    with trio.fail_after(60):
        async with serving(settings_for(artifact, max_batch_size=3, weights="int8")) as server:
            banner = "\n".join(m for m in _lines(caplog, "tinyloop") if m.startswith("TinyLoop "))
    port = server.url.rpartition(":")[2]
    for part in (f"serving short ({artifact})", "device cpu;", "dtype float32, weights int8, KV cache full",
                 "engines 1; max batch 3 per engine", f"context 128 tokens; the model was built for {TRAINED}",
                 f"listening on http://127.0.0.1:{port}", f"playground http://127.0.0.1:{port}/"):
        assert part in banner, (part, banner)
    pool = re.search(r"KV pool ([\d,]+) blocks of 16 tokens: ([\d,]+) tokens at 4 loops, ([\d.,]+) MiB", banner)
    assert pool is not None, banner
    assert int(pool[1].replace(",", "")) > 0 and float(pool[3].replace(",", "")) > 0


@pytest.mark.parametrize("on", [True, False])
async def test_an_access_line_per_request_only_when_asked(artifact: Path, caplog: pytest.LogCaptureFixture,
                                                          on: bool) -> None:
    caplog.set_level(logging.INFO, logger="tinyloop")
    with trio.fail_after(60):
        async with serving(settings_for(artifact, access_log=on)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/version")).status_code == 200
            assert (await client.post("/generate", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
            assert (await client.get("/nowhere?x=1")).status_code == 404
    lines = _lines(caplog, "tinyloop.access")
    if not on:
        assert lines == []
        return
    parsed = [ACCESS.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m[1], m[2], m[3]) for m in parsed if m] == [
        ("GET", "/version", "200"), ("POST", "/generate", "200"), ("GET", "/nowhere?x=1", "404")]


def test_the_access_log_is_a_serve_flag_and_a_variable() -> None:
    assert Settings().access_log is False
    assert Settings.from_env({"TINYLOOP_ACCESS_LOG": "1"}).access_log is True
    args = build_parser().parse_args(["serve", "--access-log"])
    assert args.access_log is True


def test_an_access_line_marks_a_response_that_never_ended() -> None:
    scope = {"client": ("10.0.0.1", 4242), "method": "POST", "path": "/v1/x\n", "raw_path": b"/v1/x%0A",
             "query_string": b"", "http_version": "1.1"}
    assert access_line(scope, 200, 12.34, ended=True) == '10.0.0.1:4242 "POST /v1/x%0A HTTP/1.1" 200 12.3 ms'
    assert access_line(scope, 200, 5, ended=False).endswith(" 200 5.0 ms incomplete")
    assert access_line({**scope, "client": None}, None, 1, ended=False).startswith('- "POST')


def test_a_wildcard_bind_opens_in_a_browser_through_loopback() -> None:
    assert browser_url("http://0.0.0.0:8000") == "http://127.0.0.1:8000"
    assert browser_url("http://[::]:8000") == "http://[::1]:8000"
    assert browser_url("http://10.1.2.3:80") == "http://10.1.2.3:80"


async def test_each_drain_step_is_logged(artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tinyloop")
    with trio.fail_after(60):
        async with serving(settings_for(artifact)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/generate", json=body) as resp:
                lines = resp.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # decoding: the request is in flight
                server.stop.set()
                tail = [line async for line in lines if line]
            assert tail[-1] == "data: [DONE]" and '"done":true' in tail[-2]  # it was let finish
    steps = [r.getMessage() for r in caplog.records
             if r.name in ("tinyloop", "tinyloop.http") and "shutdown" in r.getMessage()]
    assert steps == ["shutdown trigger: shutting down; stopping admission (new requests get 503)",
                     "shutdown: draining 1 in-flight request (0 queued) for up to 10 s",
                     "shutdown: HTTP server stopped, every connection closed",
                     "shutdown: stopping the engines",
                     "shutdown: engines stopped; bye"], steps
