"""Every client error is exactly OpenAI's error object, naming the field to blame; CORS.

Sent with httpx to a real server. A refused request never leaves the server, or the client's
pooled connection, unusable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from tests.http.conftest import running_server
from tinyloop.settings import Settings

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    status: int
    param: str | None
    method: str = "POST"
    send: dict[str, Any] = field(default_factory=dict)  # httpx keyword arguments
    code: str | None = None  # checked when set


def chat(**body: Any) -> dict[str, Any]:
    return {"json": {"messages": MESSAGES, **body}}


def raw(text: bytes) -> dict[str, Any]:
    return {"content": text, "headers": JSON}


LONG = "hello " * 300  # > 256 tokens, the tiny engine's max_seq_len

CASES = [
    Case("malformed JSON", CHAT, 400, None, send=raw(b'{"messages": ['), code="invalid_json"),
    Case("empty body", CHAT, 400, None, send=raw(b""), code="invalid_json"),
    Case("JSON array", CHAT, 400, None, send={"json": [MESSAGES]}, code="invalid_json"),
    Case("invalid UTF-8", CHAT, 400, None, code="invalid_json",
         send=raw(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')),
    Case("max_tokens string", CHAT, 400, "max_tokens", send=chat(max_tokens="x")),
    Case("temperature string", TEXT, 400, "temperature",
         send={"json": {"prompt": "hi", "temperature": "hot"}}),
    Case("messages string", CHAT, 400, "messages", send={"json": {"messages": "hi"}}),
    Case("bad role", CHAT, 400, "messages.0.role",
         send={"json": {"messages": [{"role": "robot", "content": "hi"}]}}),
    Case("negative max_tokens", CHAT, 400, "max_tokens", send=chat(max_tokens=-5)),
    Case("huge max_tokens", CHAT, 400, "max_tokens", send=chat(max_tokens=10**9),
         code="context_length_exceeded"),
    Case("huge max_tokens text", TEXT, 400, "max_tokens", code="context_length_exceeded",
         send={"json": {"prompt": "hi", "max_tokens": 10**30}}),
    Case("NaN temperature", CHAT, 400, "temperature",
         send=raw(b'{"temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}')),
    Case("Infinity top_p", TEXT, 400, "top_p", send=raw(b'{"prompt": "hi", "top_p": Infinity}')),
    Case("empty messages", CHAT, 400, "messages", send={"json": {"messages": []}}),
    Case("missing messages", CHAT, 400, "messages", send={"json": {"max_tokens": 1}}),
    Case("empty prompt", TEXT, 400, "prompt", send={"json": {"prompt": ""}}),
    Case("empty token prompt", TEXT, 400, "prompt", send={"json": {"prompt": []}}),
    Case("token outside vocab", TEXT, 400, "prompt", send={"json": {"prompt": [10**9]}}),
    Case("oversize prompt", TEXT, 400, "prompt", send={"json": {"prompt": LONG, "max_tokens": 1}},
         code="context_length_exceeded"),
    Case("oversize prompt, no max_tokens", TEXT, 400, "prompt", send={"json": {"prompt": LONG}},
         code="context_length_exceeded"),
    Case("oversize messages", CHAT, 400, "messages", code="context_length_exceeded",
         send={"json": {"messages": [{"role": "user", "content": LONG}]}}),
    Case("unknown field", CHAT, 400, "frobnicate", send=chat(frobnicate=1),
         code="unsupported_parameter"),
    Case("suffix", TEXT, 400, "suffix", send={"json": {"prompt": "hi", "suffix": "x"}},
         code="unsupported_parameter"),
    Case("best_of above n", TEXT, 400, "best_of", send={"json": {"prompt": "hi", "best_of": 2}}),
    Case("stream_options without stream", CHAT, 400, "stream_options",
         send=chat(stream_options={"include_usage": True})),
    Case("loops over the model's max", CHAT, 400, "loops", send=chat(loops=10**6)),
    Case("unknown model", CHAT, 404, "model", send=chat(model="nope"), code="model_not_found"),
    Case("unknown route", "/v1/nope", 404, None, method="GET"),
    Case("unknown route, POST", "/v2/chat/completions", 404, None, send=chat()),
    Case("wrong method", CHAT, 405, None, method="GET"),
    Case("wrong method on models", "/v1/models", 405, None, send=chat()),
]


def problems_with(case: Case, resp: httpx.Response) -> list[str]:
    """What is wrong with ``resp`` as OpenAI's error object for ``case`` (nothing: [])."""
    try:
        body = resp.json()
    except ValueError:
        return [f"{case.name}: {resp.status_code} body is not JSON: {resp.text[:80]!r}"]
    found = []
    if resp.status_code != case.status:
        found.append(f"status {resp.status_code}, expected {case.status}")
    if not resp.headers.get("content-type", "").startswith("application/json"):
        found.append(f"content-type {resp.headers.get('content-type')!r}")
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(error, dict) or \
            set(error) != {"message", "type", "param", "code"}:
        return [f"{case.name}: not an error object: {body}"]
    if not isinstance(error["message"], str) or not error["message"]:
        found.append("empty message")
    if not isinstance(error["type"], str) or not isinstance(error["code"], str | None):
        found.append(f"type/code {error['type']!r}/{error['code']!r}")
    if error["param"] != case.param:
        found.append(f"param {error['param']!r}, expected {case.param!r}")
    if case.code is not None and error["code"] != case.code:
        found.append(f"code {error['code']!r}, expected {case.code!r}")
    return [f"{case.name}: {p} in {body}" for p in found]


async def test_every_client_error_is_an_openai_error_object_naming_the_field() -> None:
    problems = []
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for case in CASES:
                resp = await client.request(case.method, case.path, **case.send)
                problems += problems_with(case, resp)
                if case.status == 405:
                    assert resp.headers.get("Allow"), f"{case.name}: a 405 needs an Allow header"
            ok = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
            text = await client.post(TEXT, json={"prompt": "hi", "max_tokens": 2})
    assert not problems, "\n".join(problems)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert text.status_code == 200 and text.json()["choices"][0]["text"]


LIMIT_CASES = [  # (path, body, the field to blame): every model limit, on every kind of route
    (CHAT, {"messages": MESSAGES, "loops": 16, "max_completion_tokens": 200}, "max_completion_tokens"),
    (CHAT, {"messages": MESSAGES, "loops": 16, "max_tokens": 200}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "exit": {"kind": "gate", "threshold": 0.5}}, "exit"),
    (CHAT, {"messages": MESSAGES, "loops": 2, "exit": {"kind": "kl", "threshold": 0.1, "min_loops": 3}},
     "exit"),
    (TEXT, {"prompt": "hi", "loops": 17}, "loops"),
    (TEXT, {"prompt": "hi", "cache_window": 1, "speculation": {"draft_loops": 1}}, "cache_window"),
    (TEXT, {"prompt": "hi", "loops": 2, "speculation": {"draft_loops": 3}}, "draft_loops"),
    (TEXT, {"prompt": "hi", "exit": {"kind": "kl", "threshold": 0.1}, "speculation": {}}, "mode"),
    ("/api/v0/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/generate", {"prompt_tokens": [1, 10**6]}, "prompt_tokens"),
    ("/generate", {"prompt": "hi", "max_tokens": 250, "loops": 16}, "max_tokens"),
    ("/generate/speculative", {"prompt": "hi", "verify_loops": 17}, "verify_loops"),
    ("/generate/speculative", {"prompt": "hi", "loops": 17}, "loops"),
    ("/generate/tree_speculative", {"prompt": "hi", "max_tokens": 250, "verify_loops": 16}, "max_tokens"),
]


async def test_a_model_limit_is_a_400_naming_the_field_the_client_set() -> None:
    """The limits (loops, context, vocabulary, exit, speculation, the KV pool) are checked once,
    before anything is queued; the error names the body's field (``max_completion_tokens`` when
    that is the one given, ``prompt_tokens``, ``verify_loops``)."""
    from tests.http.conftest import tiny_engine

    with trio.fail_after(30):
        # a 1 MB KV pool: 200 tokens fit at 4 loops, not at 16
        async with running_server(engine=tiny_engine(kv_cache_mb=1)) as srv, \
                httpx.AsyncClient(base_url=srv.url) as client:
            problems = []
            for path, body, param in LIMIT_CASES:
                resp = await client.post(path, json=body)
                error = resp.json().get("error") or {}
                if resp.status_code != 400 or error.get("param") != param:
                    problems.append(f"{path} {body}: {resp.status_code} {resp.text}, expected {param}")
            assert srv.runtime.statistics().dispatched == 0
            fits = await client.post(CHAT, json={"messages": MESSAGES, "max_completion_tokens": 200,
                                                 "ignore_eos": True})
    assert not problems, "\n".join(problems)
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 200


def post_then_reuse(url: str, refused: list[tuple[str, bytes, dict[str, str]]],
                    then: list[tuple[str, str, dict[str, Any]]]) -> list[httpx.Response]:
    """Requests on one pooled connection, in a worker thread: httpx's async client under Trio
    leaves its request-body generator unfinished when the server answers before the upload ends,
    and Trio warns when that generator is collected; the sync client has no such generator."""
    with httpx.Client(base_url=url, timeout=10) as client:
        out = [client.post(path, content=body, headers=headers) for path, body, headers in refused]
        return out + [client.request(method, path, **kw) for method, path, kw in then]


async def test_a_body_over_the_limit_is_413_and_the_connection_stays_usable() -> None:
    big = b'{"messages": "' + b"x" * (10 * 2**20) + b'"}'
    case = Case("10 MB body", CHAT, 413, None)
    with trio.fail_after(30):
        async with running_server() as srv:
            assert srv.settings.max_body_bytes == 4 * 2**20
            refused, again = await trio.to_thread.run_sync(
                post_then_reuse, srv.url, [(CHAT, big, JSON)],
                [("POST", CHAT, {"json": {"messages": MESSAGES, "max_tokens": 2}})])
    assert not problems_with(case, refused), problems_with(case, refused)
    assert again.status_code == 200


async def test_a_request_refused_before_its_body_arrived_does_not_wedge_the_connection() -> None:
    # The 401 goes out before the 1 MB body is read; the connection must not be reused for the
    # next request (it was: hypercorn stopped answering on it and the client hung to its timeout).
    body = b"x" * 2**20
    with trio.fail_after(30):
        async with running_server(Settings(port=0, api_key="k")) as srv:
            *refused, health, ok = await trio.to_thread.run_sync(
                post_then_reuse, srv.url, [(CHAT, body, JSON), ("/nope", body, JSON)],
                [("GET", "/healthz", {}),
                 ("POST", CHAT, {"json": {"messages": MESSAGES, "max_tokens": 1},
                                 "headers": {"Authorization": "Bearer k"}})])
    assert [r.status_code for r in refused] == [401, 401]
    assert all(r.headers.get("Connection") == "close" for r in refused)
    assert health.status_code == 200 and ok.status_code == 200
    assert ok.headers.get("Connection") != "close"


async def test_cors_is_off_by_default() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            resp = await client.get("/v1/models", headers={"Origin": "http://a.example"})
            preflight = await client.options(CHAT, headers={
                "Origin": "http://a.example", "Access-Control-Request-Method": "POST"})
    assert resp.status_code == 200
    assert "access-control-allow-origin" not in resp.headers
    assert "access-control-allow-origin" not in preflight.headers


async def test_cors_echoes_an_allowed_origin_and_answers_preflight_without_the_key() -> None:
    settings = Settings(port=0, cors_origins="http://a.example", api_key="k")
    auth = {"Authorization": "Bearer k"}
    with trio.fail_after(30):
        async with running_server(settings) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            allowed = await client.get("/v1/models", headers={"Origin": "http://a.example", **auth})
            other = await client.get("/v1/models", headers={"Origin": "http://b.example", **auth})
            preflight = await client.options(CHAT, headers={
                "Origin": "http://a.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            posted = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1},
                                       headers={"Origin": "http://a.example", **auth})
            refused = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1},
                                        headers={"Origin": "http://a.example"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://a.example"
    assert "Origin" in allowed.headers.get("vary", "")
    assert "access-control-allow-origin" not in other.headers
    assert preflight.status_code in (200, 204)
    assert preflight.headers["access-control-allow-origin"] == "http://a.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allow_headers = preflight.headers["access-control-allow-headers"].lower()
    assert "authorization" in allow_headers and "content-type" in allow_headers
    assert posted.status_code == 200
    assert posted.headers["access-control-allow-origin"] == "http://a.example"
    # a browser can read the 401 too (the error object, not an opaque CORS failure)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "http://a.example"
