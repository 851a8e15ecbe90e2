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
