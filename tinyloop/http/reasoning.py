"""Reasoning split off a reply, for templates whose models think in ``<think>…</think>``
(Ouro-Thinking, Qwen3, DeepSeek-R1).

A reply either opens with ``<think>`` (leading whitespace aside) and reasons until ``</think>``,
or, when the prompt already opened ``<think>`` (``prompt_opens_think``: the template ends the
generation prompt with ``<think>\\n``), starts inside the reasoning and only closes it. What
follows ``</think>`` is the content; a reply that never closes is all reasoning. A ``<think>``
anywhere but the start is content text. Both parts are stripped of surrounding whitespace, None
when empty; vLLM and DeepSeek send them as ``message.reasoning_content`` / ``message.content``
(``delta.reasoning_content`` / ``delta.content`` when streaming).

``split_reasoning`` takes a whole reply, ``StreamingReasoningSplitter`` its deltas; joined, the
streamed parts equal the whole split.
"""

from __future__ import annotations

from typing import Literal

from tinyloop.http.textscan import Stripped, partial_suffix

__all__ = [
    "THINK_OPEN",
    "THINK_CLOSE",
    "Kind",
    "split_reasoning",
    "prompt_opens_think",
    "template_thinks",
    "StreamingReasoningSplitter",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

Kind = Literal["reasoning", "content"]


def split_reasoning(text: str, started_in_think: bool = False) -> tuple[str | None, str | None]:
    """A whole reply's ``(reasoning, content)``; ``started_in_think`` when the prompt opened
    ``<think>`` (``prompt_opens_think``)."""
    if not started_in_think:
        opened = text.lstrip()
        if not opened.startswith(THINK_OPEN):
            return None, text.strip() or None
        text = opened[len(THINK_OPEN):]
    reasoning, _, content = text.partition(THINK_CLOSE)
    return reasoning.strip() or None, content.strip() or None


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` (its last text, whitespace
    aside, is the tag), so the reply starts in the reasoning. Qwen3's closed empty
    ``<think>\\n\\n</think>`` (thinking switched off) does not open it."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def template_thinks(template: str) -> bool:
    """Whether a chat template is a thinking one: it mentions ``<think>``, ``</think>`` or
    ``enable_thinking``. A cheap text check: the split is harmless on a reply without tags."""
    return any(mark in template for mark in (THINK_OPEN, THINK_CLOSE, "enable_thinking"))


class StreamingReasoningSplitter:
    """``split_reasoning`` over a reply's deltas.

    Text streams out as it comes, less what could be the start of an awaited tag (``<think>`` at
    the start, ``</think>`` inside the reasoning) and each part's trailing whitespace, both held
    until what follows settles them. Call ``finish`` once, after the last ``feed``.
    """

    def __init__(self, *, started_in_think: bool = False) -> None:
        self._state: Literal["start", "reasoning", "content"] = "reasoning" if started_in_think else "start"
        self._buffer = ""  # text not yet emitted
        self._parts: dict[Kind, Stripped] = {"reasoning": Stripped(), "content": Stripped()}

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        """The ``(kind, text)`` pieces that ``text``, appended to the reply, settles."""
        self._buffer += text
        out: list[tuple[Kind, str]] = []
        if self._state == "start":
            opened = self._buffer.lstrip()
            if opened.startswith(THINK_OPEN):
                self._state, self._buffer = "reasoning", opened[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(opened):  # blank so far, or a prefix of the tag
                return out
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_CLOSE)
            if end < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, THINK_CLOSE)
                self._emit("reasoning", self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return out
            self._emit("reasoning", self._buffer[:end], out)
            self._state, self._buffer = "content", self._buffer[end + len(THINK_CLOSE):]
        self._emit("content", self._buffer, out)
        self._buffer = ""
        return out

    def finish(self) -> list[tuple[Kind, str]]:
        """What was held back, once the reply has ended: an unclosed reasoning's tail, or a
        reply too short to open ``<think>`` as content."""
        out: list[tuple[Kind, str]] = []
        self._emit("reasoning" if self._state == "reasoning" else "content", self._buffer, out)
        self._buffer = ""
        return out

    def _emit(self, kind: Kind, text: str, out: list[tuple[Kind, str]]) -> None:
        text = self._parts[kind].push(text)
        if text:
            out.append((kind, text))

    def __repr__(self) -> str:
        return f"StreamingReasoningSplitter(state={self._state!r}, held={len(self._buffer)} chars)"
