"""Signals to ``tinyloop serve`` in its own process (finding 7 of issue 29).

A second SIGTERM used to kill the server by the default action (exit -15, nothing logged, the
open streams cut with no error event and no ``[DONE]``), two SIGINTs ended in a
KeyboardInterrupt traceback, and SIGHUP killed at once. Now SIGHUP drains like SIGTERM, and a
second signal forces the shutdown: it is logged, every open stream gets the ``shutting down``
error event and ``[DONE]``, and the process exits 128 + the signal's number, without a
traceback.

The three servers start side by side: a fresh Python importing torch is most of each case's
time.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from tests.http.test_serve import STARTUP_S, clean_env, free_port, server_process, wait_healthy, wait_refused

pytestmark = pytest.mark.slow

STREAMS = 3
LONG, SHORT = 2000, 30  # tokens: the 60 s graceful drain would let LONG run on; SHORT ends soon


@dataclass
class Ending:
    """How one server ended: its exit status, its log, and each stream's ``data:`` payloads."""

    status: int
    log: str
    streams: list[list[str]]


Signaller = Callable[[trio.Process, str, Path], Awaitable[None]]  # (process, url, log)


async def run_streams(url: str, max_tokens: int, on_started: Callable[[], Awaitable[None]]) -> list[list[str]]:
    """``STREAMS`` completions streams read to their end; ``on_started`` runs once each has its
    first event."""
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    started = trio.Event()
    streams: list[list[str]] = [[] for _ in range(STREAMS)]

    async def one(client: httpx.AsyncClient, events: list[str]) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if all(streams):
                        started.set()

    limits = httpx.Limits(max_connections=STREAMS)
    async with (httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client,
                trio.open_nursery() as nursery):
        for events in streams:
            nursery.start_soon(one, client, events)
        await started.wait()
        await on_started()
    return streams


async def serve_and_signal(artifact: Path, log: Path, max_tokens: int, signal_it: Signaller) -> Ending:
    """``tinyloop serve`` with the streams open, signalled by ``signal_it`` once they run."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tinyloop.cli", "serve", "--model", str(artifact), "--port", str(port),
            "--graceful-timeout", "60", "--max-batch-size", str(STREAMS)]
    async with server_process(argv, log, clean_env(OMP_NUM_THREADS="1")) as proc:
        await wait_healthy(url, log, proc)
        streams = await run_streams(url, max_tokens, lambda: signal_it(proc, url, log))
        with trio.fail_after(30):
            status = await proc.wait()
    return Ending(status, log.read_text(), streams)


def twice(signum: signal.Signals) -> Signaller:
    async def send(proc: trio.Process, url: str, log: Path) -> None:
        proc.send_signal(signum)
        while f"{signum.name}: shutting down" not in log.read_text():  # the first one was taken
            await trio.sleep(0.02)
        proc.send_signal(signum)

    return send


async def hang_up(proc: trio.Process, url: str, log: Path) -> None:
    proc.send_signal(signal.SIGHUP)
    await wait_refused(url)


async def test_a_second_signal_forces_the_shutdown_and_sighup_drains(tiny_artifact: Path, tmp_path: Path) -> None:
    cases: dict[str, tuple[int, Signaller]] = {
        "SIGTERM twice": (LONG, twice(signal.SIGTERM)),
        "SIGINT twice": (LONG, twice(signal.SIGINT)),
        "SIGHUP": (SHORT, hang_up),
    }
    endings: dict[str, Ending] = {}

    async def run(name: str, max_tokens: int, signal_it: Signaller) -> None:
        log = tmp_path / f"{name.replace(' ', '-')}.log"
        endings[name] = await serve_and_signal(tiny_artifact, log, max_tokens, signal_it)

    with trio.fail_after(STARTUP_S + 90):
        async with trio.open_nursery() as nursery:
            for name, (max_tokens, signal_it) in cases.items():
                nursery.start_soon(run, name, max_tokens, signal_it)

    for name, signum in (("SIGTERM twice", signal.SIGTERM), ("SIGINT twice", signal.SIGINT)):
        end = endings[name]
        assert end.status == 128 + signum, (name, end.log)
        assert f"second signal ({signum.name}): forcing shutdown" in end.log, (name, end.log)
        assert "Traceback" not in end.log and "KeyboardInterrupt" not in end.log, (name, end.log)
        for events in end.streams:
            assert events[-1] == "[DONE]", (name, events[-3:])
            error = json.loads(events[-2])["error"]
            assert "shutting down" in error["message"] and error["type"] == "server_error", (name, error)
            assert len(events) < LONG, name  # cut, not finished

    end = endings["SIGHUP"]
    assert end.status == 0 and "SIGHUP: shutting down" in end.log, end.log
    for events in end.streams:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
