"""JSON that Python parses but no text can be: every text route answers a clean 400.

A lone surrogate (``"\\ud800"``, an escape that is half of a UTF-16 pair) used to reach the
tokenizer and come back as a TypeError 500; JSON nested about 1,200 levels deep came back as a
RecursionError 500. Both are now the OpenAI error object: the surrogate's names the field that
holds it, the nesting is ``invalid_json``. A valid pair (an emoji) still works.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.http.conftest import running_server
from tests.http.test_errors import Case, problems_with
from tinyloop.errors import TokenizerError
from tinyloop.tokenizer import default_tokenizer

JSON = {"Content-Type": "application/json"}
LONE = '"a\\ud800b"'  # the JSON text of a string with a lone surrogate
PAIR = '"\\ud83d\\ude00"'  # a surrogate pair: U+1F600, valid
MESSAGES = '[{"role": "user", "content": %s}]'

# route, body template with one %s where the bad string goes, the field that holds it
TEXT_ROUTES: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", '{"messages": ' + MESSAGES + ', "max_tokens": 1}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
     "messages.0.content.0.text"),
    ("/api/v0/completions", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/api/v0/chat/completions", '{"messages": ' + MESSAGES + ', "max_tokens": 1}', "messages.0.content"),
    ("/generate", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/generate/speculative", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/generate/tree_speculative", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/tokenize", '{"prompt": %s}', "prompt"),
    ("/tokenize", '{"messages": ' + MESSAGES + '}', "messages.0.content"),
    ("/detokenize", '{"tokens": [5], "model": %s}', "model"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "stop": [%s]}', "stop.0"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": %s}]}', "messages.0.name"),
    ("/generate", '{"prompt": "hi", "max_tokens": 1, %s: 1}', ""),  # a key: blamed on its object
]
ROUTES = sorted({route for route, _, _ in TEXT_ROUTES})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def cases() -> list[tuple[Case, bytes]]:
    out = []
    for route, template, field in TEXT_ROUTES:
        out.append((Case(f"lone surrogate in {field or 'a key'} on {route}", route, 400, field or None,
                         code="invalid_value"), (template % LONE).encode()))
    for route in ROUTES:
        for key in ("prompt", "messages", "tokens"):
            out.append((Case(f"{key} nested 1200 deep on {route}", route, 400, None, code="invalid_json"),
                        f'{{"{key}": {nested(1200)}}}'.encode()))
        out.append((Case(f"an object nested 5000 deep on {route}", route, 400, None, code="invalid_json"),
                    ('{"a":' * 5000 + "1" + "}" * 5000).encode()))
    return out


async def test_lone_surrogates_and_deep_nesting_are_400s_on_every_text_route() -> None:
    problems: list[str] = []
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for case, body in cases():
                problems += problems_with(case, await client.post(case.path, content=body, headers=JSON))
            emoji = await client.post("/tokenize", content=f'{{"prompt": {PAIR}}}'.encode(), headers=JSON)
            ok = await client.post("/v1/chat/completions",
                                   content=('{"max_tokens": 2, "messages": ' + MESSAGES % PAIR + "}").encode(),
                                   headers=JSON)
    assert not problems, "\n".join(problems)
    assert emoji.status_code == 200 and emoji.json()["count"] >= 1
    assert ok.status_code == 200, ok.text


def test_the_python_api_refuses_a_lone_surrogate_with_a_tokenizer_error() -> None:
    for text in ("a\ud800", "x" * 10_000 + "\udc00"):  # both encoding paths
        with pytest.raises(TokenizerError, match="surrogate"):
            default_tokenizer().encode(text)
