"""A 401 says how to authenticate (finding 8 of issue 29): ``WWW-Authenticate: Bearer``
(RFC 9110 section 15.5.2 requires the header on every 401; RFC 6750 section 3 names the
scheme), with ``error="invalid_token"`` when a bearer token was sent but is not the key."""

from __future__ import annotations

import pytest
import trio

from tinyloop.http.factory import create_app
from tinyloop.settings import Settings


@pytest.mark.parametrize(("header", "challenge"), [
    (None, "Bearer"),
    ("Basic c2Vrcml0", "Bearer"),
    ("sekrit", "Bearer"),
    ("Bearer wrong", 'Bearer error="invalid_token"'),
    ("bearer wrong", 'Bearer error="invalid_token"'),
])
async def test_a_401_carries_the_bearer_challenge(header: str | None, challenge: str) -> None:
    client = create_app(None, settings=Settings(api_key="sekrit")).test_client()
    headers = {} if header is None else {"Authorization": header}
    with trio.fail_after(30):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            resp = await client.open(path, method=method, headers=headers, json={"prompt": "hi"})
            assert resp.status_code == 401, (method, path)
            assert resp.headers["WWW-Authenticate"] == challenge, (method, path)
            assert (await resp.get_json())["error"]["code"] == "invalid_api_key"


async def test_the_right_key_gets_no_challenge() -> None:
    client = create_app(None, settings=Settings(api_key="sekrit")).test_client()
    with trio.fail_after(30):
        resp = await client.get("/openapi.json", headers={"Authorization": "Bearer sekrit"})
    assert resp.status_code == 200 and "WWW-Authenticate" not in resp.headers
