"""A ``Constraint`` compiled to an llguidance grammar, checked up front, and cached.

``grammar_text(kind, source)`` turns a constraint into llguidance's grammar text (LRU-cached by
``(kind, source)``); ``prototype(constraint, tokenizer)`` compiles it against a tokenizer once
(LRU-cached per tokenizer) and every request's matcher is a copy of that prototype (a copy
costs microseconds, a compile milliseconds). ``validate`` is the same compile, raising
``RequestError(param="response_format")`` for anything wrong, so the HTTP layer can refuse a
bad schema with a 400 before admission and the engine finds the grammar compiled.

The kinds and what their outputs look like:

- ``json_schema``: a JSON document matching the schema (llguidance's JSON Schema subset:
  objects, arrays, enums/const, numbers with bounds, strings with lengths, patterns and formats,
  anyOf/oneOf/allOf, local ``$ref``); properties in schema order. Whitespace is fixed, as
  ``json.dumps`` writes it (``", "`` and ``": "``, no newlines): a free whitespace run lets a
  weak model pad forever instead of writing the value.
- ``json_object``: any JSON object, same whitespace (``source`` is ignored).
- ``regex``: the whole output matches the regular expression (Rust ``regex`` syntax, anchored).
- ``grammar``: llguidance's Lark dialect (``start:`` is the whole output; terminals in
  UPPER case, ``/regex/`` and ``"literal"`` terminals, ``%json {schema}`` rules, ``%ignore``).
- ``tool_calls``: ``source`` is ``{"tools": [{"name", "parameters"}], "parallel", "begin", "end",
  "separator"}``; the output is ``begin {"name": <name>, "arguments": <matching object>} end``
  once, or one or more times joined by ``separator`` when ``parallel``.

Untrusted input is bounded: ``MAX_SOURCE_CHARS`` of source, ``MAX_TOOLS`` tools, and llguidance's
parser limits (``LIMITS``), which bound the compile (its lexer fuel and grammar size) and each
token's mask (its per-step fuel): a grammar past them is refused, never run slowly.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance

from tinyloop.errors import RequestError
from tinyloop.grammar.vocab import token_info
from tinyloop.requests import Constraint
from tinyloop.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["JSON_FORMAT", "LIMITS", "MAX_SOURCE_CHARS", "MAX_TOOLS", "grammar_text", "prototype", "validate"]

PARAM = "response_format"
MAX_SOURCE_CHARS = 64 * 1024  # a schema or grammar; OpenAI's own schema limits are smaller
MAX_TOOLS = 128  # OpenAI's limit on tools per request
MAX_ERROR_CHARS = 600  # of llguidance's message (it quotes the grammar around the error)
PROTOTYPES_PER_TOKENIZER = 64
# fixed whitespace, as json.dumps writes it (the module docstring)
JSON_FORMAT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's defaults but the lexer states (1-2 kB each): at most ~100 MB for one grammar
LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, max_grammar_size=200_000)
TOOL_DEFAULTS = {"parallel": False, "begin": "<tool_call>\n", "end": "\n</tool_call>", "separator": "\n"}


def _refuse(message: str) -> RequestError:
    return RequestError(message[:MAX_ERROR_CHARS], param=PARAM)


@functools.lru_cache(maxsize=256)
def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar for a constraint (``RequestError`` for a source that does not parse;
    the grammar itself is checked by ``prototype``)."""
    if len(source) > MAX_SOURCE_CHARS:
        raise _refuse(f"the {kind} is {len(source)} characters; at most {MAX_SOURCE_CHARS} are accepted")
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(source), overrides=JSON_FORMAT)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_FORMAT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(source)
        if kind == "tool_calls":
            return llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(source))
    except RequestError:
        raise
    except ValueError as exc:  # llguidance: a schema that is not a JSON object
        raise _refuse(f"invalid {kind}: {exc}") from exc
    raise _refuse(f"unknown constraint kind {kind!r}")


def _json_schema(source: str) -> str:
    schema = _parse_json(source, "json_schema")
    if not isinstance(schema, (dict, bool)):
        raise _refuse("the JSON schema must be an object (or true/false)")
    return source


def _parse_json(source: str, what: str) -> Any:
    try:
        return json.loads(source)
    except (ValueError, RecursionError) as exc:
        raise _refuse(f"the {what} is not valid JSON: {exc}") from exc


def tool_calls_lark(source: str) -> str:
    """The Lark grammar of a ``tool_calls`` spec (the module docstring). Each tool's arguments are
    a ``%json`` rule of its own, so its ``$ref``s resolve against its own ``parameters``."""
    spec = _parse_json(source, "tool_calls spec")
    if not isinstance(spec, dict):
        raise _refuse("the tool_calls spec must be a JSON object")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise _refuse(f"tool_calls needs 1 to {MAX_TOOLS} tools")
    options = {**TOOL_DEFAULTS, **{k: v for k, v in spec.items() if k in TOOL_DEFAULTS}}
    for key in ("begin", "end", "separator"):
        if not isinstance(options[key], str):
            raise _refuse(f"tool_calls {key} must be a string")
    if not isinstance(options["parallel"], bool):
        raise _refuse("tool_calls parallel must be true or false")
    rules = []
    for i, tool in enumerate(tools):
        name, parameters = _tool(tool, i)
        head = '{"name": ' + json.dumps(name) + ', "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps({**parameters, 'x-guidance': JSON_FORMAT})}")
    call = " ".join(_literal(options["begin"]) + ["calls"] + _literal(options["end"]))
    more = f" ({' '.join(_literal(options['separator']) + ['call'])})*" if options["parallel"] else ""
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    return "\n".join([f"start: call{more}", f"call: {call}", f"calls: {alternatives}", *rules]) + "\n"


def _tool(tool: object, i: int) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict):
        raise _refuse(f"tool_calls tools[{i}] must be an object")
    name, parameters = tool.get("name"), tool.get("parameters", {"type": "object"})
    if not isinstance(name, str) or not name:
        raise _refuse(f"tool_calls tools[{i}].name must be a non-empty string")
    if not isinstance(parameters, dict):
        raise _refuse(f"tool_calls tools[{i}].parameters must be a JSON schema object")
    return name, parameters


def _literal(text: str) -> list[str]:
    return [json.dumps(text)] if text else []  # Lark has no empty literal


# -- compiled against a tokenizer --------------------------------------------------------------
_lock = threading.Lock()
_prototypes: weakref.WeakKeyDictionary[Tokenizer, OrderedDict[tuple[str, str], llguidance.LLMatcher]] = (
    weakref.WeakKeyDictionary())


def prototype(constraint: Constraint, tokenizer: Tokenizer) -> llguidance.LLMatcher:
    """The constraint compiled for ``tokenizer``, in its start state: copy it, never advance it
    (``RequestError(param="response_format")`` when it does not compile)."""
    key = (constraint.kind, constraint.source)
    text = grammar_text(*key)
    with _lock:
        cache = _prototypes.setdefault(tokenizer, OrderedDict())
        found = cache.get(key)
        if found is not None:
            cache.move_to_end(key)
            return found
    matcher = llguidance.LLMatcher(token_info(tokenizer), text, log_level=0, limits=LIMITS)  # without the GIL
    if matcher.is_error():
        raise _refuse(f"invalid {constraint.kind}: {matcher.get_error()}")
    with _lock:
        cache[key] = matcher
        while len(cache) > PROTOTYPES_PER_TOKENIZER:
            cache.popitem(last=False)
    return matcher


def validate(constraint: Constraint, tokenizer: Tokenizer) -> None:
    """Raise ``RequestError(param="response_format")`` unless ``constraint`` compiles for
    ``tokenizer``; the compiled grammar is kept for the request's matcher."""
    prototype(constraint, tokenizer)
