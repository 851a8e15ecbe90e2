"""A chat template is the model's code: its render is bounded in output, values, work and time,
and stops when its caller does, without changing what a legitimate template renders."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.http.test_reasoning import OURO_THINKING_TEMPLATE
from tests.http.test_tools import OURO_TOOLS_TEMPLATE
from tinyloop.errors import TokenizerError
from tinyloop.template_sandbox import (
    MAX_TEMPLATE_CHARS,
    ChatTemplateError,
    RenderLimits,
    compile_bounded,
    render_bounded,
)
from tinyloop.tokenizer import CHATML_TEMPLATE, _environment, _GenerationTags, _raise_from_template, render_chat

CHECKPOINTS = Path(__file__).parent / "data" / "checkpoints"
FAST = RenderLimits(chars=2**20, seconds=0.3)
USER = [{"role": "user", "content": "hi"}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]

# Each feature a template may use, with the output the plain sandbox gives it.
FEATURES = [
    CHATML_TEMPLATE, OURO_TOOLS_TEMPLATE, OURO_THINKING_TEMPLATE,
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.revindex }}"
    "{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ m.role }}{% else %}none{% endfor %}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}",
    "{% for x in [[1, [2]], [3]] recursive %}({% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %})"
    "{% endfor %}",
    "{% macro box(t) %}[{{ t }}{{ caller() if caller }}]{% endmacro %}{% call box('a') %}b{% endcall %}{{ box('c') }}",
    "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% set ns.s = ns.s ~ m.role[0] %}{% endfor %}{{ ns.n }}{{ ns.s }}",
    "{% set block %}{% for m in messages %}{{ m.content }}{% endfor %}{% endset %}{{ block|upper }}"
    "{% filter title %}hello world{% endfilter %}",
    "{% autoescape true %}{{ '<b>' ~ messages[0].content }}{% endautoescape %}",
    "{{ '%s-%05d' % ('x', 42) }}{{ '{}:{:>4}'.format('a', 'b') }}{{ '{x}'.format_map({'x': 1}) }}"
    "{{ '%s'|format('f') }}",
    "{{ messages|tojson }}{{ {'a': [1, 2]}|tojson(indent=2) }}{{ messages|map(attribute='role')|join(',') }}",
    "{{ messages|selectattr('role', 'eq', 'user')|list|length }}{{ [3, 1, 2]|sum }}"
    "{{ messages|sort(attribute='content')|first }}{{ {'b': 1, 'a': 2}|dictsort }}",
    "{{ [1, 2, 3, 4, 5]|batch(2, 0)|list }}{{ [1, 2, 3]|slice(2)|list }}{{ 'a\nb'|indent(2, true) }}"
    "{{ 'x'|center(5) }}{{ 'hello world'|truncate(8) }}{{ ('word ' * 30)|wordwrap(20) }}{{ 'aXa'|replace('a', 'bb') }}",
    "{{ 2 ** 10 }}{{ [1, 2] * 3 }}{{ 'ab' * 3 }}{{ 3 * 'c' }}{{ 7 * 6 }}{{ 'x'.center(5, '*') }}{{ 'a'.ljust(3) }}"
    "{{ '7'.zfill(3) }}{{ 'a-b'.replace('-', '+') }}{{ ','.join(['a', 'b']) }}{{ 'a b'.split() }}"
    "{{ ' x '.strip() }}{{ 'a\tb'.expandtabs(2) }}{{ [1] + [2] }}{{ 'a' + 'b' }}{{ messages[0] }}",
    "{{ messages[0]['content'][::-1] }}{{ messages|last }}{{ range(3)|list }}{{ dict(a=1) }}{{ 10 // 3 }}{{ 10 % 3 }}",
]


def plain_render(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """The render as it was before the bounds: jinja's own sandbox, configured the same way."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTags])
    env.globals["raise_exception"] = _raise_from_template
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, tools=None,
                                            bos_token="<s>", eos_token="</s>", **variables)


def checkpoint_templates() -> list[str]:
    """The test checkpoints' chat templates (a base model's, Parcae's, has none)."""
    configs = [json.loads((d / "tokenizer_config.json").read_text()) for d in sorted(CHECKPOINTS.iterdir())]
    return [config["chat_template"] for config in configs if "chat_template" in config]


@pytest.mark.parametrize("template", FEATURES + checkpoint_templates())
def test_the_bounds_change_nothing_a_template_renders(template: str) -> None:
    ours = render_chat(CHAT, template=template, bos_token="<s>", eos_token="</s>", variables={"enable_thinking": True})
    assert ours == plain_render(template, CHAT, enable_thinking=True)


BOMBS = {
    "a huge repeat": ("{{ 'x' * 4000000000 }}", r"'\*' would build 4000000000 characters"),
    "a power": ("{{ 10 ** 100000000 }}", "-bit integer"),
    "a square of squares": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                            "{% endfor %}", "-bit integer"),
    "a wide center": ("{{ 'x'.center(10**9) }}", "str.center would build"),
    "a wide zfill": ("{{ 'x'.zfill(10**9) }}", "str.zfill would build"),
    "a wide format": ("{{ '{:>1000000000}'.format('x') }}", "str.format would build"),
    "a precise format": ("{{ '{:.999999999f}'.format(1.5) }}", "str.format would build"),
    "a wide percent": ("{{ '%*s' % (1000000000, 'x') }}", "'%' formatting would build"),
    "a range product": ("{{ range(100000)|list * 100000 }}", r"'\*' would build 10000000000 items"),
    "an indent": ("{{ ('a\n' * 1000)|indent(1000000) }}", "the indent filter would build"),
    "a replace": ("{{ ('a' * 1000000).replace('a', 'b' * 1000) }}", "str.replace would build"),
    "a translate": ("{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", "str.translate would build"),
    "a doubling": ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                   "{% endfor %}", "'~' would build"),
    "a join": ("{{ (['x' * 1000000] * 1000)|join }}", "the join filter would build"),
    "a printed list": ("{{ ['x' * 1000000] * 1000 }}", "output would build"),
    "a hoard": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                "{% set ns.l = ns.l + ['x' * 500000 ~ i] %}{% endfor %}", "work limit"),
    "a quadratic sum": ("{{ ([[0] * 2800] * 2800)|sum(start=[]) }}", "adds numbers only"),
    "a regex on a long text": ("{{ ('<' * 1000000)|striptags }}", "striptags filter was given"),
    "a flood of output": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}"
                          "{% endfor %}", "output passed"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     r"time limit \(0.3 s\)"),
    "exponential macros": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                           "{{ f(100) }}", r"time limit \(0.3 s\)"),
    "endless recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
}


@pytest.mark.parametrize("name", BOMBS)
def test_a_template_bomb_is_stopped_early_as_the_templates_fault(name: str) -> None:
    template, message = BOMBS[name]
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(USER, template=template, limits=FAST)
    assert time.perf_counter() - started < 5  # the time limit is 0.3 s; the others act before allocating


def test_the_output_stops_at_the_limit() -> None:
    template = "{% for i in range(1000) %}{{ messages[0].content }}{% endfor %}"
    assert len(render_chat([{"role": "user", "content": "x" * 100}], template=template,
                           limits=RenderLimits(chars=100_000))) == 100_000
    with pytest.raises(ChatTemplateError, match="output passed 99999 characters"):
        render_chat([{"role": "user", "content": "x" * 100}], template=template, limits=RenderLimits(chars=99_999))


def test_a_render_stops_soon_after_its_caller_does() -> None:
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            render_chat(USER, template=BOMBS["nested loops"][0], limits=RenderLimits(seconds=600), stop=stop)
        except BaseException as exc:  # noqa: B036  # reported to the test thread
            failure.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.05)
    stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert isinstance(failure[0], ChatTemplateError) and "caller stopped waiting" in str(failure[0])


@pytest.mark.parametrize(("template", "message"), [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{{ messages[0].content + 1 }}", "failed to render"),
    ("{{ messages.append(1) }}", "failed to render"),
    ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
    ("x" * (MAX_TEMPLATE_CHARS + 1), "at most"),
])
def test_a_template_that_fails_on_its_own_is_the_templates_fault(template: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(USER, template=template)


def test_a_refusal_and_bad_input_are_the_callers_fault_not_the_templates() -> None:
    for call in (lambda: render_chat(USER, template="{{ raise_exception('roles must alternate') }}"),
                 lambda: render_chat(USER, variables={"messages": []}),
                 lambda: render_chat([{"content": "no role"}])):
        with pytest.raises(TokenizerError) as caught:
            call()
        assert not isinstance(caught.value, ChatTemplateError)


def test_compile_time_folding_is_bounded_too() -> None:
    """jinja folds constant filter calls while compiling: what that builds is bounded as a render
    is (60 folded 1 MB strings would be 60 MB held by the compiled template)."""
    many = "".join("{{ 'x'|center(1000000) }}" for _ in range(60))
    tracemalloc.start()
    try:
        compiled = compile_bounded(_environment(), many)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20  # what 8 folded strings take, generated source and code object included
    with pytest.raises(ChatTemplateError, match="output passed"):
        render_bounded(compiled, {}, RenderLimits(chars=2**20))
