"""What a vLLM-style router sends a replica: ``GET /health`` (vllm-router waits on it at startup)
and OpenAI bodies carrying SGLang's extra fields at their defaults. Accepted only at those values."""

from __future__ import annotations

import httpx
import trio

from tests.http.conftest import running_server, tiny_engine
from tinyloop.settings import Settings

ROUTER_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
                 "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
                 "include_reasoning": True, "echo": False, "ignore_eos": False}


async def test_health_answers_like_healthz_without_the_api_key_and_then_shutting_down() -> None:
    with trio.fail_after(30):
        async with running_server(Settings(port=0, api_key="k"), tiny_engine()) as srv:
            async with httpx.AsyncClient(base_url=srv.url) as client:
                ok = await client.get("/health")
                assert (ok.status_code, ok.text) == (200, "ok\n")
                srv.runtime.refuse_new_requests()
                closing = await client.get("/health")
                assert (closing.status_code, closing.text) == (503, "shutting down\n")


async def test_router_default_fields_are_accepted_and_other_values_refused_by_name() -> None:
    with trio.fail_after(30):
        async with running_server(Settings(port=0), tiny_engine()) as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
                done = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **ROUTER_FIELDS})
                assert done.status_code == 200, done.text
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False,
                        **{k: v for k, v in ROUTER_FIELDS.items() if k != "echo"}}
                assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
                bad = await client.post("/v1/completions", json={"prompt": "hi", "no_stop_trim": True})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "no_stop_trim", bad.text
