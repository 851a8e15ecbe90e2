"""Two small pieces of streaming text scanning that the reply parsers share (``reasoning.py``'s
``<think>`` splitter and ``tools.py``'s ``<tool_call>`` parser)."""

from __future__ import annotations

__all__ = ["Stripped", "partial_suffix"]


class Stripped:
    """Streams text as ``str.strip`` would cut the whole: leading whitespace is dropped, trailing
    whitespace held until more text follows it (and dropped if none does)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        text = self._held + text if self._started else text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        self._started = self._started or bool(body)
        return body


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter than it)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
