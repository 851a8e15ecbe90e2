"""A request without ``max_tokens`` stops where the model's own context ends (vLLM's default:
context - prompt), on every generation route, when the artifact says what that context is; the
served context (longer here: 128 against the model's 48) still bounds what a client asks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.http.conftest import running_server, tiny_engine
from tests.http.inproc import TRAINED, serving, settings_for, short_context_artifact
from tinyloop.limits import ModelLimits
from tinyloop.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVED = 128  # settings_for's max_seq_len
CHAT = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return short_context_artifact(tmp_path_factory.mktemp("short") / "short.tinyloop")


def test_the_default_fills_the_model_context_and_keeps_the_route_default() -> None:
    limits = ModelLimits(max_seq_len=SERVED, vocab_size=10, default_loops=1, max_loops=1, trained_context=TRAINED)
    assert limits.max_tokens(10, None) == TRAINED - 10  # no route default: up to the model's context
    assert limits.max_tokens(10, None, default=16) == 16  # a route's own default, when it fits
    assert limits.max_tokens(40, None, default=16) == TRAINED - 40  # ... cut to the model's context
    assert limits.max_tokens(10, 100) == 100  # asked: as asked (the check holds it to the served context)
    assert limits.max_tokens(60, None) == SERVED - 60  # the model's context is full: the served one's room
    unknown = ModelLimits(max_seq_len=SERVED, vocab_size=10, default_loops=1, max_loops=1)
    assert unknown.max_tokens(10, None) == SERVED - 10  # not known: as before, to the served context


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _total(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"])


async def test_every_route_stops_at_the_model_context_without_max_tokens(artifact: Path) -> None:
    with trio.fail_after(120):
        async with serving(settings_for(artifact)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for path in ("/v1/chat/completions", "/api/v0/chat/completions"):
                out = await _post(client, path, CHAT)
                assert _total(out) == TRAINED and out["choices"][0]["finish_reason"] == "length", path
            streamed = await client.post("/v1/chat/completions", json={
                **CHAT, "stream": True, "stream_options": {"include_usage": True}})
            events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                      if line.startswith("data: {")]
            assert _total(events[-1]) == TRAINED
            # /v1/completions keeps its default of 16 where it fits; null and -1 ask for the context's end
            assert (await _post(client, "/v1/completions", {"prompt": [5] * 10, "ignore_eos": True})
                    )["usage"]["completion_tokens"] == 16
            assert (await _post(client, "/v1/completions", {"prompt": [5] * 40, "ignore_eos": True})
                    )["usage"]["completion_tokens"] == TRAINED - 40
            for to_the_end in (None, -1):
                out = await _post(client, "/v1/completions", {"prompt": [5] * 10, "max_tokens": to_the_end,
                                                              "ignore_eos": True})
                assert out["usage"]["completion_tokens"] == TRAINED - 10, to_the_end
            # /generate keeps its default of 64, cut to the model's context
            out = await _post(client, "/generate", {"prompt_tokens": [5] * 10, "ignore_eos": True})
            assert out["completion_tokens"] == TRAINED - 10


async def test_an_explicit_max_tokens_is_honoured_up_to_the_served_context(artifact: Path) -> None:
    with trio.fail_after(120):
        async with serving(settings_for(artifact)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            out = await _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 70})
            assert out["usage"]["completion_tokens"] == 70  # past the model's context, within the served one
            out = await _post(client, "/generate", {"prompt_tokens": [5] * 10, "max_tokens": 100, "ignore_eos": True})
            assert out["completion_tokens"] == 100
            resp = await client.post("/generate", json={"prompt_tokens": [5] * 10, "max_tokens": SERVED})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
            # a prompt past the model's context: the served context's room (the route default still caps)
            out = await _post(client, "/v1/completions", {"prompt": [5] * 60, "max_tokens": None, "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == SERVED - 60
            out = await _post(client, "/generate", {"prompt_tokens": [5] * 60, "ignore_eos": True})
            assert out["completion_tokens"] == 64


async def test_without_a_known_model_context_the_served_context_bounds_the_default() -> None:
    # an engine handed over as built: its artifact (and so the context it was built for) is not known
    settings = Settings(port=0, max_batch_size=2)
    with trio.fail_after(60):
        async with running_server(settings, engine=tiny_engine(max_seq_len=64)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            assert server.model.trained_context is None
            out = await _post(client, "/v1/chat/completions", CHAT)
            assert _total(out) == 64
