"""tinyloop.grammar without a model: compiling and validating each constraint kind, the matcher's
accept/rollback/fork/end rules, the bitmask applied to logits, and the caches."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyloop import grammar
from tinyloop.engine.acceptance import DraftTree
from tinyloop.errors import RequestError
from tinyloop.grammar.compile import prototype
from tinyloop.grammar.drafts import DraftGrammar
from tinyloop.grammar.masks import cpu_bias, refused_reference
from tinyloop.requests import Constraint, GenerationRequest
from tinyloop.tokenizer import Tokenizer, default_tokenizer

TOK = default_tokenizer()
EOS = sorted(TOK.eos_ids)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["name", "kind"], "additionalProperties": False}


def matcher(kind: str, source: str = "") -> grammar.Matcher:
    m = grammar.matcher_for(GenerationRequest(prompt_tokens=(1,), constraint=Constraint(kind, source)), TOK)
    assert m is not None
    return m


def allowed(m: grammar.Matcher) -> set[int]:
    words = torch.zeros(grammar.words_per_row(TOK.vocab_size), dtype=torch.int32)
    m.fill(words)
    return set((~refused_reference(words, TOK.vocab_size)).nonzero().flatten().tolist())


def feed(m: grammar.Matcher, text: str) -> bool:
    ids = TOK.encode(text)
    return m.accept_all(ids) == len(ids)


# -- validate: every kind refuses bad input with param response_format ---------------------------
@pytest.mark.parametrize(("kind", "source", "says"), [
    ("json_schema", '{"type": "objec"}', "objec"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", "[" * 100_000, "characters"),
    ("json_schema", "[" * 60_000, "not valid JSON"),  # deeper than json.loads recurses
    ("regex", "a(b", "unclosed group"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
    ("tool_calls", '{"tools": []}', "1 to 128 tools"),
    ("tool_calls", '{"tools": [{"parameters": {}}]}', "tools[0].name"),
    ("tool_calls", '{"tools": [{"name": "f", "parameters": []}]}', "tools[0].parameters"),
    ("tool_calls", '{"tools": [{"name": "f"}], "parallel": "yes"}', "parallel"),
    ("tool_calls", '{"tools": [{"name": "f"}], "begin": 3}', "begin"),
    ("tool_calls", '{"tools": [{"name": "f", "parameters": {"type": "nope"}}]}', "nope"),
])
def test_validate_refuses_bad_constraints(kind: str, source: str, says: str) -> None:
    with pytest.raises(RequestError, match=re.escape(says)) as info:
        grammar.validate(Constraint(kind, source), TOK)
    assert info.value.param == "response_format"
    assert len(str(info.value)) <= 600


def test_validate_accepts_good_constraints_and_compiles_once() -> None:
    good = Constraint("json_schema", json.dumps(PERSON))
    grammar.validate(good, TOK)
    assert prototype(good, TOK) is prototype(good, TOK)  # the compiled grammar is cached per tokenizer
    for kind, source in [("json_object", ""), ("regex", "[a-c]+"), ("grammar", 'start: "x" | "y"'),
                         ("tool_calls", '{"tools": [{"name": "f"}]}')]:
        grammar.validate(Constraint(kind, source), TOK)


def test_token_info_is_built_once_per_tokenizer() -> None:
    assert grammar.token_info(TOK) is grammar.token_info(TOK)
    other = Tokenizer.from_json(TOK.to_json())
    assert grammar.token_info(other) is not grammar.token_info(TOK)
    assert grammar.token_info(other).vocab_size == TOK.vocab_size


def test_no_matcher_without_a_constraint() -> None:
    assert grammar.matcher_for(GenerationRequest(prompt_tokens=(1,)), TOK) is None
    assert grammar.fork(None) is None


# -- the matcher --------------------------------------------------------------------------------
def test_json_schema_output_has_fixed_whitespace_and_schema_order() -> None:
    m = matcher("json_schema", json.dumps(PERSON))
    assert not feed(matcher("json_schema", json.dumps(PERSON)), '{"kind": "a", "name": "x"}')  # order
    assert not feed(matcher("json_schema", json.dumps(PERSON)), '{"name":"x", "kind": "a"}')  # spacing
    assert not feed(matcher("json_schema", json.dumps(PERSON)), '{"name": "toolong", "kind": "a"}')
    assert feed(m, '{"name": "x", "kind": "b"}')
    assert m.is_terminated() and m.can_end()
    assert allowed(m) == set(EOS)  # once complete, only end-of-text


def test_end_of_text_is_allowed_only_where_the_grammar_may_end() -> None:
    m = matcher("regex", "ab+")
    assert not set(EOS) & allowed(m)
    assert feed(m, "a")
    assert not m.can_end() and not set(EOS) & allowed(m)
    assert feed(m, "b")
    assert m.can_end() and not m.is_terminated()
    assert set(EOS) <= allowed(m) and TOK.encode("b")[0] in allowed(m)
    assert m.accept(EOS[0]) and m.is_terminated()
    assert not m.accept(TOK.encode("b")[0])


def test_refused_token_changes_nothing() -> None:
    m = matcher("regex", "ab")
    assert not m.accept(TOK.encode("z")[0])
    assert m.tokens == 0 and not m.failed
    assert feed(m, "ab")


def test_rollback_undoes_tokens_including_an_end_of_text_after_completion() -> None:
    m = matcher("json_object")
    assert feed(m, '{"a": 1}')
    before = allowed(m)
    assert m.is_terminated()
    assert m.accept(EOS[0]) and m.accept(EOS[1])  # after completion: not counted by llguidance
    n = len(TOK.encode('{"a": 1}'))
    m.rollback(2)
    assert m.is_terminated() and allowed(m) == before
    m.rollback(1)  # the closing brace
    assert not m.is_terminated() and not m.failed
    assert feed(m, "}") and m.tokens == n
    with pytest.raises(Exception, match="past"):
        m.rollback(n + 1)
    assert not m.failed


def test_fork_is_independent() -> None:
    m = matcher("regex", "(ab|ac)d")
    assert feed(m, "a")
    twin = m.fork()
    assert feed(m, "bd") and m.is_terminated()
    assert not twin.is_terminated() and feed(twin, "cd") and twin.is_terminated()
    assert twin.tokens == m.tokens


def test_completes_looks_ahead_without_moving() -> None:
    m = matcher("regex", "ab")
    b = TOK.encode("b")[0]
    assert feed(m, "a")
    assert m.completes(b) and m.tokens == 1
    assert not m.completes(TOK.encode("a")[0])
    assert "open" in repr(m)


def test_grammar_kind_is_lark() -> None:
    lark = 'start: "SELECT " COL (", " COL)* " FROM t"\nCOL: /[a-z]{1,4}/\n'
    assert feed(matcher("grammar", lark), "SELECT ab, c FROM t")
    assert not feed(matcher("grammar", lark), "SELECT abcde FROM t")


# -- tool calls ---------------------------------------------------------------------------------
TOOLS = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"], "additionalProperties": False}},
         {"name": 'say "hi" é', "parameters": {"$defs": {"w": {"enum": ["x", "y"]}}, "type": "object",
                                              "properties": {"w": {"$ref": "#/$defs/w"}}, "required": ["w"]}}]


def call(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_tool_calls_single() -> None:
    spec = json.dumps({"tools": TOOLS, "parallel": False})
    m = matcher("tool_calls", spec)
    assert feed(m, call("add", {"a": 3})) and m.is_terminated()
    assert feed(matcher("tool_calls", spec), call('say "hi" é', {"w": "y"}))  # a $ref inside a tool's schema
    assert not feed(matcher("tool_calls", spec), call("add", {"a": 3}) + "\n<tool")  # exactly once
    assert not feed(matcher("tool_calls", spec), call("sub", {"a": 3}))
    assert not feed(matcher("tool_calls", spec), call("add", {"a": "3"}))
    assert not feed(matcher("tool_calls", spec), '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}')


def test_tool_calls_parallel_joined_by_the_separator() -> None:
    spec = json.dumps({"tools": TOOLS, "parallel": True, "begin": "[", "end": "]", "separator": ";"})
    m = matcher("tool_calls", spec)
    one = "[" + json.dumps({"name": "add", "arguments": {"a": 1}}) + "]"
    assert feed(m, one) and m.can_end() and not m.is_terminated()
    assert feed(m, ";" + one) and m.can_end()
    joined = matcher("tool_calls", json.dumps({"tools": TOOLS, "parallel": True, "begin": "", "end": "",
                                               "separator": ""}))  # no empty literals in the Lark
    assert feed(joined, json.dumps({"name": "add", "arguments": {"a": 1}}) * 2) and joined.can_end()


# -- masks --------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 5), st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_cpu_bias_matches_the_reference_unpacking(rows: int, vocab: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (rows, grammar.words_per_row(vocab) + seed % 2), generator=gen,
                          dtype=torch.int32)
    logits = torch.randn(rows, vocab, generator=gen)
    expected = logits.masked_fill(refused_reference(words, vocab), float("-inf"))
    assert torch.equal(torch.from_numpy(cpu_bias(words, vocab)) + logits, expected)
    assert torch.equal(grammar.apply_words(logits.clone(), words), expected)
    wide = torch.randn(rows, 32 * words.shape[1] + 3, generator=gen)  # logits past the mask's ids: refused
    assert torch.isinf(grammar.apply_words(wide, words)[:, -3:]).all()


def test_constrain_rows_touches_only_constrained_rows() -> None:
    a, b = matcher("regex", "ab"), matcher("regex", "b+")
    logits = torch.randn(4, TOK.vocab_size)
    before = logits.clone()
    assert grammar.constrain_rows(logits, [None, a, None, b], grammar.MaskBuffer()) == []
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == allowed(a)
    assert set(torch.isfinite(logits[3]).nonzero().flatten().tolist()) == allowed(b)
    kept = torch.isfinite(logits[1])
    assert torch.equal(logits[1][kept], before[1][kept])  # allowed logits exactly as they were


def test_node_masks_leave_the_matcher_in_place() -> None:
    m = matcher("regex", "abc")
    a, b, z = (TOK.encode(c)[0] for c in "abz")
    words = grammar.node_masks(m, [[], [a], [a, b], [z]], TOK.vocab_size)
    assert m.tokens == 0
    assert not words[3].any()  # a path the grammar refuses: an empty mask
    assert (~refused_reference(words[2], TOK.vocab_size)).nonzero().flatten().tolist() == [TOK.encode("c")[0]]


def finite(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_draft_grammar_chain_masks_and_restores() -> None:
    m = matcher("regex", "a[bx]c")
    a, b, c = (TOK.encode(ch)[0] for ch in "abc")
    draft = DraftGrammar(m)
    logits = torch.zeros(TOK.vocab_size)
    first = draft.chain_row(logits)
    assert a in finite(first) and all(TOK.token_bytes(t).startswith(b"a") for t in finite(first))
    assert not draft.chain_token(a)
    second = draft.chain_row(logits)
    assert b in finite(second) and a not in finite(second)
    assert not draft.chain_token(b)
    draft.chain_end(TOK.vocab_size)
    draft.restore()
    assert m.tokens == 0
    tree = DraftTree.from_branches(99, [[a, b]])
    verify = torch.zeros(len(tree), TOK.vocab_size)
    draft.verify(verify, tree.paths())  # the chain's recorded masks
    assert [finite(r) for r in verify] == [finite(first), finite(second), {c}]
    fresh = torch.zeros(len(tree), TOK.vocab_size)
    DraftGrammar(m).verify(fresh, tree.paths())  # computed along each node's path
    assert torch.equal(fresh, verify) and m.tokens == 0


def test_draft_tree_paths() -> None:
    tree = DraftTree((9, 1, 2, 3), (-1, 0, 1, 0), (0, 1, 2, 1))
    assert tree.paths() == [[], [1], [1, 2], [3]]


def test_parallel_fill_equals_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import tinyloop.grammar.matcher as matcher_module

    ms = [matcher("regex", f"{c}[a-f]+") for c in "abcdefghij"]
    for i, m in enumerate(ms):
        assert feed(m, "abcdefghij"[i] + "a" * (i % 3))
    words = torch.zeros((len(ms), grammar.words_per_row(TOK.vocab_size)), dtype=torch.int32)
    monkeypatch.setattr(matcher_module, "PARALLEL_CPUS", 1)
    matcher_module.fill_batch(ms, words)
    assert [set((~refused_reference(w, TOK.vocab_size)).nonzero().flatten().tolist()) for w in words] == [
        allowed(m) for m in ms]
    assert words.any(dim=1).all()
