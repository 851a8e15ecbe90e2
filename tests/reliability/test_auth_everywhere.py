"""Auth: with an API key set, every route of the app but ``/healthz`` answers 401 with the error
object when the key is missing or wrong. The routes come from the app's own ``url_map``, so a
route added later is covered without touching this test.
"""

from __future__ import annotations

import re

import pytest
import trio
from quart_trio import QuartTrio

from tinyloop.http.factory import create_app
from tinyloop.settings import Settings

OPEN = {"/healthz", "/health"}  # the health probe, under its name and vLLM's


def routes(app: QuartTrio) -> list[tuple[str, str]]:
    """(method, concrete path) for every rule and method but HEAD/OPTIONS (answered by the
    framework for CORS preflights, not by a route)."""
    out = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"x-\1", rule.rule)  # /v1/models/<model> -> .../x-model
        for method in sorted(rule.methods or ()):
            if method not in ("HEAD", "OPTIONS"):
                out.append((method, path))
    return sorted(set(out))


def app_with_key() -> QuartTrio:
    return create_app(None, settings=Settings(api_key="sekrit"))


def test_the_route_enumeration_sees_every_router() -> None:
    paths = {path for _, path in routes(app_with_key())}
    assert {"/healthz", "/metrics", "/openapi.json", "/v1/models", "/v1/chat/completions",
            "/api/v0/models", "/generate", "/tokenize", "/"} <= paths, paths


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic sekrit", "sekrit"])
async def test_no_route_but_the_health_probe_answers_without_the_key(header: str | None) -> None:
    app = app_with_key()
    client = app.test_client()
    headers = {} if header is None else {"Authorization": header}
    with trio.fail_after(30):
        for method, path in routes(app):
            assert method in ("GET", "POST"), (method, path)  # a new verb: extend this test
            if method == "POST":
                resp = await client.post(path, headers=headers, json={"prompt": "hi"})
            else:
                resp = await client.get(path, headers=headers)
            if path in OPEN:
                assert resp.status_code != 401, (method, path)
                continue
            assert resp.status_code == 401, (method, path, resp.status_code)
            error = (await resp.get_json())["error"]
            assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}


async def test_the_right_key_gets_through() -> None:
    app = app_with_key()
    with trio.fail_after(30):
        resp = await app.test_client().get("/openapi.json", headers={"Authorization": "Bearer sekrit"})
        assert resp.status_code == 200
