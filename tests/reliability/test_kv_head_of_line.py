"""The probe's KV head-of-line scenario: two long, high-loop streams whose worst cases do not fit
side by side must not hold up a short request behind them, and every request ends with the tokens
it gets alone (the one preempted on the way is recomputed exactly). A request that could never
fit in the pool is a 400 at once, never a wait."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from tests.http.conftest import running_server, tiny_engine
from tests.reliability.conftest import assert_drained
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings

pytestmark = pytest.mark.slow

BIG = {"prompt_tokens": [104, 105], "max_tokens": 160, "loops": 16, "ignore_eos": True}
SMALL = {"prompt_tokens": [7, 8, 9], "max_tokens": 4, "ignore_eos": True}


def solo(engine: object, body: dict[str, object]) -> list[int]:
    req = GenerationRequest(prompt_tokens=tuple(body["prompt_tokens"]),  # type: ignore[arg-type]
                            max_tokens=int(body["max_tokens"]),  # type: ignore[call-overload]
                            loops=body.get("loops"),  # type: ignore[arg-type]
                            sampling=SamplingParams(temperature=0, ignore_eos=True))
    return engine.generate(req).tokens  # type: ignore[attr-defined,no-any-return]


async def test_a_short_request_is_not_held_behind_two_that_cannot_run_side_by_side() -> None:
    engine = tiny_engine()
    need = engine.kv_blocks_needed(GenerationRequest(prompt_tokens=(104, 105), max_tokens=160, loops=16))
    per_block = engine.kv_statistics().bytes_per_block
    # one big request's worst case fits, two do not (the probe: 8448 of 10240 blocks each)
    settings = Settings(port=0, max_batch_size=32, kv_cache_mb=(need * 13 // 10) * per_block / 2**20)
    expected = {"big": solo(engine, BIG), "small": solo(engine, SMALL)}
    engine = tiny_engine(kv_cache_mb=settings.kv_cache_mb)
    assert need <= engine.kv_statistics().blocks_total < 2 * need
    got: dict[str, list[int]] = {}
    progress = {"big0": 0, "big1": 0}
    at_small_done: dict[str, int] = {}
    at_big1_start: dict[str, int] = {}

    async def stream(client: httpx.AsyncClient, name: str, body: dict[str, object]) -> None:
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200, await resp.aread()
            tokens = []
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    if "token_id" in event and not event.get("done"):
                        tokens.append(event["token_id"])
                        progress[name] = len(tokens)
                        if name == "big1" and len(tokens) == 1:
                            at_big1_start.update(progress)
        got[name] = tokens

    with trio.fail_after(240):
        async with running_server(settings, engine) as srv, httpx.AsyncClient(base_url=srv.url, timeout=240) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream, client, "big0", BIG)
                nursery.start_soon(stream, client, "big1", BIG)
                while progress["big0"] < 2:  # the first big one runs; the second is dispatched
                    await trio.sleep(0.01)
                resp = await client.post("/generate", json=SMALL)
                at_small_done.update(progress)
                assert resp.status_code == 200, resp.text
                got["small"] = resp.json()["tokens"]
            assert_drained(srv)
            preempted = srv.runtime.metrics.registry.get_sample_value("tinyloop_preemptions_total")
    assert got == {"big0": expected["big"], "big1": expected["big"], "small": expected["small"]}
    assert at_big1_start["big0"] < BIG["max_tokens"]  # the big ones ran side by side, growing
    assert at_small_done["big0"] < BIG["max_tokens"]  # the short one waited for neither
    assert preempted and preempted >= 1  # the pool ran dry on the way: one big one was recomputed


async def test_a_request_that_can_never_fit_is_refused_at_once() -> None:
    engine = tiny_engine(kv_cache_mb=1.0)  # 512 blocks; 34 slots x 26 blocks = 884 needed
    with trio.fail_after(30):
        async with running_server(Settings(port=0), engine) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for path in ("/generate", "/v1/completions"):
                body = {**BIG, "prompt": "hi"} if path != "/generate" else BIG
                if path != "/generate":
                    del body["prompt_tokens"]
                resp = await client.post(path, json=body)
                assert resp.status_code == 400, resp.text
                error = resp.json()["error"]
                assert error["param"] == "max_tokens" and "KV" in error["message"], error
            resp = await client.post("/generate", json={**BIG, "max_tokens": 40})  # this one fits
            assert resp.status_code == 200 and len(resp.json()["tokens"]) == 40
            assert srv.runtime.statistics().in_flight == 0
