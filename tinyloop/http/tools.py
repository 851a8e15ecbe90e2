"""Tool calls in the Hermes/Qwen format, as plain functions over already-validated dicts.

The model is offered OpenAI ``tools`` entries (``{"type": "function", "function": {"name",
"description"?, "parameters"?, "strict"?}}``) and answers with one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

How a chat route uses this module:

- prompt: a template that takes ``tools`` (``template_supports_tools``) gets them and the history
  from ``render_history``; any other template gets ``with_tool_prompt`` (the tools described in
  the system message, as LM Studio does) over ``flatten_history`` (calls and results as text).
- output: ``tool_call_constraint`` for ``tool_choice`` "required" or a named function; then
  ``ToolCallParser.parse`` on the whole text, or ``StreamingToolParser`` on its deltas. Both
  give the same content and calls. With ``parallel_tool_calls`` false, build the parsers with
  ``max_calls=1``; a reply with calls ends with ``finish_reason`` "tool_calls".

Bounds: at most ``max_calls`` (default ``MAX_TOOL_CALLS``, 64, the cap ``messages`` has on
replayed ``tool_calls``) blocks become calls; any further block stays in the content as text,
as does a block that is not a JSON object with a string ``name`` (no generated text is lost).
Parsing is linear in the text (one JSON parse per block). Call names are not checked against
the tools offered; the constraint does that when one is used.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tinyloop.errors import RequestError, TokenizerError
from tinyloop.http.textscan import Stripped, partial_suffix
from tinyloop.requests import Constraint
from tinyloop.tokenizer import template_variables

__all__ = [
    "MAX_TOOL_CALLS",
    "TOOL_CALL_BEGIN",
    "TOOL_CALL_END",
    "ToolCall",
    "ContentDelta",
    "ToolCallDelta",
    "Delta",
    "ToolCallParser",
    "StreamingToolParser",
    "template_supports_tools",
    "default_tool_prompt",
    "with_tool_prompt",
    "render_history",
    "flatten_history",
    "tool_call_constraint",
    "new_call_id",
]

MAX_TOOL_CALLS = 64
TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_SPEC_BEGIN = TOOL_CALL_BEGIN + "\n"  # what the constrained output opens and closes each call with
_SPEC_END = "\n" + TOOL_CALL_END

_TOOL_PROMPT = """# Tools

You can call functions to help with the user's request. Their signatures are below, one JSON \
object a line, inside <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding its name and its arguments inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""

Message = Mapping[str, Any]


def new_call_id() -> str:
    """A fresh call id as OpenAI spells them: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


# --- prompts and history ---------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def template_supports_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (it then describes the tools itself).

    The template is parsed, not rendered, in a sandbox configured as ``tinyloop.tokenizer``'s,
    so a mention of "tools" in its text or a ``{% set tools %}`` does not count. A template
    that does not parse supports nothing (rendering it fails anyway).
    """
    try:
        return "tools" in template_variables(template)
    except TokenizerError:
        return False


def default_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system prompt that describes ``tools`` to a template without tool support: each entry
    as one line of JSON (its null fields left out) inside ``<tools></tools>``, then how to answer
    with ``<tool_call>`` blocks."""
    lines = (json.dumps(_without_nulls(tool), ensure_ascii=False) for tool in tools)
    return _TOOL_PROMPT.format(tools="\n".join(lines))


def with_tool_prompt(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with ``default_tool_prompt(tools)`` put before the text of a leading system
    (or developer) message, or in a new system message first; the input is not changed."""
    prompt = default_tool_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") in ("system", "developer"):
        text = _text(out[0].get("content"))
        out[0]["content"] = f"{prompt}\n\n{text}" if text else prompt
        return out
    return [{"role": "system", "content": prompt}, *out]


def render_history(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """OpenAI history as chat templates with tool support take it (as transformers'
    ``apply_chat_template`` gets it): each call's ``function.arguments`` becomes the JSON object
    its string holds (templates write ``arguments | tojson``), kept as the string when it is not
    one; everything else (``tool_call_id``, ``name``, ``reasoning_content``) passes through."""
    return [_with_parsed_arguments(m) if m.get("tool_calls") else dict(m) for m in messages]


def flatten_history(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """OpenAI history as text for a template without tool support (plain ChatML), in Qwen's
    conventions: an assistant's calls become ``<tool_call>`` blocks after its content, and each
    run of ``tool`` messages one user message of ``<tool_response>\\n...\\n</tool_response>``
    blocks joined by newlines."""
    out: list[dict[str, Any]] = []
    after_tool = False  # whether out[-1] is the user message of the tool results just before
    for message in messages:
        if message.get("role") == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if after_tool:
                block = f"{out.pop()['content']}\n{block}"
            out.append({"role": "user", "content": block})
        elif message.get("tool_calls"):
            out.append(_calls_as_text(message))
        else:
            out.append(dict(message))
        after_tool = message.get("role") == "tool"
    return out


def _with_parsed_arguments(message: Message) -> dict[str, Any]:
    calls = [{**call, "function": {**call["function"], "arguments": _arguments_object(call["function"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _calls_as_text(message: Message) -> dict[str, Any]:
    blocks = [_SPEC_BEGIN + json.dumps({"name": call["function"]["name"],
                                        "arguments": _arguments_object(call["function"])},
                                       ensure_ascii=False) + _SPEC_END
              for call in message["tool_calls"]]
    text = _text(message.get("content"))
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join([text, *blocks] if text else blocks)
    return out


def _arguments_object(function: Mapping[str, Any]) -> Any:
    """A call's arguments as the object their JSON string holds, else as given."""
    arguments = function.get("arguments", "")
    if isinstance(arguments, str):
        parsed = _loads(arguments)
        if isinstance(parsed, dict):
            return parsed
    return arguments


def _text(content: object) -> str:
    """Message content as text: text parts joined with newlines, as ``render_chat`` joins them."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _without_nulls(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if not isinstance(function, Mapping):
        return dict(tool)
    return {**tool, "function": {k: v for k, v in function.items() if v is not None}}


# --- constrained output ----------------------------------------------------------------------

def tool_call_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any] | None,
                         parallel: bool) -> Constraint | None:
    """The ``tool_calls`` constraint that forces calls for ``tool_choice`` "required" (any of
    ``tools``) or a named function (that one); None for "auto", "none" or no choice.

    Its source is JSON: ``{"tools": [{"name", "parameters"}], "parallel", "begin", "end",
    "separator"}``; a tool without parameters takes any object. An object schema of the
    parameters that does not say ``additionalProperties`` is closed (``false``), as OpenAI's
    strict function calling reads it: a forced call holds the declared arguments only, and a
    model cannot run on inventing more. A name not among ``tools`` raises ``RequestError`` on
    ``tool_choice``.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = [tool["function"] for tool in tools]
    if isinstance(tool_choice, Mapping):
        name = tool_choice.get("function", {}).get("name")
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    elif tool_choice != "required":
        raise RequestError("tool_choice must be none, auto, required or a named function", param="tool_choice")
    elif not functions:
        raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
    spec = {
        "tools": [{"name": f["name"], "parameters": closed(f.get("parameters") or {"type": "object"})}
                  for f in functions],
        "parallel": parallel,
        "begin": _SPEC_BEGIN,
        "end": _SPEC_END,
        "separator": "\n",
    }
    return Constraint("tool_calls", json.dumps(spec))


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed(schema: Any, depth: int = 0) -> Any:
    """``schema`` with every object schema that leaves ``additionalProperties`` unsaid closed
    (nested ones too, to a depth of 64; past it the schema is left as given)."""
    if not isinstance(schema, Mapping) or depth > 64:
        return schema
    out = dict(schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed(v, depth + 1) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v, depth + 1) for v in out[key]]
    if isinstance(out.get("items"), Mapping):
        out["items"] = closed(out["items"], depth + 1)
    return out


# --- parsing the output ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string (compact), as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an entry of ``message.tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Streamed content text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the ``index``-th call: its first piece carries ``id`` and ``name`` (and no
    arguments), the next its whole ``arguments``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The piece as an entry of ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Delta = ContentDelta | ToolCallDelta


class ToolCallParser:
    """Splits a whole reply into its content and its calls (see the module docstring)."""

    def __init__(self, *, max_calls: int = MAX_TOOL_CALLS, new_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls = max_calls
        self._new_id = new_id

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The text outside the calls' blocks (stripped; None when empty) and the calls.

        A block runs from ``<tool_call>`` to the next ``</tool_call>``, or to the end of the text
        when that never comes (models often stop before it).
        """
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(TOOL_CALL_BEGIN, pos)) >= 0:
            content.append(text[pos:start])
            body_at = start + len(TOOL_CALL_BEGIN)
            end = text.find(TOOL_CALL_END, body_at)
            body_end, pos = (len(text), len(text)) if end < 0 else (end, end + len(TOOL_CALL_END))
            call = _call_of(text[body_at:body_end]) if len(calls) < self.max_calls else None
            if call is None:
                content.append(text[start:pos])
            else:
                calls.append(ToolCall(self._new_id(), *call))
        content.append(text[pos:])
        return "".join(content).strip() or None, calls

    def __repr__(self) -> str:
        return f"ToolCallParser(max_calls={self.max_calls})"


class StreamingToolParser:
    """``ToolCallParser`` over a reply's deltas: joined, the content deltas equal the whole
    parse's content and the call deltas its calls.

    Content streams as it comes, less the text that could begin ``<tool_call>`` and trailing
    whitespace (both held until what follows settles them; leading and final whitespace is cut,
    as the whole parse strips it). A call comes out as two deltas once its block closes, or in
    ``finish`` when the text ends inside it. Call ``finish`` once, after the last ``feed``.
    """

    def __init__(self, *, max_calls: int = MAX_TOOL_CALLS, new_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls = max_calls
        self._new_id = new_id
        self._buffer = ""  # text not yet emitted: a possible tag prefix, or an open block's body
        self._inside = False  # whether the buffer is an open block's body
        self._scanned = 0  # how much of an open block's body is known to hold no end tag
        self._calls = 0
        self._content = Stripped()

    @property
    def calls(self) -> int:
        """How many calls have been emitted."""
        return self._calls

    def feed(self, text: str) -> list[Delta]:
        """The deltas that ``text``, appended to the reply, settles."""
        self._buffer += text
        out: list[Delta] = []
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CALL_END, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._buffer) - len(TOOL_CALL_END) + 1)
                    return out
                out += self._close(self._buffer[:end], TOOL_CALL_END)
                self._buffer = self._buffer[end + len(TOOL_CALL_END):]
                continue
            start = self._buffer.find(TOOL_CALL_BEGIN)
            if start < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, TOOL_CALL_BEGIN)
                out += self._emit(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return out
            out += self._emit(self._buffer[:start])
            self._buffer = self._buffer[start + len(TOOL_CALL_BEGIN):]
            self._inside, self._scanned = True, 0

    def finish(self) -> list[Delta]:
        """What was held back, once the reply has ended."""
        body, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return self._close(body, "")
        return self._emit(body)

    def _close(self, body: str, end_tag: str) -> list[Delta]:
        self._inside = False
        call = _call_of(body) if self._calls < self.max_calls else None
        if call is None:
            return self._emit(TOOL_CALL_BEGIN + body + end_tag)
        index, self._calls = self._calls, self._calls + 1
        name, arguments = call
        return [ToolCallDelta(index, "", id=self._new_id(), name=name), ToolCallDelta(index, arguments)]

    def _emit(self, text: str) -> list[Delta]:
        text = self._content.push(text)
        return [ContentDelta(text)] if text else []

    def __repr__(self) -> str:
        state = "inside a call" if self._inside else "in content"
        return f"StreamingToolParser({state}, calls={self._calls}, held={len(self._buffer)} chars)"


def _call_of(body: str) -> tuple[str, str] | None:
    """A block's ``(name, arguments as compact JSON)``, or None when it is not a call: a JSON
    object with a non-empty string ``name`` and object ``arguments`` (or ``parameters``, as
    Llama-style models write; a JSON string of an object is taken too; absent means ``{}``)."""
    value = _loads(body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def _loads(text: str) -> Any:
    """``text`` as strict JSON (no NaN or Infinity, which no JSON parser downstream accepts), or
    None when it is not JSON."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
