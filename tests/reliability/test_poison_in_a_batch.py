"""One request that goes bad inside a running batch (its logits turn NaN; or the batched forward
raises whenever it is in the batch) fails alone: the four streams decoding beside it end with
exactly the tokens they get alone, over real sockets at max_batch_size 8."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest
import torch
import trio

from tests.http.conftest import running_server, tiny_engine
from tests.reliability.conftest import assert_drained, counter
from tinyloop.engine.engine import Engine
from tinyloop.engine.sequence import Sequence as Seq
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings

POISON = 4000  # a prompt starting with this token id goes bad after a few tokens
STREAMS = [{"prompt_tokens": [10 + i, 11, 12], "max_tokens": 48, "ignore_eos": True,
            "temperature": 0.7, "sample_seed": i} for i in range(4)]


def nan_rows(decode: Callable[[Sequence[Seq]], torch.Tensor]) -> Callable[[Sequence[Seq]], torch.Tensor]:
    def run(seqs: Sequence[Seq]) -> torch.Tensor:
        logits = decode(seqs).clone()
        for row, s in enumerate(seqs):
            if s.prompt[0] == POISON and len(s.output) >= 3:
                logits[row] = float("nan")
        return logits
    return run


def raising_with_poison(decode: Callable[[Sequence[Seq]], torch.Tensor]) -> Callable[[Sequence[Seq]], torch.Tensor]:
    def run(seqs: Sequence[Seq]) -> torch.Tensor:
        if any(s.prompt[0] == POISON and len(s.output) >= 3 for s in seqs):
            raise RuntimeError("device-side assert triggered")
        return decode(seqs)
    return run


def solo(engine: Engine, body: dict[str, Any]) -> list[int]:
    sampling = SamplingParams(temperature=body["temperature"], seed=body["sample_seed"], ignore_eos=True)
    req = GenerationRequest(prompt_tokens=tuple(body["prompt_tokens"]), max_tokens=body["max_tokens"],
                            sampling=sampling)
    return engine.generate(req).tokens


@pytest.mark.parametrize("poison", [nan_rows, raising_with_poison])
async def test_a_request_that_goes_bad_fails_alone_and_its_batch_goes_on(
        poison: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine()
    expected = [solo(engine, body) for body in STREAMS]
    monkeypatch.setattr(engine, "decode", poison(engine.decode))
    got: dict[int, list[int]] = {}
    bad: list[dict[str, Any]] = []

    async def stream(client: httpx.AsyncClient, i: int, body: dict[str, Any]) -> None:
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) async for line in resp.aiter_lines()
                      if line.startswith("data: {")]
        if i < 0:
            bad.extend(events)
        else:
            assert "error" not in events[-1], events[-1]
            got[i] = [e["token_id"] for e in events if "token_id" in e and not e.get("done")]

    with trio.fail_after(60):
        async with running_server(Settings(port=0, max_batch_size=8), engine) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            async with trio.open_nursery() as nursery:
                for i, body in enumerate(STREAMS):
                    nursery.start_soon(stream, client, i, body)
                nursery.start_soon(stream, client, -1, {**STREAMS[0], "prompt_tokens": [POISON, 11, 12]})
            resp = await client.post("/generate", json={**STREAMS[0], "prompt_tokens": [POISON, 1]})
            assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_error"
            assert_drained(srv)
            assert (counter(srv, "errored"), counter(srv, "completed")) == (2, 4)
            registry = srv.runtime.metrics.registry
            steps = registry.get_sample_value("tinyloop_batch_size_count") or 0
            alone = registry.get_sample_value("tinyloop_batch_size_bucket", {"le": "1.0"}) or 0
    assert got == dict(enumerate(expected))
    assert bad[-1]["error"]["code"] == "engine_error" and len([e for e in bad if "token_id" in e]) == 3
    assert steps - alone >= 40  # the poisoned request shared its steps with the streams
