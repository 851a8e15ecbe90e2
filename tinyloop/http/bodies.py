"""Request bodies without stalling the event loop: decoding, checking and the text limits.

A big body (JSON parsing, pydantic validation) and a long text (tokenising, detokenising) are
worked on in a worker thread, so the event loop keeps serving streams meanwhile; small ones stay
on the loop, where they cost less than the hop to a thread. A chat template always renders in a
worker thread (``ServedModel.render_chat``): its cost is the model's, not the request's size.
At most ``TEXT_THREADS`` such jobs run at once (a ``trio.CapacityLimiter``): many big bodies
wait for a thread in turn rather than taking every thread Trio lends.

Every bad body is a 400 naming what is wrong: JSON that is not UTF-8, not JSON, nested deeper
than Python's parser goes, or holding a string that is not valid Unicode (a lone surrogate such
as ``"\\ud800"``, which JSON's escapes can spell); a prompt or message list past the server's
limits is a 413 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import trio
from pydantic import ValidationError

from tinyloop.http.errors import ApiError, from_validation
from tinyloop.settings import Settings

__all__ = ["INLINE_BYTES", "INLINE_CHARS", "TEXT_THREADS", "check_limits", "decode_body", "off_loop", "text_limiter"]

T = TypeVar("T")

INLINE_BYTES = 64 * 1024  # bodies up to this size are decoded and validated on the event loop
INLINE_CHARS = 16 * 1024  # texts (characters or tokens) up to this size are handled on the loop
TEXT_THREADS = 2  # worker threads for big bodies and long texts, all requests together

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("tinyloop_text_limiter")
# JSON can only make a lone surrogate from a \uD800-\uDFFF escape; a body without one needs no walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def text_limiter() -> trio.CapacityLimiter:
    """The one limiter of this Trio run (created on first use: no Trio object at import)."""
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(TEXT_THREADS)
        _LIMITER.set(limiter)
        return limiter


async def off_loop(fn: Callable[..., T], *args: Any, size: int, inline: int = INLINE_CHARS) -> T:
    """``fn(*args)``: on the loop when ``size`` is at most ``inline``, else in a worker thread.
    A caller cancelled meanwhile (the client left) returns at once; the thread finishes its
    bounded work and its result is dropped."""
    if size <= inline:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=text_limiter(), abandon_on_cancel=True)


async def decode_body(raw: bytes, model: type[Any], settings: Settings) -> Any:
    """``raw`` decoded and validated against ``model`` (off the loop when big)."""
    return await off_loop(_decode, raw, model, settings, size=len(raw), inline=INLINE_BYTES)


def _decode(raw: bytes, model: type[Any], settings: Settings) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: it is nested too deeply",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_surrogates(data)
    check_limits(data, settings)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _refuse_surrogates(data: dict[str, Any]) -> None:
    """400 naming the first field (``messages.0.content``) whose string, or key, is not valid
    Unicode. Iterative: the depth of ``data`` is whatever the parser accepted."""
    todo: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            if not _valid_unicode(value):
                field = ".".join(path) or None
                raise ApiError(400, f"Invalid value for '{field}': the string holds a lone surrogate "
                               "(a \\ud800-\\udfff escape that is not half of a pair); "
                               "it is not valid Unicode", param=field, code="invalid_value")
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                todo.append((item, (*path, key)))
                todo.append((key, path))  # a bad key is blamed on the object holding it
        elif isinstance(value, list):
            todo.extend((item, (*path, str(i))) for i, item in reversed(list(enumerate(value))))


def _valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_limits(data: dict[str, Any], settings: Settings) -> None:
    """413 naming ``prompt`` or ``messages`` when the body carries more text than the server
    takes: checked on the decoded JSON, before the costly validation of many messages."""
    prompt = data.get("prompt")
    if isinstance(prompt, str) and len(prompt) > settings.max_prompt_chars:
        raise _too_large("prompt", f"the prompt is {len(prompt)} characters",
                         f"{settings.max_prompt_chars} (--max-prompt-chars)")
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > settings.max_messages:
        raise _too_large("messages", f"there are {len(messages)} messages",
                         f"{settings.max_messages} (--max-messages)")
    chars = sum(_message_chars(m) for m in messages)
    if chars > settings.max_prompt_chars:
        raise _too_large("messages", f"the messages hold {chars} characters",
                         f"{settings.max_prompt_chars} (--max-prompt-chars)")


def _message_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_large(param: str, what: str, limit: str) -> ApiError:
    return ApiError(413, f"{what}; this server takes at most {limit}", param=param,
                    code="request_too_large")
