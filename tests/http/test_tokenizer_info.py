"""Tokenizer discovery for eval tools: vLLM's ``GET /tokenizer_info`` (at the root, where lm-eval's
``tokenizer_backend=remote`` looks once it cuts ``/v1/completions`` off the base URL, and under
``/v1``) and ``/tokenize``'s ``add_special_tokens``, driven the way lm-eval drives them."""

from __future__ import annotations

from typing import Any

import httpx
import trio
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.http.conftest import running_server

TEXT = "Loops all the way down: 417+386=803 <|im_end|>"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How deep?"}]


async def test_tokenizer_info_is_vllms_shape_at_the_root_and_under_v1() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            root = await client.get("/tokenizer_info")
            assert root.status_code == 200, root.text
            info: dict[str, Any] = root.json()
            assert (await client.get("/v1/tokenizer_info")).json() == info
            tok = srv.model.tokenizer
            assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
            assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token)
            assert info["pad_token"] is None and info["unk_token"] is None  # the demo vocabulary has neither
            assert info["chat_template"] == srv.model.chat_template
            assert info["model_max_length"] == srv.model.max_seq_len
            assert (info["add_bos_token"], info["add_eos_token"]) == (False, False)
            added = info["added_tokens_decoder"]
            assert {int(i) for i, t in added.items() if t["special"]} == set(tok.special_ids)
            assert all(tok.id_to_token(int(i)) == t["content"] for i, t in added.items())


async def test_lm_evals_remote_tokenizer_gets_what_it_reads() -> None:
    """lm-eval's probe (``eos_token`` in the info, a list from ``/tokenize``), its token ids
    (``encode(eos_token)[0]``) and its chat rendering (jinja2 on the served template)."""
    with trio.fail_after(30):
        async with running_server() as srv:
            base = f"{srv.url}/v1/completions".replace("/v1/completions", "")
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                info = (await client.get("/tokenizer_info")).json()
                assert "eos_token" in info

                async def encode(text: str) -> list[int]:
                    resp = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
                    assert resp.status_code == 200, resp.text
                    tokens: list[int] = resp.json()["tokens"]
                    return tokens

                tok = srv.model.tokenizer
                assert (await encode(info["eos_token"]))[0] == tok.eos_id
                assert (await encode(info["bos_token"]))[0] == tok.bos_id
                assert await encode(TEXT) == tok.encode(TEXT)
                template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                    info["chat_template"])
                rendered = template.render(messages=MESSAGES, add_generation_prompt=True)
                assert rendered == tok.render_chat(MESSAGES, template=srv.model.chat_template)


async def test_add_special_tokens_adds_nothing_and_matches_what_completions_run() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            bodies = [{"prompt": TEXT}, {"prompt": TEXT, "add_special_tokens": True},
                      {"prompt": TEXT, "add_special_tokens": False}]
            answers = [(await client.post("/tokenize", json=b)).json() for b in bodies]
            assert all(a == answers[0] for a in answers)
            assert answers[0]["tokens"] == srv.model.tokenizer.encode(TEXT)
            usage = (await client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})).json()["usage"]
            assert usage["prompt_tokens"] == answers[0]["count"]
            chat = await client.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": False})
            assert chat.json()["tokens"] == srv.model.tokenizer.encode(
                srv.model.tokenizer.render_chat(MESSAGES, template=srv.model.chat_template))
            bad = await client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": [1]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens", bad.text


async def test_the_openapi_document_lists_the_routes_and_the_field() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            doc = (await client.get("/openapi.json")).json()
            assert {"/tokenizer_info", "/v1/tokenizer_info"} <= {p for p, ops in doc["paths"].items() if "get" in ops}
            body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            name = body["$ref"].removeprefix("#/components/schemas/")
            assert doc["components"]["schemas"][name]["properties"]["add_special_tokens"]["default"] is True
