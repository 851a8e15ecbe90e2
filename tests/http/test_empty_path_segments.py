"""A path with an empty segment (``/ui//x``, ``/v1//models``) is answered with the error object
(finding 8 of issue 29): werkzeug used to answer a 308 to the merged path with an HTML body,
which no error handler sees. A path is matched as sent; werkzeug drops leading slashes before
matching, so ``//v1/models`` is ``/v1/models``."""

from __future__ import annotations

import pytest
import trio

from tinyloop.http.factory import create_app
from tinyloop.settings import Settings


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/ui//x"), ("GET", "/ui//index.html"), ("GET", "/ui/a//b"), ("GET", "/v1//models"),
    ("POST", "/v1//completions"), ("GET", "/v1/models//"), ("GET", "/healthz//"),
])
async def test_an_empty_segment_is_a_404_error_object(method: str, path: str) -> None:
    client = create_app(None, settings=Settings()).test_client()
    with trio.fail_after(30):
        resp = await client.open(path, method=method, json={"prompt": "hi"})
        body = await resp.get_json()
    assert (resp.status_code, resp.mimetype) == (404, "application/json"), (path, resp.status_code)
    assert "Location" not in resp.headers
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert path in body["error"]["message"] and "empty segment" in body["error"]["message"]


async def test_a_leading_double_slash_is_the_path_without_it() -> None:
    client = create_app(None, settings=Settings()).test_client()
    with trio.fail_after(30):
        resp = await client.get("//openapi.json")
    assert resp.status_code == 200 and "paths" in await resp.get_json()
