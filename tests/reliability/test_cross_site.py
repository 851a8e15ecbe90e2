"""A web page on another site must not drive the server (faults 7 and 11 of issue 11).

* A cross-site ``text/plain`` POST needs no CORS preflight, so the body must be JSON with
  ``Content-Type: application/json`` (415 otherwise).
* A DNS-rebinding page reaches 127.0.0.1 under its own name: the ``Host`` must be a localhost
  name, a loopback address or the bound address unless ``allowed_hosts`` widens it (403).
* ``OPTIONS`` is no way around the API key: a CORS preflight is answered only for an allowed
  origin, and any other OPTIONS needs the key like every method (401, whether the route exists
  or not).
"""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.http.conftest import running_server
from tinyloop.http.factory import create_app
from tinyloop.settings import Settings

BODY = {"prompt": "hi", "max_tokens": 1}


def error(resp: httpx.Response) -> dict[str, object]:
    err: dict[str, object] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


async def test_a_post_that_is_not_json_is_415_and_starts_nothing() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            answers = [await client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                                         headers={"Content-Type": kind})
                       for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")]
            bare = await client.post("/generate", content=b'{"prompt": "hi"}')  # curl -d without -H
            ok = await client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                                   headers={"Content-Type": "application/json; charset=utf-8"})
            submitted = srv.runtime.metrics.registry.get_sample_value("tinyloop_requests_submitted_total")
    for resp in [*answers, bare]:
        assert resp.status_code == 415, resp.text
        assert error(resp)["code"] == "unsupported_media_type" and error(resp)["param"] == "Content-Type"
    assert ok.status_code == 200, ok.text
    assert submitted == 1  # only the JSON one reached the runtime


@pytest.mark.parametrize(("allowed", "host", "status"), [
    (None, "evil.example", 403),
    (None, "evil.example:8000", 403),
    (None, "10.1.2.3", 403),  # not the bound address
    (None, "localhost:8000", 200),
    (None, "127.0.0.1:8000", 200),
    (None, "[::1]:8000", 200),
    (None, "app.localhost", 200),
    ("models.lan, other.lan", "models.lan:8000", 200),
    ("models.lan", "evil.example", 403),
    ("*", "evil.example", 200),
])
async def test_the_host_header_is_checked(allowed: str | None, host: str, status: int) -> None:
    app = create_app(None, settings=Settings(allowed_hosts=allowed))
    with trio.fail_after(30):
        resp = await app.test_client().get("/openapi.json", headers={"Host": host})
    assert resp.status_code == status, (host, resp.status_code)
    if status == 403:
        err = await resp.get_json()
        assert err["error"]["code"] == "host_not_allowed" and err["error"]["param"] == "Host"


async def test_a_rebinding_page_cannot_post_to_a_live_server() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            rebound = await client.post("/v1/completions", json=BODY, headers={"Host": "attacker.example"})
            local = await client.post("/v1/completions", json=BODY)
    assert rebound.status_code == 403 and error(rebound)["code"] == "host_not_allowed"
    assert local.status_code == 200


async def test_a_server_bound_to_all_interfaces_accepts_its_addresses() -> None:
    app = create_app(None, settings=Settings(host="0.0.0.0"))
    with trio.fail_after(30):
        by_ip = await app.test_client().get("/openapi.json", headers={"Host": "192.168.1.20:8000"})
        by_name = await app.test_client().get("/openapi.json", headers={"Host": "evil.example"})
    assert (by_ip.status_code, by_name.status_code) == (200, 403)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/no/such/route"])
async def test_options_needs_the_key_unless_it_is_a_preflight_from_an_allowed_origin(path: str) -> None:
    app = create_app(None, settings=Settings(api_key="k", cors_origins="http://a.example"))
    client = app.test_client()
    with trio.fail_after(30):
        bare = await client.options(path)
        foreign = await client.options(path, headers={"Origin": "http://b.example",
                                                      "Access-Control-Request-Method": "POST"})
        preflight = await client.options(path, headers={"Origin": "http://a.example",
                                                        "Access-Control-Request-Method": "POST"})
        keyed = await client.options(path, headers={"Authorization": "Bearer k"})
    for resp in (bare, foreign):  # the same answer for every path: routes are not revealed
        assert resp.status_code == 401
        assert (await resp.get_json())["error"]["code"] == "invalid_api_key"
        assert "Allow" not in resp.headers and "Access-Control-Allow-Origin" not in resp.headers
    assert preflight.status_code == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "http://a.example"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert keyed.status_code in ((200,) if path != "/no/such/route" else (404,))
