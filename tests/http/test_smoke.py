"""The server answers on a real socket: health, models, a completion, the error object."""

from __future__ import annotations

import httpx
import trio

from tests.http.conftest import running_server


async def test_health_models_and_a_chat_completion() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            health = await client.get("/healthz")
            assert (health.status_code, health.text) == (200, "ok\n")
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["id"] == "tiny"
            resp = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            body = resp.json()
            assert resp.status_code == 200, body
            assert body["usage"]["completion_tokens"] == 4
            missing = await client.get("/nope")
            assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


async def test_the_browser_ui_ships_inside_the_package_and_is_served() -> None:
    from importlib.resources import files

    from tinyloop.http.web import web_root

    # package data (tinyloop/web, the only copy), so `pip install .` carries it
    assert (files("tinyloop") / "web" / "index.html").is_file()
    assert web_root() is not None and (web_root() / "index.html").is_file()
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            page = await client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<html" in page.text.lower()
