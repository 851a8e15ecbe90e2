"""TinyLoop's native routes: ``/generate`` with every knob, its speculative variants, the tokenizer
routes and the OpenAPI document.

A knob is shown to reach the engine by comparing the HTTP result with a second, identical
``tiny_engine()`` run directly on the same request (and, where the knob changes the output, with
the default run).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from tests.http.conftest import running_server, sse_events, tiny_engine
from tinyloop.engine.engine import Engine
from tinyloop.http.factory import create_app
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings

PROMPT = "Once upon a time"
RESULT_FIELDS = {"id", "tokens", "text", "finish_reason", "prompt_tokens", "completion_tokens",
                 "wall_ms", "stop_reason", "logprobs", "loops", "mean_loops", "time_to_first_token_ms", "cached_tokens"}


@asynccontextmanager
async def client_for(settings: Settings | None = None,
                     engine: Engine | None = None) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with running_server(settings, engine) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        yield srv, client


async def generate(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 10, **body})
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def reference(engine: Engine, **fields: Any) -> list[int]:
    """The tokens a direct engine run gives for ``PROMPT`` (greedy unless ``sampling`` says)."""
    sampling = fields.pop("sampling", SamplingParams(temperature=0.0))
    req = GenerationRequest(prompt_tokens=tuple(engine.tokenizer.encode(PROMPT)), max_tokens=10,
                            sampling=sampling, **fields)
    return engine.generate(req).tokens


async def test_generate_result_fields() -> None:
    with trio.fail_after(30):
        async with client_for() as (srv, client):
            out = await generate(client)
            assert set(out) == RESULT_FIELDS
            assert out["id"].startswith("gen-")
            assert out["tokens"] == reference(tiny_engine())
            assert out["text"] == srv.model.tokenizer.decode(out["tokens"])
            assert (out["finish_reason"], out["stop_reason"]) == ("length", "length")
            assert out["prompt_tokens"] == len(srv.model.tokenizer.encode(PROMPT))
            assert out["completion_tokens"] == 10 and out["logprobs"] is None
            assert out["loops"] == srv.model.default_loops and out["mean_loops"] == srv.model.default_loops
            assert 0 < out["time_to_first_token_ms"] <= out["wall_ms"]


async def test_generate_streamed_events_then_the_result() -> None:
    with trio.fail_after(30):
        async with client_for() as (srv, client):
            plain = await generate(client)
            resp = await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 10,
                                                        "stream": True, "logprobs": True})
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]"
            final, tokens = events[-2], events[:-2]
            assert final["done"] is True and set(final) == RESULT_FIELDS | {"done"}
            assert [e["index"] for e in tokens] == list(range(10))
            assert [e["token_id"] for e in tokens] == plain["tokens"] == final["tokens"]
            assert "".join(e["text"] for e in tokens) == plain["text"] == final["text"]
            assert {e["id"] for e in tokens} == {final["id"]}
            assert all(e["loops"] == srv.model.default_loops for e in tokens)
            assert [e["logprob"] for e in tokens] == [lp["logprob"] for lp in final["logprobs"]]


async def test_loops_knob() -> None:
    with trio.fail_after(30):
        async with client_for() as (srv, client):
            default = await generate(client)
            for loops in (1, 2):
                out = await generate(client, loops=loops)
                assert out["loops"] == loops and out["mean_loops"] == loops
                assert out["tokens"] == reference(tiny_engine(), loops=loops) != default["tokens"]
            too_many = await client.post("/generate", json={"prompt": PROMPT, "loops": srv.model.max_loops + 1})
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "loops"
            zero = await client.post("/generate", json={"prompt": PROMPT, "loops": 0})
            assert zero.status_code == 400 and zero.json()["error"]["param"] == "loops"


async def test_cache_window_and_warm_start_knobs() -> None:
    with trio.fail_after(30):
        async with client_for() as (_, client):
            default = (await generate(client))["tokens"]
            ref = tiny_engine()
            window = await generate(client, cache_window=1)
            assert window["tokens"] == reference(ref, cache_window=1) != default
            warm = await generate(client, warm_start=True)
            assert warm["tokens"] == reference(ref, warm_start=True) != default
            bad = await client.post("/generate", json={"prompt": PROMPT, "cache_window": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_window"


async def test_sample_seed_reproduces_a_sampled_run() -> None:
    with trio.fail_after(30):
        async with client_for() as (_, client):
            first = await generate(client, temperature=1.0, sample_seed=1)
            again = await generate(client, temperature=1.0, sample_seed=1)
            other = await generate(client, temperature=1.0, sample_seed=2)
            assert first["tokens"] == again["tokens"] != other["tokens"]
            assert first["tokens"] == reference(tiny_engine(), sampling=SamplingParams(temperature=1.0, seed=1))


async def test_stop_strings() -> None:
    with trio.fail_after(30):
        async with client_for() as (_, client):
            out = await generate(client, max_tokens=20, stop=["subprocess"])
            assert out["text"] == "Loader" + "if" * 7  # greedy text is Loader if*7 subprocess ...
            assert (out["finish_reason"], out["stop_reason"]) == ("stop", "stop_string")
            resp = await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 20,
                                                        "stop": ["subprocess"], "stream": True})
            events = sse_events(resp.text)
            assert "".join(e["text"] for e in events[:-2]) == out["text"]
            assert events[-2]["stop_reason"] == "stop_string"
            empty = await client.post("/generate", json={"prompt": PROMPT, "stop": [""]})
            assert empty.status_code == 400 and empty.json()["error"]["param"].startswith("stop")


async def test_prompt_tokens_equal_to_the_encoding_give_the_same_result() -> None:
    with trio.fail_after(30):
        async with client_for() as (_, client):
            ids = (await client.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
            by_text = await generate(client)
            resp = await client.post("/generate", json={"prompt_tokens": ids, "max_tokens": 10})
            by_ids = resp.json()
            assert resp.status_code == 200
            assert (by_ids["tokens"], by_ids["text"], by_ids["prompt_tokens"]) == \
                (by_text["tokens"], by_text["text"], by_text["prompt_tokens"])
            both = await client.post("/generate", json={"prompt": PROMPT, "prompt_tokens": ids})
            neither = await client.post("/generate", json={"max_tokens": 3})
            empty = await client.post("/generate", json={"prompt_tokens": []})
            assert [r.status_code for r in (both, neither, empty)] == [400, 400, 400]
            assert empty.json()["error"]["param"] == "prompt_tokens"


async def test_logprobs() -> None:
    with trio.fail_after(30):
        async with client_for() as (_, client):
            out = await generate(client, logprobs=True, top_logprobs=3)
            assert len(out["logprobs"]) == out["completion_tokens"] == 10
            for token, lp in zip(out["tokens"], out["logprobs"]):
                assert lp["token_id"] == token and lp["logprob"] <= 0
                assert len(lp["top"]) == 3 and lp["top"][0] == [token, lp["logprob"]]  # greedy: best
                values = [v for _, v in lp["top"]]
                assert values == sorted(values, reverse=True)
            only_top = await generate(client, top_logprobs=2)  # top_logprobs alone turns them on
            assert all(len(lp["top"]) == 2 for lp in only_top["logprobs"])
            bad = await client.post("/generate", json={"prompt": PROMPT, "top_logprobs": 21})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


async def _wait_for(predicate: Any) -> None:
    while not predicate():
        await trio.sleep(0.01)


async def test_priority_runs_the_higher_request_first() -> None:
    """One engine slot, held by a long stream; a low then a high priority request queue behind
    it; when the slot frees, the high one runs first."""
    settings = Settings(port=0, max_batch_size=1)
    with trio.fail_after(60):
        async with client_for(settings, tiny_engine(max_seq_len=4096)) as (srv, client):
            done: list[int] = []

            async def run(priority: int) -> None:
                await generate(client, max_tokens=2, priority=priority)
                done.append(priority)

            async with client.stream("POST", "/generate", json={
                    "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as holder:
                await _wait_for(lambda: srv.runtime.statistics().in_flight == 1)  # not read: it runs on
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run, -5)
                    await _wait_for(lambda: srv.runtime.statistics().queue_depth == 1)
                    nursery.start_soon(run, 5)
                    await _wait_for(lambda: srv.runtime.statistics().queue_depth == 2)
                    await holder.aclose()
            assert done == [5, -5]
            bad = await client.post("/generate", json={"prompt": PROMPT, "priority": 10_000})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


async def test_slo_ms_admits_or_refuses_with_retry_after() -> None:
    settings = Settings(port=0, max_batch_size=1)
    with trio.fail_after(60):
        async with client_for(settings, tiny_engine(max_seq_len=4096)) as (srv, client):
            await generate(client, max_tokens=2, slo_ms=0.001)  # nothing ahead of it: admitted
            async with client.stream("POST", "/generate", json={
                    "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as holder:
                await _wait_for(lambda: srv.runtime.statistics().in_flight == 1)
                refused = await client.post("/generate", json={"prompt": PROMPT, "slo_ms": 0.001})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "slo_unattainable"
                assert int(refused.headers["Retry-After"]) >= 1
                await holder.aclose()
            ok = await generate(client, max_tokens=2, slo_ms=60_000)
            assert ok["completion_tokens"] == 2
            bad = await client.post("/generate", json={"prompt": PROMPT, "slo_ms": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "slo_ms"


SPEC_FIELDS = {"stats", "draft_tokens", "accepted_draft_tokens", "rejected_draft_tokens"}
SPEC_ROUTES = [("/generate/speculative", {"draft_loops": 2, "draft_ahead": 4}),
               ("/generate/tree_speculative", {"draft_loops": 1, "draft_ahead": 3, "K_branches": 2})]


def spec_total(srv: Any, what: str) -> float:
    return srv.runtime.metrics.registry.get_sample_value(f"tinyloop_spec_{what}_tokens_total") or 0.0


async def test_speculative_routes_give_the_generate_result_plus_draft_counts() -> None:
    with trio.fail_after(60):
        async with client_for() as (srv, client):
            plain = await generate(client)
            drafted = 0
            for path, extra in SPEC_ROUTES:
                resp = await client.post(path, json={"prompt": PROMPT, "max_tokens": 10, **extra})
                assert resp.status_code == 200, resp.text
                out = resp.json()
                assert set(out) == RESULT_FIELDS | SPEC_FIELDS
                assert (out["tokens"], out["text"]) == (plain["tokens"], plain["text"])  # greedy
                assert out["draft_tokens"] == out["accepted_draft_tokens"] + out["rejected_draft_tokens"]
                assert out["stats"] == {"total_draft_tokens_count": out["draft_tokens"],
                                        "accepted_draft_tokens_count": out["accepted_draft_tokens"],
                                        "rejected_draft_tokens_count": out["rejected_draft_tokens"]}
                assert out["draft_tokens"] > 0 and out["loops"] == out["mean_loops"] == srv.model.default_loops
                drafted += out["draft_tokens"]
                streamed = await client.post(path, json={"prompt": PROMPT, "max_tokens": 10, "stream": True,
                                                         **extra})
                events = sse_events(streamed.text)
                assert events[-1] == "[DONE]" and events[-2]["done"] is True
                final, tokens = events[-2], events[:-2]
                assert [e["token_id"] for e in tokens] == plain["tokens"] == final["tokens"]
                assert [e["index"] for e in tokens] == list(range(10))
                assert "".join(e["text"] for e in tokens) == plain["text"]
                assert SPEC_FIELDS <= set(final) and final["draft_tokens"] == out["draft_tokens"]
                drafted += final["draft_tokens"]
            # verify_loops is the request's loops; sampled requests reproduce with their seed
            two = await client.post("/generate/speculative", json={"prompt": PROMPT, "max_tokens": 10,
                                                                   "verify_loops": 2, "draft_loops": 1})
            assert two.json()["tokens"] == reference(tiny_engine(), loops=2) and two.json()["loops"] == 2
            drafted += two.json()["draft_tokens"]
            body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "sample_seed": 3}
            sampled = [(await client.post(path, json={**body, **extra})).json() for path, extra in SPEC_ROUTES * 2]
            assert sampled[0]["tokens"] == sampled[2]["tokens"] and sampled[1]["tokens"] == sampled[3]["tokens"]
            drafted += sum(r["draft_tokens"] for r in sampled)
            # the counts reach the metrics
            await _wait_for(lambda: spec_total(srv, "drafted") == drafted)
            assert spec_total(srv, "accepted") + spec_total(srv, "rejected") == drafted
            assert "draft_tokens" not in (await generate(client))  # plain results carry no counts


@pytest.mark.parametrize("path", ["/generate/speculative", "/generate/tree_speculative"])
async def test_speculative_routes_refuse_bad_parameters(path: str) -> None:
    with trio.fail_after(30):
        async with client_for() as (srv, client):
            cases = [({"draft_ahead": 0}, "draft_ahead"), ({"beam_width": 2}, "beam_width"),
                     ({"draft_loops": srv.model.default_loops + 1}, "draft_loops"),
                     ({"verify_loops": 2, "draft_loops": 3}, "draft_loops"),
                     ({"verify_loops": 2, "loops": 3}, "verify_loops"),
                     ({"verify_loops": srv.model.max_loops + 1}, "verify_loops"),
                     ({"cache_window": 1}, "cache_window"), ({"warm_start": True}, "warm_start")]
            if path.endswith("tree_speculative"):
                cases.append(({"K_branches": 0}, "K_branches"))
            for fields, param in cases:
                resp = await client.post(path, json={"prompt": PROMPT, **fields})
                assert resp.status_code == 400, (fields, resp.text)
                assert resp.json()["error"]["param"] == param, (fields, resp.json())
            assert srv.runtime.statistics().dispatched == 0  # refused before anything queued


async def test_generate_beam_search() -> None:
    with trio.fail_after(30):
        async with client_for() as (srv, client):
            out = await generate(client, num_beams=3, length_penalty=0.5)
            assert set(out) == RESULT_FIELDS | {"beam_score"}
            expected = tiny_engine().generate(GenerationRequest(
                prompt_tokens=tuple(srv.model.tokenizer.encode(PROMPT)), max_tokens=10, mode="beam",
                num_beams=3, length_penalty=0.5, sampling=SamplingParams(temperature=0.0)))
            assert out["tokens"] == expected.tokens
            assert out["beam_score"] == pytest.approx(expected.beam_score)
            assert "beam_score" not in await generate(client, num_beams=1)
            resp = await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 10,
                                                        "num_beams": 3, "stream": True})
            events = sse_events(resp.text)
            final, tokens = events[-2], events[:-2]  # one burst once the search ends, then the result
            assert [e["token_id"] for e in tokens] == final["tokens"] == expected.tokens
            for fields, param in [({"num_beams": 17}, "num_beams"), ({"num_beams": 0}, "num_beams"),
                                  ({"num_beams": 2, "temperature": 0.5}, "temperature"),
                                  ({"length_penalty": 1.0}, "length_penalty")]:
                bad = await client.post("/generate", json={"prompt": PROMPT, **fields})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
            spec = await client.post("/generate/speculative", json={"prompt": PROMPT, "num_beams": 2})
            assert spec.status_code == 400 and spec.json()["error"]["param"] == "num_beams"
            assert srv.engine.kv_statistics().blocks_used == 0



    with trio.fail_after(30):
        async with client_for() as (srv, client):
            text = "Hello, world! Loops all the way down."
            tok = (await client.post("/tokenize", json={"prompt": text})).json()
            assert tok == {"tokens": srv.model.tokenizer.encode(text), "count": len(tok["tokens"]),
                           "max_model_len": srv.model.max_seq_len}
            back = (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            assert back == {"text": text, "prompt": text}
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
            chat = (await client.post("/tokenize", json={"messages": messages})).json()
            rendered = srv.model.tokenizer.render_chat(messages, template=srv.model.chat_template)
            assert chat["tokens"] == srv.model.tokenizer.encode(rendered)
            back = (await client.post("/detokenize", json={"tokens": chat["tokens"]})).json()
            assert back["text"] == rendered
            # The chat completion's prompt is exactly these tokens.
            usage = (await client.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 1})).json()["usage"]
            assert usage["prompt_tokens"] == chat["count"]
            wrong_model = await client.post("/tokenize", json={"prompt": "x", "model": "nope"})
            assert wrong_model.status_code == 404


async def test_out_of_vocabulary_ids_are_a_400_naming_the_param() -> None:
    with trio.fail_after(30):
        async with client_for() as (srv, client):
            oov = srv.model.vocab_size
            cases = [("/detokenize", {"tokens": [1, oov]}, "tokens"),
                     ("/generate", {"prompt_tokens": [1, oov]}, "prompt_tokens"),
                     ("/v1/completions", {"prompt": [oov]}, "prompt"),
                     ("/detokenize", {"tokens": [-1]}, "tokens.0")]
            for path, body, param in cases:
                resp = await client.post(path, json=body)
                assert resp.status_code == 400, (path, resp.text)
                err = resp.json()["error"]
                assert (err["param"], err["type"]) == (param, "invalid_request_error"), (path, err)
            assert srv.runtime.statistics().dispatched == 0  # refused before anything queued


def _routes() -> set[tuple[str, str]]:
    """(method, OpenAPI path) of every API route the app registers."""
    app = create_app(None)
    out = set()
    for rule in app.url_map.iter_rules():
        path = rule.rule.replace("<path:name>", "{model}")
        if path in ("/", "/openapi.json", "/favicon.ico") or path.startswith("/ui/"):
            continue  # the browser UI and the document itself
        out |= {(m.lower(), path) for m in rule.methods or () if m not in ("HEAD", "OPTIONS")}
    return out


async def test_openapi_document_lists_every_route() -> None:
    with trio.fail_after(30):
        async with client_for() as (_, client):
            resp = await client.get("/openapi.json")
            assert resp.status_code == 200
            doc = resp.json()
            assert doc["openapi"].startswith("3.1")
            assert doc["info"]["title"] and doc["info"]["version"]
            listed = {(m, p) for p, ops in doc["paths"].items() for m in ops}
            assert _routes() <= listed and len(_routes()) >= 15
            schemas = doc["components"]["schemas"]
            refs = []

            def walk(node: Any) -> None:
                if isinstance(node, dict):
                    refs.extend(v for k, v in node.items() if k == "$ref")
                    for v in node.values():
                        walk(v)
                elif isinstance(node, list):
                    for v in node:
                        walk(v)

            walk(doc)
            assert refs and all(r.removeprefix("#/components/schemas/") in schemas for r in refs)
            generate_body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
            assert generate_body["schema"] == {"$ref": "#/components/schemas/GenerateRequest"}
            knobs = schemas["GenerateRequest"]["properties"]
            assert {"loops", "sample_seed", "cache_window", "stop", "priority", "slo_ms",
                    "prompt_tokens", "warm_start", "logprobs"} <= set(knobs)
            for ops in doc["paths"].values():
                for op in ops.values():
                    assert "200" in op["responses"] and "summary" in op
