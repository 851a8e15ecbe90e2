"""A chat request made ready, and what its replies become.

``plan_chat`` turns a chat body into the prompt the model sees (the template with the history,
the tools and the template variables), the constraint on the output (``response_format``) and a
factory of ``Reply`` shapers. A ``Reply`` turns one choice's generated text into OpenAI's
message (whole) or deltas (streamed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinyloop.errors import RequestError
from tinyloop.http.errors import ApiError
from tinyloop.http.reasoning import StreamingReasoningSplitter, prompt_opens_think, split_reasoning, template_thinks
from tinyloop.http.schemas import ChatCompletionRequest, NamedTool
from tinyloop.http.service import ChatOptions, ServedModel
from tinyloop.http.tools import (
    MAX_TOOL_CALLS,
    ContentDelta,
    Delta,
    StreamingToolParser,
    ToolCallParser,
    flatten_history,
    render_history,
    template_supports_tools,
    tool_call_constraint,
    with_tool_prompt,
)
from tinyloop.requests import Constraint

__all__ = ["ChatPlan", "ChatReply", "Reply", "plan_chat"]


class Reply:
    """One choice's text as OpenAI's shapes; the plain one passes text through (``content``
    for chat, ``text`` for text completions)."""

    def __init__(self, key: str = "content") -> None:
        self.key = key

    @classmethod
    def text(cls) -> Reply:
        return cls("text")

    def _wrap(self, fields: dict[str, Any]) -> dict[str, Any]:
        if self.key == "text":
            return {"text": fields.get("content") or ""}
        return {"delta": fields}

    def whole(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The choice's whole content and its finish reason."""
        if self.key == "text":
            return {"text": text}, finish
        return {"message": {"role": "assistant", "content": text}}, finish

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The chunks' contents for newly generated ``text`` (none while it is held back)."""
        return [self._wrap({"content": text})] if text else []

    def empty(self) -> dict[str, Any]:
        """A chunk's content that adds no text (one that carries only logprobs)."""
        return self._wrap({"content": ""})

    def finish(self, finish: str) -> tuple[list[dict[str, Any]], str]:
        """What was held back, and the finish reason, once the choice ended."""
        return [], finish

    def last(self) -> dict[str, Any]:
        """The content of the choice's last chunk (the one with ``finish_reason``)."""
        return {"text": ""} if self.key == "text" else {"delta": {}}


class ChatReply(Reply):
    """A chat choice's text as OpenAI's message or deltas, with the reasoning of a thinking
    template split off into ``reasoning_content`` (``reasoning.py``) and, when tools are
    offered, Hermes-style ``<tool_call>`` blocks parsed into ``tool_calls`` (``tools.py``;
    ``finish_reason`` then ``tool_calls``). Reasoning is split first, so a call written while
    thinking is not a call."""

    def __init__(self, *, think: bool, started_in_think: bool, tools: bool, max_calls: int) -> None:
        super().__init__()
        self.think, self.started, self.tools, self.max_calls = think, started_in_think, tools, max_calls
        self.splitter = StreamingReasoningSplitter(started_in_think=started_in_think)
        self.parser = StreamingToolParser(max_calls=max_calls)

    def whole(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        reasoning, content = split_reasoning(text, self.started) if self.think else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tools:
            message["content"], calls = ToolCallParser(max_calls=self.max_calls).parse(content or "")
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish = _tool_finish(finish)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {"message": message}, finish

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.splitter.feed(text) if self.think else [("content", text)] if text else [])

    def finish(self, finish: str) -> tuple[list[dict[str, Any]], str]:
        out = self._deltas(self.splitter.finish()) if self.think else []
        if self.tools:
            out += [self._tool_delta(d) for d in self.parser.finish()]
            if self.parser.calls:
                finish = _tool_finish(finish)
        return out, finish

    def _deltas(self, pieces: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append({"delta": {"reasoning_content": piece}})
            elif self.tools:
                out += [self._tool_delta(d) for d in self.parser.feed(piece)]
            elif piece:
                out.append({"delta": {"content": piece}})
        return out

    @staticmethod
    def _tool_delta(delta: Delta) -> dict[str, Any]:
        if isinstance(delta, ContentDelta):
            return {"delta": {"content": delta.text}}
        return {"delta": {"tool_calls": [delta.to_openai()]}}


def _tool_finish(finish: str) -> str:
    """OpenAI's ``tool_calls`` for a reply that ended on its own after calling tools."""
    return "tool_calls" if finish == "stop" else finish


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A chat made ready: the prompt (tokens and text), its output constraint, its replies."""

    tokens: list[int]
    prompt_text: str
    constraint: Constraint | None
    reply: Callable[[], Reply]


async def plan_chat(model: ServedModel, body: ChatCompletionRequest) -> ChatPlan:
    """The chat's prompt, its output constraint (``response_format``, or ``tool_choice``
    ``required`` or a named function: a call that parses and matches the tool's parameters)
    and its reply shaper.

    Tools reach a template that reads ``tools`` as transformers passes them, with the history's
    call arguments as objects; a template without tool support (the demo's ChatML) gets the
    default tool prompt in the system message and the history's calls and results as text. A
    model with a ``tool_use`` template renders a chat with tools through it."""
    tools = [t.model_dump(exclude_none=True) for t in body.active_tools()]
    template = model.template_for(bool(tools))
    turns = [m.turn() for m in body.messages]
    native = template_supports_tools(template)
    if native:
        turns = render_history(turns)
    elif tools or any(t.get("tool_calls") or t["role"] == "tool" for t in turns):
        turns = flatten_history(turns)
        if tools:
            turns = with_tool_prompt(turns, tools)
    options = ChatOptions(tools=tools if native and tools else None, add_generation_prompt=body.add_generation_prompt,
                          variables=body.chat_template_kwargs or {}, template=template)
    text = await model.render_chat(turns, options)
    tokens = await model.encode_text(text)
    constraint = body.constraint()
    try:
        calls = tool_call_constraint(tools, _choice(body), body.parallel_tool_calls) if tools else None
    except RequestError as exc:
        raise ApiError(400, str(exc), param="tool_choice", code="invalid_value") from None
    if calls is not None and constraint is not None:
        raise ApiError(400, "response_format cannot be combined with tool_choice 'required' or a named "
                       "function: the reply must be a tool call", param="response_format", code="invalid_value")
    think = template_thinks(template)
    started = think and prompt_opens_think(text)
    max_calls = MAX_TOOL_CALLS if body.parallel_tool_calls else 1
    reply = functools.partial(ChatReply, think=think, started_in_think=started, tools=bool(tools),
                              max_calls=max_calls) if think or tools else Reply
    return ChatPlan(tokens, text, calls or constraint, reply)


def _choice(body: ChatCompletionRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    return choice.model_dump() if isinstance(choice, NamedTool) else choice
