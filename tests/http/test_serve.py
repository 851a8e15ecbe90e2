"""The server as production runs it: ``tinyloop serve`` in its own process (graceful SIGTERM),
``serve --detach``, and ``hypercorn 'tinyloop.http:app'``.

Each test starts a fresh Python that imports torch and loads the ``tiny_artifact``, hence
``slow``. Ports are picked by binding 127.0.0.1:0 and closing the socket.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from tinyloop.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 90  # a cold Python + torch import under a loaded CI machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without TINYLOOP_* (the test's flags alone configure the server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")}
    return {**env, **extra}


async def wait_healthy(url: str, log: Path, proc: trio.Process | None = None) -> None:
    """Poll /healthz until it answers ``ok``; fail with the server's log if it died."""
    with trio.fail_after(STARTUP_S):
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            while True:
                if proc is not None and proc.returncode is not None:
                    raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()}")
                try:
                    resp = await client.get("/healthz")
                    if resp.status_code == 200:
                        assert resp.text == "ok\n"
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)


@asynccontextmanager
async def server_process(argv: list[str], log: Path, env: dict[str, str]) -> AsyncIterator[trio.Process]:
    """Run ``argv`` (output to ``log``); killed if the test leaves early."""
    async with trio.open_nursery() as nursery:
        with log.open("wb") as out:
            proc: trio.Process = await nursery.start(partial(
                trio.run_process, argv, check=False, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=ROOT))
        yield proc
        with trio.move_on_after(30):
            await proc.wait()
        nursery.cancel_scope.cancel()


async def test_sigterm_lets_the_running_stream_finish_and_exits_zero(tiny_artifact: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "tinyloop.cli", "serve", "--model", str(tiny_artifact),
            "--port", str(port), "--graceful-timeout", "60"]
    with trio.fail_after(STARTUP_S + 90):
        async with server_process(argv, log, clean_env()) as proc:
            await wait_healthy(url, log, proc)
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True, "seed": 1,
                        "stream_options": {"include_usage": True}}
                events: list[str] = []
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line.removeprefix("data: "))
                        if len(events) == 1:
                            proc.send_signal(signal.SIGTERM)
                            await wait_refused(url)
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert chunks[-1]["usage"]["completion_tokens"] == 40
                assert chunks[-2]["choices"][0]["finish_reason"] == "length"
                assert not any("error" in chunk for chunk in chunks)  # no in-band error event
            with trio.fail_after(60):
                assert await proc.wait() == 0, log.read_text()
    assert f"TinyLoop serving on {url}" in log.read_text()


async def wait_refused(url: str) -> None:
    """A request made after the signal is refused: 503 or no connection at all."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as fresh:
        try:
            resp = await fresh.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        except httpx.TransportError:
            return
        assert resp.status_code == 503, resp.text


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: its parent, not us, would reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# serve --detach leaves its child unwaited on purpose; run in-process, Popen.__del__ says so.
@pytest.mark.filterwarnings(r"ignore:subprocess \d+ is still running:ResourceWarning")
async def test_detach_prints_pid_and_serves_until_sigterm(
        tiny_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    log = tmp_path / "detached.log"
    for key in [k for k in os.environ if k.startswith("TINYLOOP_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(ROOT)
    status = main(["serve", "--detach", "--model", str(tiny_artifact), "--port", str(port),
                   "--log", str(log)])
    out = capsys.readouterr().out
    match = re.fullmatch(rf"TinyLoop server pid=(\d+) on 127\.0\.0\.1:{port} — log (.+)\n", out)
    assert status == 0 and match, out
    pid = int(match[1])
    assert match[2] == str(log)
    try:
        assert os.getsid(pid) == pid  # its own session: it outlives the launching shell
        with trio.fail_after(STARTUP_S + 30):
            await wait_healthy(f"http://127.0.0.1:{port}", log)
            os.kill(pid, signal.SIGTERM)
            while not gone(pid):
                await trio.sleep(0.05)
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert f"TinyLoop serving on http://127.0.0.1:{port}" in log.read_text()


def test_detach_reports_a_server_that_dies_before_serving(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "broken.tinyloop"
    bad.write_bytes(b"not a safetensors file at all")
    log = tmp_path / "detached.log"
    log.write_text("TinyLoop serving on http://127.0.0.1:1 (an earlier run's line)\n")
    for key in [k for k in os.environ if k.startswith("TINYLOOP_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(ROOT)
    status = main(["serve", "--detach", "--model", str(bad), "--port", str(free_port()),
                   "--log", str(log), "--detach-timeout", "60"])
    captured = capsys.readouterr()
    assert status == 1 and captured.out == ""
    assert "exited with status" in captured.err and "broken.tinyloop" in captured.err


def test_the_package_app_is_an_asgi_app_built_lazily(tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quart_trio import QuartTrio

    import tinyloop.http
    from tinyloop.http import app

    monkeypatch.setenv("TINYLOOP_MODEL_PATH", str(tiny_artifact))
    # A name in the module's namespace (hypercorn resolves ``module:name`` with eval there),
    # callable as ASGI, that has built nothing yet.
    assert vars(tinyloop.http)["app"] is app and not isinstance(app, type(tinyloop))
    assert callable(app)
    fresh = type(app)()  # build one here rather than fill the package's own
    built = fresh.get()
    assert isinstance(built, QuartTrio) and "tinyloop" not in built.extensions  # nothing loaded
    assert fresh.get() is built


async def test_hypercorn_serves_the_package_app(tiny_artifact: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "hypercorn.log"
    argv = [sys.executable, "-m", "hypercorn", "tinyloop.http:app", "--bind", f"127.0.0.1:{port}",
            "--worker-class", "trio"]
    with trio.fail_after(STARTUP_S + 60):
        async with server_process(argv, log, clean_env(TINYLOOP_MODEL_PATH=str(tiny_artifact))) as proc:
            await wait_healthy(url, log, proc)
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                                   "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 3
                assert resp.json()["model"] == tiny_artifact.stem
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                assert await proc.wait() == 0, log.read_text()
