"""Structured outputs through the engine on the tiny random model: sampled JSON that matches a
dozen schemas, json_object, regex, Lark grammar and tool calls; constrained and free rows in one
batch as alone; n choices and forks; speculation (chain and tree) and beam search under a grammar;
errors for a bad schema or a refused token; max_tokens mid-document."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (kubernetes-validate's, a dev dependency)
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop.engine.plain as plain
import tinyloop.grammar.masks as masks
from tests.engine.test_engine import make_engine
from tinyloop.engine.engine import Engine
from tinyloop.errors import EngineError, RequestError
from tinyloop.requests import Constraint, GenerationRequest, GenerationResult, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = (5, 6, 7, 8)
SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "address": {"type": "object", "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "address"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"enum": ["red", "green", "blue", 3, None]},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": SHORT,
                                      "c": {"type": "boolean"}},
     "required": ["a"], "additionalProperties": False},  # optional fields
    {"type": "object", "properties": {"note": {"anyOf": [SHORT, {"type": "null"}]}}, "required": ["note"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer",
                                "minimum": 0, "maximum": 5}}, "required": ["k", "n"], "additionalProperties": False},
     "maxItems": 3},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["x"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2},
    {"$defs": {"p": {"type": "object", "properties": {"q": {"enum": [1, 2]}}, "required": ["q"],
                     "additionalProperties": False}},
     "type": "object", "properties": {"first": {"$ref": "#/$defs/p"}, "second": {"$ref": "#/$defs/p"}},
     "required": ["first", "second"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
                                      "level": {"enum": ["low", "high"]}},
     "required": ["code", "level"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def request(constraint: Constraint | None, seed: int | None = 0, max_tokens: int = 120,
            **kw: Any) -> GenerationRequest:
    sampling = kw.pop("sampling", SamplingParams(temperature=1.0, seed=seed))
    return GenerationRequest(prompt_tokens=PROMPT, max_tokens=max_tokens, sampling=sampling,
                             constraint=constraint, **kw)


def schema(s: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


def check_json(result: GenerationResult, s: dict[str, Any]) -> None:
    assert result.finish_reason == "stop" and result.stop_reason == "eos", result
    jsonschema.validate(json.loads(result.text), s)


# -- every kind's output matches ----------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_sampled_json_matches_its_schema(engine: Engine, index: int) -> None:
    s = SCHEMAS[index]
    results = engine.generate_many([request(schema(s), seed=seed) for seed in range(4)])
    done = [r for r in results if r.finish_reason == "stop"]
    assert done, [r.text for r in results]  # bounded schemas: a sampled document completes
    for r in done:
        check_json(r, s)
    assert len({r.text for r in results}) > 1 or index in (3, 4)  # the seeds differ (not for a near-constant)


LEAVES = st.sampled_from([SHORT, {"type": "boolean"}, {"type": "null"}, {"enum": ["p", "q", 7]},
                          {"type": "integer", "minimum": -50, "maximum": 50}])


def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), children, min_size=1, max_size=3)
    return props.flatmap(lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
        lambda req: {"type": "object", "properties": p, "required": req, "additionalProperties": False}))


SCHEMA_TREES = st.recursive(LEAVES, lambda kids: st.one_of(
    objects(kids), kids.map(lambda k: {"type": "array", "items": k, "maxItems": 2})), max_leaves=6)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SCHEMA_TREES, st.integers(0, 2**32))
def test_generated_schemas_give_valid_json(engine: Engine, s: dict[str, Any], seed: int) -> None:
    result = engine.generate(request(schema(s), seed=seed, max_tokens=160))
    if result.finish_reason == "stop":
        check_json(result, s)
    else:
        assert result.finish_reason == "length" and len(result.tokens) == 160


def test_json_object_is_a_parseable_object(engine: Engine) -> None:
    results = engine.generate_many([request(Constraint("json_object"), seed=s, max_tokens=200) for s in range(3)])
    done = [r for r in results if r.finish_reason == "stop"]
    assert done
    assert all(isinstance(json.loads(r.text), dict) for r in done)


def test_regex_output_matches(engine: Engine) -> None:
    pattern = "[a-c]{2,5}-[0-9]{3}"
    for r in engine.generate_many([request(Constraint("regex", pattern), seed=s) for s in range(4)]):
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


def test_lark_grammar_output_matches(engine: Engine) -> None:
    lark = 'start: "SELECT " COL (", " COL)* " FROM " TABLE\nCOL: /[a-z]{1,4}/\nTABLE: "users" | "orders"\n'
    results = engine.generate_many([request(Constraint("grammar", lark), seed=s, max_tokens=60) for s in range(4)])
    done = [r for r in results if r.finish_reason == "stop"]
    assert done
    for r in done:
        assert re.fullmatch(r"SELECT [a-z]{1,4}(, [a-z]{1,4})* FROM (users|orders)", r.text), r.text


TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": SHORT, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}},
         {"name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}]


def parse_calls(text: str, parallel: bool) -> list[dict[str, Any]]:
    """A local parser of the tool-call format: begin, the call object, end; joined by the separator."""
    begin, end, sep = "<tool_call>\n", "\n</tool_call>", "\n"
    assert text.startswith(begin) and text.endswith(end), text
    parts = text[len(begin):-len(end)].split(end + sep + begin)
    assert parallel or len(parts) == 1
    calls = [json.loads(p) for p in parts]
    for c in calls:
        assert list(c) == ["name", "arguments"]
        tool = next(t for t in TOOLS if t["name"] == c["name"])
        jsonschema.validate(c["arguments"], tool["parameters"])
    return calls


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_calls_parse_and_validate(engine: Engine, parallel: bool) -> None:
    c = Constraint("tool_calls", json.dumps({"tools": TOOLS, "parallel": parallel}))
    results = engine.generate_many([request(c, seed=s, max_tokens=100) for s in range(6)])
    done = [r for r in results if r.finish_reason == "stop"]
    assert done
    names = {call["name"] for r in done for call in parse_calls(r.text, parallel)}
    assert names <= {"get_weather", "add"}


# -- batching, seeds, n and forks ---------------------------------------------------------------
def test_constrained_and_free_rows_in_one_batch_give_what_each_gives_alone(engine: Engine) -> None:
    c = schema(SCHEMAS[0])
    reqs = [request(c, seed=1), request(None, seed=1, max_tokens=20), request(c, seed=2),
            request(None, seed=None, max_tokens=20, sampling=SamplingParams(temperature=0, ignore_eos=True)),
            request(Constraint("regex", "[a-z]{3}"), seed=3)]
    together = engine.generate_many(reqs)
    alone = [engine.generate(r) for r in reqs]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert together[0].tokens != together[1].tokens  # the mask changed the constrained row only
    assert together[1].tokens == engine.generate(request(None, seed=1, max_tokens=20)).tokens
    assert engine.kv_statistics().blocks_used == 0


def test_each_choice_has_its_own_matcher(engine: Engine) -> None:
    c = schema(SCHEMAS[2])
    seqs = [engine.start(request(c, seed=s)) for s in range(3)]  # n=3: three sequences of one prompt
    assert len({id(s.matcher) for s in seqs}) == 3
    for s in seqs:
        engine.free(s)
    for r in engine.generate_many([request(c, seed=s) for s in range(3)]):
        check_json(r, SCHEMAS[2])


def test_fork_copies_the_grammar_state(engine: Engine) -> None:
    c = schema(SCHEMAS[1])
    seq = engine.start(request(c, seed=4))
    while len(seq.output) < 5:
        engine.step([seq])
    child = engine.fork(seq)
    assert child.matcher is not seq.matcher and child.matcher.tokens == seq.matcher.tokens == 5
    child.generator.manual_seed(99)
    while not (seq.finished and child.finished):
        engine.step([s for s in (seq, child) if not s.finished])
    for s in (seq, child):  # (a fork's own text starts where it was forked: decode every token)
        assert s.finish_reason == "stop"
        jsonschema.validate(json.loads(engine.tokenizer.decode(s.output)), SCHEMAS[1])
        engine.free(s)
    assert seq.output[:5] == child.output[:5]


def test_max_tokens_mid_document_ends_with_length(engine: Engine) -> None:
    r = engine.generate(request(schema(SCHEMAS[1]), seed=0, max_tokens=6))
    assert r.finish_reason == "length" and len(r.tokens) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_grammar_end_stops_even_when_eos_is_ignored(engine: Engine) -> None:
    r = engine.generate(request(Constraint("regex", "ok"), sampling=SamplingParams(temperature=1.0, ignore_eos=True,
                                                                                 seed=0)))
    assert (r.text, r.finish_reason, r.stop_reason) == ("ok", "stop", "eos")


# -- speculation and beams ----------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("mode", ["speculative", "tree"])
@pytest.mark.parametrize("index", [0, 1, 5, 10, 11])
def test_speculative_constrained_greedy_equals_plain(engine: Engine, mode: str, index: int) -> None:
    c = schema(SCHEMAS[index])
    plain_result = engine.generate(request(c, sampling=GREEDY, max_tokens=60))
    spec = engine.generate(request(c, sampling=GREEDY, max_tokens=60, mode=mode, draft_ahead=6))
    assert spec.tokens == plain_result.tokens
    assert (spec.finish_reason, spec.text) == (plain_result.finish_reason, plain_result.text)
    assert spec.accepted_draft_tokens  # the grammar's forced tokens: the drafts agree there


def test_speculative_sampled_constrained_output_is_valid(engine: Engine) -> None:
    for mode in ("speculative", "tree"):
        results = engine.generate_many([request(schema(SCHEMAS[0]), seed=s, mode=mode) for s in range(3)])
        done = [r for r in results if r.finish_reason == "stop"]
        assert done
        for r in done:
            check_json(r, SCHEMAS[0])
    assert engine.kv_statistics().blocks_used == 0


def test_speculation_leaves_the_matcher_at_the_output(engine: Engine) -> None:
    seq = engine.start(request(schema(SCHEMAS[7]), sampling=GREEDY, mode="speculative"))
    while not seq.finished:
        engine.step([seq])
        assert seq.matcher.tokens == len(seq.output)
    engine.free(seq)


@pytest.mark.parametrize("index", [0, 7])
def test_beam_search_under_a_grammar(engine: Engine, index: int) -> None:
    c = schema(SCHEMAS[index])
    one = engine.generate(request(c, sampling=GREEDY, mode="beam", num_beams=1, max_tokens=80))
    greedy = engine.generate(request(c, sampling=GREEDY, max_tokens=80))
    assert one.tokens == greedy.tokens  # one beam is greedy decoding, grammar included
    four = engine.generate(request(c, sampling=GREEDY, mode="beam", num_beams=4, max_tokens=80))
    check_json(four, SCHEMAS[index])
    assert engine.kv_statistics().blocks_used == 0


# -- errors -------------------------------------------------------------------------------------
def test_a_bad_schema_is_a_request_error(engine: Engine) -> None:
    with pytest.raises(RequestError) as info:
        engine.start(request(Constraint("json_schema", '{"type": "objec"}')))
    assert info.value.param == "response_format"
    assert engine.kv_statistics().blocks_used == 0


def test_a_refused_token_fails_that_sequence_only(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plain, "constrain_rows", lambda logits, matchers, buffer: [])  # masks skipped
    seqs = [engine.start(request(Constraint("regex", "z{3}"), sampling=GREEDY)),
            engine.start(request(None, seed=3, max_tokens=5))]
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    assert isinstance(seqs[0].error, EngineError) and "refused token" in str(seqs[0].error)
    assert seqs[0].output == []
    assert seqs[1].error is None and len(seqs[1].output) == 5
    for s in seqs:
        engine.free(s)


def test_the_device_path_of_the_masks_gives_the_same_output(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the masks are unpacked by torch's bit shifts (``refused_reference``); run that path
    here and compare with the CPU's numpy one, plain, speculative and beam rows together."""
    reqs = [request(schema(SCHEMAS[0]), seed=2), request(None, seed=2, max_tokens=10),
            request(schema(SCHEMAS[1]), sampling=GREEDY, mode="speculative"),
            request(schema(SCHEMAS[7]), sampling=GREEDY, mode="beam", num_beams=2)]
    host = [r.tokens for r in engine.generate_many(reqs)]
    monkeypatch.setattr(masks, "_on_host", lambda logits, words: False)
    assert [r.tokens for r in engine.generate_many(reqs)] == host


@pytest.mark.parametrize("mode", ["generate", "speculative"])
def test_logprobs_are_the_models_not_the_masks(engine: Engine, mode: str) -> None:
    """A forced token has probability 1 under the mask; its reported logprob is the model's."""
    probe = engine.start(request(None, max_tokens=1))
    first = torch.log_softmax(engine.prefill(probe).float(), dim=-1)  # [V] the prompt's raw logprobs
    engine.free(probe)
    sampling = SamplingParams(temperature=0, logprobs=True)
    r = engine.generate(request(Constraint("regex", "zzzzzz"), sampling=sampling, mode=mode, max_tokens=8))
    assert r.text == "zzzzzz" and r.logprobs is not None
    token = r.tokens[0]
    assert r.logprobs[0].logprob == pytest.approx(float(first[token]), abs=1e-4)
    assert all(lp.logprob < -1e-3 for lp in r.logprobs[:-1])  # (a masked distribution would give 0 here)
