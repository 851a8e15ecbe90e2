"""The sandbox chat templates render in, with every cost of a render bounded.

A chat template comes with the model's files: code the server did not write, run on every chat
request. jinja2's ``ImmutableSandboxedEnvironment`` keeps it away from Python's internals and
from mutating its input, but not from spending: two nested ``range(100000)`` loops run for
hours, ``'x' * 4000000000`` allocates 4 GB in one step. ``BoundedSandbox`` adds, for each
render that ``render_bounded`` runs under a ``RenderLimits``:

- output: the prompt is collected from ``Template.generate()`` and refused once past ``chars``;
- values: no string may hold more than ``chars`` characters, no list or dict more than
  ``MAX_ITEMS`` items, no integer more than ``MAX_INT_BITS`` bits. What could build one in a
  single step is refused *before* it allocates, from its operands' sizes: ``*``, ``**``, ``+``,
  ``%`` and ``~``; the string methods ``center``, ``ljust``, ``rjust``, ``zfill``,
  ``expandtabs``, ``replace``, ``join``, ``translate`` and ``format``; the filters that widen
  or repeat text (``center``, ``indent``, ``replace``, ``join``, ``format``, ``wordwrap``,
  ``tojson``, ...); printing a container;
- work: what those operations produce, all together, may not pass ``WORK_FACTOR * chars``
  (a loop that keeps building big strings runs out of it long before memory does);
- time: every loop iteration and every call (a macro's included: recursion) counts a tick,
  and every ``_TICKS`` ticks the clock and ``stop`` are read, so a render ends about
  ``seconds`` after it began, or soon after its caller set ``stop``. Nothing else can repeat:
  what runs between two ticks is straight-line template code, each step of it bounded above.

Each breach raises ``ChatTemplateError``. No trio and no threads here: a caller that renders in
a worker thread sets ``stop`` when it stops waiting, and the render ends at its next check.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, MappingView
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context, markup_join, str_join
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace
from markupsafe import EscapeFormatter, Markup

from tinyloop.errors import ChatTemplateError

__all__ = [
    "DEFAULT_RENDER_CHARS",
    "DEFAULT_RENDER_SECONDS",
    "MAX_TEMPLATE_CHARS",
    "MAX_ITEMS",
    "MAX_INT_BITS",
    "WORK_FACTOR",
    "BoundedSandbox",
    "RenderLimits",
    "compile_bounded",
    "render_bounded",
]

T = TypeVar("T")

DEFAULT_RENDER_CHARS = 8 * 2**20  # twice the default body limit: all the text a request can bring, and room
DEFAULT_RENDER_SECONDS = 5.0  # a 4096-message chat renders in well under a second through real templates
MAX_TEMPLATE_CHARS = 2**20  # a template's source (real ones are under 64 KiB); compiling is not bounded otherwise
MAX_ITEMS = 2**20  # items a list or dict built by a template may hold
MAX_INT_BITS = 2**16  # bits an integer built by a template may hold
WORK_FACTOR = 8  # what one render's operations may build, all together, in units of ``chars``
_TICKS = 16  # ticks between two reads of the clock and the stop flag
_SLOW_CHARS = 2**16  # input of filters that are slow in Python or quadratic in their regex (wordwrap, striptags)
_MAX_INDENT = 64  # tojson's indent
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_TEXT_TYPES = (str, bytes)
_SEQUENCES = (str, bytes, list, tuple)
_END = object()


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """What one render may spend."""

    chars: int = DEFAULT_RENDER_CHARS  # the most characters the prompt, or any string built on the way, holds
    seconds: float = DEFAULT_RENDER_SECONDS  # wall-clock time from the render's start

    def __post_init__(self) -> None:
        if self.chars < 1 or not self.seconds > 0:
            raise ValueError(f"render limits must be positive, got {self.chars} chars and {self.seconds} s")


class _Guard:
    """One render's budget; the sandbox's hooks find it in ``_local``."""

    __slots__ = ("chars", "seconds", "deadline", "stop", "work", "ticks")

    def __init__(self, limits: RenderLimits, stop: threading.Event | None, *, work: float | None = None) -> None:
        self.chars, self.seconds, self.stop = limits.chars, limits.seconds, stop
        self.deadline = time.monotonic() + limits.seconds
        self.work = WORK_FACTOR * limits.chars if work is None else work
        self.ticks = _TICKS

    def tick(self) -> None:
        self.ticks -= 1
        if self.ticks > 0:
            return
        self.ticks = _TICKS
        if self.stop is not None and self.stop.is_set():
            raise ChatTemplateError("chat template render stopped: its caller stopped waiting")
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template ran past its time limit ({self.seconds:g} s)")

    def room(self, size: int, what: str, *, text: bool = True) -> None:
        """Refuse an operation that would build a string of ``size`` characters (or, not
        ``text``, a container of ``size`` items) past the limits."""
        cap = self.chars if text else MAX_ITEMS
        if size > cap:
            unit = "characters" if text else "items"
            raise ChatTemplateError(f"chat template: {what} would build {size} {unit}; the limit is {cap}")

    def spend(self, size: int, what: str, text: bool = True) -> None:
        """``room`` for a result of ``size``, counted as work."""
        self.work -= size
        if size > (self.chars if text else MAX_ITEMS) or self.work < 0:
            self.refuse(size, what, text)

    def refuse(self, size: int, what: str, text: bool = True) -> None:
        """Raise for a result of ``size`` that ``spend`` found past the limits."""
        self.room(size, what, text=text)
        raise ChatTemplateError(f"chat template built more than {WORK_FACTOR} x {self.chars} characters "
                                "in all (its work limit)")

    def charge(self, value: T) -> T:
        """``value``, checked against the limits and counted as work."""
        if isinstance(value, _TEXT_TYPES):
            self.spend(len(value), "an operation")
        elif isinstance(value, (list, tuple, dict)):
            self.spend(len(value), "an operation", False)
        elif isinstance(value, int):
            _check_bits(value.bit_length())
        return value


_local = threading.local()
_UNGUARDED = _Guard(RenderLimits(seconds=float("inf")), None, work=float("inf"))  # a render outside render_bounded
_COMPILE_LIMITS = RenderLimits(chars=MAX_TEMPLATE_CHARS)  # constants folded at compile time are the template's own


def _active() -> _Guard:
    guard: _Guard = getattr(_local, "guard", _UNGUARDED)
    return guard


def compile_bounded(env: jinja2.Environment, source: str) -> jinja2.Template:
    """``source`` compiled in ``env`` (a ``BoundedSandbox``): refused past
    ``MAX_TEMPLATE_CHARS``, and what jinja evaluates while compiling (it folds constant
    expressions, filters included) bounded as a render is, by ``_COMPILE_LIMITS``.
    ``ChatTemplateError`` when it is too big or does not compile."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template is {len(source)} characters; at most {MAX_TEMPLATE_CHARS} here")
    with _running(_Guard(_COMPILE_LIMITS, None)):
        try:
            return env.from_string(source)
        except Exception as exc:  # a syntax error, or one Python's compiler raises on what jinja generated
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any], limits: RenderLimits,
                   stop: threading.Event | None = None) -> str:
    """``template`` (compiled in a ``BoundedSandbox``) rendered with ``variables`` under
    ``limits``; ``stop`` set (from another thread) ends the render at its next check.
    ``ChatTemplateError`` on a breach; the template's own errors propagate as raised."""
    guard = _Guard(limits, stop)
    with _running(guard):
        chunks: Generator[str, None, None] = template.generate(variables)  # type: ignore[assignment]
        try:
            return _collect(chunks, guard)
        finally:
            chunks.close()


@contextmanager
def _running(guard: _Guard) -> Iterator[None]:
    outer = _active()
    _local.guard = guard
    try:
        yield
    finally:
        _local.guard = outer


def _collect(chunks: Iterable[str], guard: _Guard) -> str:
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > guard.chars:
            raise ChatTemplateError(f"chat template output passed {guard.chars} characters, the most a prompt "
                                    "rendered here may hold")
        out.append(chunk)
    return "".join(out)


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateError(f"chat template would build a {bits}-bit integer; the limit is {MAX_INT_BITS} bits")


# -- sizes, estimated before the operation runs ----------------------------------------------


def _text_size(value: Any, cap: int, indent: int = 0) -> int:
    """About ``len(str(value))`` (``indent``: per level and item, as json's and pprint's layout
    adds), walked no further than just past ``cap``: every item visited adds at least one
    character, so the walk is as short as the text it stands for."""
    if isinstance(value, str):
        return len(value)
    total = 0
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack and total <= cap:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        total += indent * (len(stack) - 1) + 1
        if isinstance(item, _TEXT_TYPES):
            total += len(item) + 2
            continue
        if isinstance(item, Namespace):
            item = object.__getattribute__(item, "_Namespace__attrs")
        if isinstance(item, Mapping):
            total += 4 * len(item)
            stack.append(itertools.chain.from_iterable(item.items()))
        elif isinstance(item, (list, tuple, set, frozenset, MappingView)):
            total += 2 * len(item)
            stack.append(iter(item))  # type: ignore[arg-type]  # every one of them iterates
        elif isinstance(item, int):
            total += item.bit_length() // 3
        else:
            total += 8
    return total


def _as_int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return int(len(text) + hits * max(len(new) - len(old), 0))


def _percent_size(fmt: Any, args: Any, cap: int) -> int:
    """An upper bound of ``fmt % args``: every field as wide as the widest argument, plus its
    width and precision (``*`` ones taken as the largest integer argument)."""
    specs = _PERCENT.findall(fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt)
    values = tuple(args.values()) if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    widest = max((_text_size(v, cap) for v in values), default=0)
    star = max((abs(v) for v in values if isinstance(v, int)), default=0)
    total = len(fmt)
    for width, precision in specs:
        total += widest + _spec_number(width, star) + _spec_number(precision, star)
        if total > cap:
            break
    return total


def _spec_number(digits: str, star: int) -> int:
    if digits == "*":
        return star
    return int(digits) if digits and len(digits) < 10 else 10**10 if digits else 0


def _spec_width(spec: str) -> int:
    return max((_spec_number(d, 0) for d in re.findall(r"\d+", spec)), default=0)


# -- string methods: refused before they run when their result would be too big --------------


def _width_size(text: Any, width: Any = 0, *_: Any) -> int:
    return max(len(text), _as_int(width))


def _join_size(sep: Any, items: Any) -> int:
    return sum(len(i) for i in items if isinstance(i, _TEXT_TYPES)) + max(len(items) - 1, 0) * len(sep)


def _translate_size(text: Any, table: Any) -> int:
    widest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, Mapping) else 1
    return len(text) * max(widest, 1)


def _tabs_size(text: Any, tabsize: Any = 8) -> int:
    tabs: int = text.count("\t" if isinstance(text, str) else b"\t")
    return len(text) + tabs * max(_as_int(tabsize), 0)


_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "center": _width_size, "ljust": _width_size, "rjust": _width_size, "zfill": _width_size,
    "expandtabs": _tabs_size, "replace": _replace_size, "join": _join_size, "translate": _translate_size,
}


# -- filters: checked before they run, their result checked after ---------------------------


def _text(guard: _Guard, value: Any, what: str) -> str:
    """``value`` as the filter will see it (``str(value)``), refused first when too long."""
    if isinstance(value, str):
        return value
    guard.room(_text_size(value, guard.chars), what)
    return str(value)


def _check_center(guard: _Guard, value: Any, width: Any = 80) -> None:
    guard.room(max(len(_text(guard, value, "center")), _as_int(width)), "the center filter")


def _check_indent(guard: _Guard, s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    text = _text(guard, s, "indent")
    step = len(width) if isinstance(width, str) else _as_int(width)
    guard.room(len(text) + (text.count("\n") + 1) * step, "the indent filter")


def _check_replace(guard: _Guard, s: Any, old: Any, new: Any, count: Any = None) -> None:
    text, old, new = (_text(guard, v, "replace") for v in (s, old, new))
    guard.room(_replace_size(text, old, new, -1 if count is None else count), "the replace filter")


def _check_format(guard: _Guard, value: Any, *args: Any, **kwargs: Any) -> None:
    guard.room(_percent_size(_text(guard, value, "format"), kwargs or args, guard.chars), "the format filter")


def _check_wordwrap(guard: _Guard, s: Any, width: Any = 79, _long: Any = True, wrapstring: Any = None,
                    *_: Any, **__: Any) -> None:
    text = _text(guard, s, "wordwrap")
    _check_slow(guard, text, "wordwrap")
    breaks = len(text) // max(_as_int(width), 1) + text.count("\n") + 1
    guard.room(len(text) + breaks * (len(wrapstring) if isinstance(wrapstring, str) else 1), "the wordwrap filter")


def _check_slow(guard: _Guard, value: Any, name: str) -> None:
    size = len(_text(guard, value, name))
    if size > _SLOW_CHARS:
        raise ChatTemplateError(f"chat template's {name} filter was given {size} characters; it takes at most "
                                f"{_SLOW_CHARS} here")


def _check_tojson(guard: _Guard, value: Any, indent: Any = None) -> None:
    step = len(indent) if isinstance(indent, str) else _as_int(indent)
    if step > _MAX_INDENT:
        raise ChatTemplateError(f"chat template's tojson indent is {step}; at most {_MAX_INDENT} here")
    guard.room(_text_size(value, guard.chars, step), "the tojson filter")


def _check_join(guard: _Guard, value: Any, d: Any = "", attribute: Any = None) -> tuple[Any, ...]:
    items = list(value)  # the filter's own first step, taken here so the items can be measured
    sep = _text(guard, d, "join")
    total = max(len(items) - 1, 0) * len(sep)
    for item in items:
        total += _text_size(item, guard.chars)
        if total > guard.chars:
            break
    guard.room(total, "the join filter")
    return items, d, attribute


def _check_sorting(guard: _Guard, value: Any, *_: Any, **__: Any) -> None:
    if hasattr(value, "__len__"):
        guard.room(len(value), "a sort", text=False)


def _check_pieces(guard: _Guard, value: Any, pieces: Any, *_: Any, **__: Any) -> None:
    if _as_int(pieces) > MAX_RANGE:
        raise ChatTemplateError(f"chat template asked for {pieces} slices or batch items; at most {MAX_RANGE} here")


def _check_sum(guard: _Guard, iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    if not isinstance(start, (int, float)):  # summing lists copies them over and over, quadratic in C
        raise ChatTemplateError("chat template's sum filter adds numbers only here")


def _check_stringify(guard: _Guard, value: Any, *_: Any, **__: Any) -> None:
    _text(guard, value, "a filter's input")


_STRINGIFYING = ("string", "e", "escape", "forceescape", "safe", "upper", "lower", "title", "capitalize", "trim",
                 "truncate", "wordcount", "urlencode", "xmlattr", "filesizeformat")
_FILTER_CHECKS: dict[str, Callable[..., Any]] = {
    **dict.fromkeys(_STRINGIFYING, _check_stringify),
    "center": _check_center, "indent": _check_indent, "replace": _check_replace, "format": _check_format,
    "wordwrap": _check_wordwrap, "striptags": lambda guard, value: _check_slow(guard, value, "striptags"),
    "urlize": lambda guard, value, *_, **__: _check_slow(guard, value, "urlize"), "tojson": _check_tojson,
    "pprint": lambda guard, value: guard.room(_text_size(value, guard.chars, 1), "the pprint filter"),
    "join": _check_join, "sort": _check_sorting, "dictsort": _check_sorting, "unique": _check_sorting,
    "groupby": _check_sorting, "slice": _check_pieces, "batch": _check_pieces, "sum": _check_sum,
}


def _guarded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its check and the result's; jinja's pass-context marker is kept (wraps)."""
    check = _FILTER_CHECKS.get(name)
    skip = 1 if hasattr(fn, "jinja_pass_arg") else 0  # the context, eval context or environment

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        guard = _active()
        if check is not None:
            replaced = check(guard, *args[skip:], **kwargs)
            if replaced is not None:
                args = (*args[:skip], *replaced)
        return guard.charge(fn(*args, **kwargs))

    return guarded


# -- the sandbox ----------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """jinja's code generator with every loop's items counted and ``~`` measured (jinja allows
    no new node types, so a loop's iterable is recognised by identity while it is written)."""

    _loop_iters: frozenset[int] = frozenset()

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        self._loop_iters = frozenset(id(loop.iter) for loop in node.find_all(nodes.For))
        super().visit_Template(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iters:
            return super().visit(node, *args, **kwargs)
        self.write("environment.guard_iter(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        markup = "context.eval_ctx.volatile" if frame.eval_ctx.volatile else repr(bool(frame.eval_ctx.autoescape))
        self.write("environment.guard_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {markup})")


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` with each field's width and size checked, and the whole result's."""

    total = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self.total = 0
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        guard = _active()
        guard.room(_text_size(value, guard.chars) + _spec_width(format_spec), "str.format")
        text = super().format_field(value, format_spec)
        self.total += len(text)
        guard.room(self.total, "str.format")
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value before jinja prints it: a container's text is measured first."""
    if not isinstance(value, str):
        guard = _active()
        guard.room(_text_size(value, guard.chars), "output")
    return value


def _bounded_join(parts: Iterable[str]) -> str:
    """``environment.concat``: a macro's, a ``{% set %}`` block's or a ``caller()``'s text."""
    guard = _active()
    pieces = parts if isinstance(parts, list) else list(parts)
    guard.spend(sum(map(len, pieces)), "a macro or block")
    return "".join(pieces)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the bounds of the module docstring: what they measure
    is read from the render ``render_bounded`` is running in this thread (none: sizes and
    values bounded by the defaults, no time limit)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator
    concat = staticmethod(_bounded_join)

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.filters = {name: _guarded_filter(name, fn) for name, fn in self.filters.items()}
        del self.globals["lipsum"]  # n paragraphs of lorem ipsum, unbounded; no chat template uses it

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        guard: _Guard = getattr(_local, "guard", _UNGUARDED)
        if operator == "+" and type(left) is str and type(right) is str:  # most of a chat template's work, inlined
            size = len(left) + len(right)
            guard.work -= size
            if size > guard.chars or guard.work < 0:
                guard.refuse(size, "'+'")
            return left + right
        _check_binop(guard, operator, left, right)
        return guard.charge(self.binop_table[operator](left, right))

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        guard = _active()
        guard.tick()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, _TEXT_TYPES):
            size_of = _METHOD_SIZES.get(getattr(obj, "__name__", ""))
            if size_of is not None:
                if size_of is _join_size and len(args) == 1:
                    args = (tuple(args[0]),)  # measured, then joined, once
                guard.room(size_of(owner, *args, **kwargs), f"str.{obj.__name__}")
        return guard.charge(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:
            return None
        template: str = value.__self__
        formatter = (_BoundedEscapeFormatter(self, escape=template.escape) if isinstance(template, Markup)
                     else _BoundedFormatter(self))
        as_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if as_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                return type(template)(formatter.vformat(template, (), args[0]))
            return type(template)(formatter.vformat(template, args, kwargs))

        return functools.update_wrapper(bounded, value)

    def guard_iter(self, iterable: Iterable[T]) -> Iterator[T]:
        """A loop's items, each counted as a tick."""
        guard = _active()
        for item in iterable:
            guard.tick()
            yield item

    def guard_concat(self, parts: tuple[Any, ...], markup: bool) -> str:
        """``a ~ b ~ ...``, measured first."""
        guard = _active()
        guard.room(sum(_text_size(p, guard.chars) for p in parts), "'~'")
        return guard.charge(markup_join(parts) if markup else str_join(parts))


def _check_binop(guard: _Guard, operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` when its result would pass the limits."""
    if operator == "+":
        if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            guard.room(len(left) + len(right), "'+'", text=isinstance(left, _TEXT_TYPES))
    elif operator == "*":
        if isinstance(right, _SEQUENCES) and isinstance(left, int):
            left, right = right, left
        if isinstance(left, _SEQUENCES) and isinstance(right, int):
            guard.room(len(left) * max(right, 0), "'*'", text=isinstance(left, _TEXT_TYPES))
        elif isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_bits(left.bit_length() * right)
    elif operator == "%" and isinstance(left, _TEXT_TYPES):
        guard.room(_percent_size(left, right, guard.chars), "'%' formatting")
