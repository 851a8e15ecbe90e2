"""Engine faults: a ThreadedEngine whose steps fail on a seeded schedule (once with
``MemoryError``). Only the requests of a failing step fail (500 when not streamed; an SSE error
event, then ``[DONE]``, when streamed) and the next requests succeed. An ``EngineBroken`` turns
the runtime unhealthy: ``/healthz`` answers 503 with the reason and new work is refused.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

import httpx
import trio

from tests.http.conftest import LiveServer, running_server, tiny_engine
from tests.reliability.conftest import assert_drained, counter, sse_events
from tinyloop.actors.port import ThreadedEngine, engine_errors
from tinyloop.engine.engine import Engine
from tinyloop.engine.sequence import Sequence as Seq
from tinyloop.engine.sequence import TokenEvent
from tinyloop.errors import EngineBroken
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings

MAX_TOKENS = 4


class FaultyEngine(ThreadedEngine):
    """Raises ``faults[(r, k)]`` inside the worker thread on the ``k``-th step of the ``r``-th
    request it sees (counting per request keeps the schedule fixed when a fault cuts a
    request short)."""

    def __init__(self, engine: Engine, faults: dict[tuple[int, int], BaseException]) -> None:
        super().__init__(engine)
        self.faults = faults
        self.seen: dict[str, list[int]] = {}  # request id -> [ordinal, steps so far]

    async def step(self, seqs: Sequence[Seq]) -> list[TokenEvent]:
        with engine_errors():  # as ThreadedEngine.step, with the fault raised in the thread
            return await trio.to_thread.run_sync(self.step_or_fail, list(seqs))

    def step_or_fail(self, seqs: list[Seq]) -> list[TokenEvent]:
        fault = None
        for seq in seqs:
            where = self.seen.setdefault(seq.request.request_id, [len(self.seen), 0])
            fault = fault or self.faults.pop((where[0], where[1]), None)
            where[1] += 1
        if fault is not None:
            raise fault
        return self.engine.step(seqs)


def faulty_server(faults: dict[tuple[int, int], BaseException]) -> AbstractAsyncContextManager[LiveServer]:
    engine = tiny_engine()
    settings = Settings(port=0, max_batch_size=1, prefix_caching=False)
    return running_server(settings, FaultyEngine(engine, faults), ServedModel.from_engine(engine, settings))


async def test_failing_steps_fail_only_their_request_and_the_next_ones_succeed() -> None:
    # One request at a time, each taking MAX_TOKENS steps (prefill makes the first token):
    # the schedule picks which requests meet a fault.
    rng = random.Random(3)
    n_requests = 12
    doomed = sorted(rng.sample(range(n_requests), 4))  # [2, 3, 8, 9]: two plain, two streamed
    faults: dict[tuple[int, int], BaseException] = {
        (r, rng.randrange(MAX_TOKENS)): RuntimeError(f"injected fault in request {r}")
        if r != doomed[-1] else MemoryError("injected: cannot allocate") for r in doomed}
    with trio.fail_after(60):
        async with (faulty_server(faults) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            for r in range(n_requests):
                body = {"prompt": f"fault {r}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
                if r % 2:
                    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                        assert resp.status_code == 200
                        events = await sse_events(resp)
                    assert events[-1] == "[DONE]"
                    chunks = [json.loads(e) for e in events[:-1]]
                    errors = [c["error"] for c in chunks if "error" in c]
                    if r in doomed:
                        assert len(errors) == 1 and "error" in chunks[-1], chunks
                        assert errors[0]["message"] and errors[0]["type"], errors
                        if r == doomed[-1]:  # the MemoryError, translated at the boundary
                            assert "out of memory" in errors[0]["message"], errors
                    else:
                        assert not errors
                        assert "".join(c["choices"][0]["text"] for c in chunks)
                else:
                    resp = await client.post("/v1/completions", json=body)
                    if r in doomed:
                        assert resp.status_code == 500, resp.text
                        error = resp.json()["error"]
                        assert set(error) == {"message", "type", "param", "code"}
                    else:
                        assert resp.status_code == 200, resp.text
                        assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
            assert not faults  # every fault was met
            assert counter(srv, "errored") == len(doomed)
            assert counter(srv, "completed") == n_requests - len(doomed)
            assert (await client.get("/healthz")).status_code == 200
            assert_drained(srv)


async def test_a_broken_engine_makes_healthz_503_with_the_reason() -> None:
    with trio.fail_after(30):
        async with (faulty_server({(0, 1): EngineBroken("injected: device lost")}) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            body = {"prompt": "broken", "max_tokens": MAX_TOKENS, "ignore_eos": True}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 500 and "device lost" in resp.json()["error"]["message"]
            health = await client.get("/healthz")
            assert health.status_code == 503 and "device lost" in health.text, health.text
            again = await client.post("/v1/completions", json=body)
            assert again.status_code >= 500 and "device lost" in again.json()["error"]["message"]
            assert_drained(srv)
