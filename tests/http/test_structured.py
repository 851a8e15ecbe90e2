"""Structured outputs, tool calls, logit_bias and echo through the openai SDK, on a random-weight
model: constrained decoding makes every reply parse whatever the weights say."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
import trio
from pydantic import BaseModel, Field

from tests.engine.test_prompt_logprobs import reference
from tests.http.conftest import running_server, sse_events, tiny_engine
from tests.http.test_openai_sdk import async_client

pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.[\w.]+' was garbage collected:ResourceWarning")

MESSAGES: list[Any] = [{"role": "user", "content": "Describe a city."}]
Short = Field(max_length=6)


class Colour(enum.Enum):
    red = "red"
    green = "green"


class Flat(BaseModel):
    name: str = Short
    ok: bool


class Numbers(BaseModel):
    count: int = Field(ge=0, le=99)
    ratio: float = Field(ge=0, le=1)


class WithEnum(BaseModel):
    colour: Colour
    mode: Literal["fast", "slow"]


class Inner(BaseModel):
    label: str = Short
    level: int = Field(ge=1, le=5)


class Nested(BaseModel):
    inner: Inner
    tag: str = Short


class Arrays(BaseModel):
    items: list[Annotated[int, Field(ge=0, le=9)]] = Field(max_length=3)
    names: list[Annotated[str, Field(max_length=4)]] = Field(max_length=2)


class Optional_(BaseModel):
    note: str | None = Field(default=None, max_length=4)
    flag: bool = False


class DeepNest(BaseModel):
    nested: Nested
    extra: Arrays


class ListOfObjects(BaseModel):
    rows: list[Inner] = Field(max_length=2)


class Mixed(BaseModel):
    colour: Colour
    count: int = Field(ge=-5, le=5)
    items: list[bool] = Field(max_length=2)
    note: str | None = Field(default=None, max_length=3)


class Single(BaseModel):
    value: Literal["yes", "no", "maybe"]


class Empty(BaseModel):
    pass


class Tuple_(BaseModel):
    pair: list[Literal["a", "b"]] = Field(min_length=2, max_length=2)


SCHEMAS = [Flat, Numbers, WithEnum, Nested, Arrays, Optional_, DeepNest, ListOfObjects, Mixed, Single, Empty, Tuple_]


async def test_parse_returns_an_object_for_every_schema() -> None:
    with trio.fail_after(240):
        async with running_server() as srv, async_client(srv) as client:
            for i, schema in enumerate(SCHEMAS):
                out = await client.chat.completions.parse(
                    model="tiny", messages=MESSAGES, response_format=schema, max_tokens=200, temperature=1.0,
                    seed=i)
                parsed = out.choices[0].message.parsed
                assert isinstance(parsed, schema), (schema.__name__, out.choices[0].message.content)
                assert out.choices[0].finish_reason == "stop"


async def test_json_object_and_a_bad_schema() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            out = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=120,
                extra_body={"logit_bias": {}}, seed=3)
            content = out.choices[0].message.content
            assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(content or ""), dict)
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=5,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {"type": "frobnicated"}}})
            assert bad.value.param == "response_format"
            text = await client.completions.create(
                model="tiny", prompt="JSON:", max_tokens=120, seed=1,
                extra_body={"response_format": {"type": "json_schema", "json_schema": {
                    "name": "f", "schema": {**Flat.model_json_schema(), "additionalProperties": False}}}})
            Flat.model_validate_json(text.choices[0].text)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                   "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


def _valid(call: Any) -> None:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 8 and args["unit"] in ("c", "f")
    else:
        assert call.function.name == "get_time" and set(args) == {"zone"} and -12 <= args["zone"] <= 12


async def test_required_and_named_tool_choice_always_yield_a_valid_call() -> None:
    with trio.fail_after(240):
        async with running_server(engine=tiny_engine(1024)) as srv, async_client(srv) as client:  # the tool prompt
            for seed in range(4):
                out = await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
                    max_tokens=120, seed=seed, parallel_tool_calls=False)
                choice = out.choices[0]
                assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
                assert len(choice.message.tool_calls) == 1
                _valid(choice.message.tool_calls[0])
                assert choice.message.tool_calls[0].id.startswith("call_")
                named = await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120, seed=seed,
                    tool_choice={"type": "function", "function": {"name": "get_time"}})
                calls = named.choices[0].message.tool_calls or []
                assert calls and all(c.function.name == "get_time" for c in calls)
                for c in calls:
                    _valid(c)
            with pytest.raises(openai.BadRequestError) as unknown:
                await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=5,
                    tool_choice={"type": "function", "function": {"name": "nope"}})
            assert unknown.value.param == "tool_choice"


async def test_a_streamed_tool_call_reassembles_into_the_same_call() -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120,
            "seed": 5, "temperature": 0}
    with trio.fail_after(120):
        async with running_server(engine=tiny_engine(1024)) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            whole = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
            events = sse_events((await http.post("/v1/chat/completions", json={**body, "stream": True})).text)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for e in events[:-1]:
        for c in e["choices"]:
            finish = c["finish_reason"] or finish
            for d in c["delta"].get("tool_calls", []):
                call = calls.setdefault(d["index"], {"name": "", "arguments": "", "id": None})
                call["id"] = d.get("id") or call["id"]
                call["name"] += d.get("function", {}).get("name") or ""
                call["arguments"] += d.get("function", {}).get("arguments") or ""
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert finish == whole["finish_reason"] == "tool_calls"


async def test_logit_bias_forces_and_forbids_tokens() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            tok = srv.model.tokenizer
            forced = tok.encode(" zebra")[0]
            out = await client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=1.0,
                                                  seed=1, logit_bias={str(forced): 100})
            assert out.choices[0].text == tok.decode([forced] * 5)
            plain = await client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
            first = tok.encode(plain.choices[0].text)[0]
            banned = await client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                                     logit_bias={str(first): -100}, logprobs=0)
            assert banned.choices[0].logprobs is not None
            assert banned.choices[0].logprobs.tokens and banned.choices[0].logprobs.tokens[0] != tok.decode([first])
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(model="tiny", prompt="Hello", max_tokens=1,
                                                logit_bias={"10000000": 5})
            assert bad.value.param == "logit_bias"


async def test_echo_with_logprobs_and_no_tokens_scores_the_prompt_as_a_forward_does() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, async_client(srv) as client:
            tok = srv.model.tokenizer
            prompts = [tok.encode("Once upon a time there was"), tok.encode("def main():")]
            out = await client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                                  temperature=0)
            again = await client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True,
                                                    logprobs=1, temperature=0)  # through the prefix cache
            for choice, again_choice, ids in zip(out.choices, again.choices, prompts):
                lp = choice.logprobs
                assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
                assert choice.text == tok.decode(ids, skip_special=False) and len(lp.token_logprobs) == len(ids)
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                ref = reference(srv.engine, ids, srv.engine.default_loops)
                expected = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
                assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
                assert again_choice.logprobs is not None
                assert again_choice.logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
                # each token's top_logprobs holds the one best and the token itself
                for i, top in enumerate(lp.top_logprobs[1:], start=1):
                    assert top is not None and tok.decode([ids[i]], skip_special=False) in top
            # echo with generated tokens: the prompt's entries, then the completion's
            gen = await client.completions.create(model="tiny", prompt=prompts[1], max_tokens=3, echo=True,
                                                  logprobs=2, temperature=0)
            glp = gen.choices[0].logprobs
            assert glp is not None and glp.tokens is not None and len(glp.tokens) == len(prompts[1]) + 3
            assert gen.choices[0].text.startswith(tok.decode(prompts[1]))


async def test_a_thinking_templates_reply_goes_to_reasoning_content_whole_and_streamed() -> None:
    from tests.http.test_reasoning import OURO_THINKING_TEMPLATE

    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": True}}
    with trio.fail_after(60):
        async with running_server(engine=tiny_engine(chat_template=OURO_THINKING_TEMPLATE)) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            raw = (await http.post("/v1/completions", json={
                "prompt": srv.model.tokenizer.render_chat(MESSAGES, template=OURO_THINKING_TEMPLATE,
                                                          variables={"enable_thinking": True}),
                "max_tokens": 8, "temperature": 0, "ignore_eos": True})).json()["choices"][0]["text"]
            thinking = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
            off = (await http.post("/v1/chat/completions", json={
                **body, "chat_template_kwargs": {"enable_thinking": False}})).json()["choices"][0]["message"]
            events = sse_events((await http.post("/v1/chat/completions", json={**body, "stream": True})).text)
    # the prompt opened <think>: the reply, with no </think> in it, is all reasoning
    assert "</think>" not in raw and thinking["reasoning_content"] == raw.strip() and not thinking["content"]
    assert "reasoning_content" not in off  # no <think> opened: plain content
    streamed = "".join(c["delta"].get("reasoning_content", "") for e in events[:-1] for c in e["choices"])
    assert streamed == thinking["reasoning_content"]
