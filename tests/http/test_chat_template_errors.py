"""A model's chat template that fails is the server's error (500, ``chat_template_error``), one
that refuses the client's messages is the client's (400); a model whose template cannot render
an ordinary chat is refused at load."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import trio

from tests.http.conftest import running_server, tiny_engine
from tinyloop.errors import ConfigError
from tinyloop.http.service import ServedModel
from tinyloop.server import served_model
from tinyloop.settings import Settings
from tinyloop.template_sandbox import RenderLimits
from tinyloop.testing import FakeEngine
from tinyloop.tokenizer import CHATML_TEMPLATE, default_tokenizer

# ChatML, but a last message "boom" loops for ever, "crash" adds a string to a number, and an
# assistant turn first is refused as HF templates refuse a bad role order.
TRAPPED = (
    "{% if messages[0].role == 'assistant' %}{{ raise_exception('Conversation must start with the user') }}"
    "{% endif %}{% if messages[-1].content == 'boom' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}{% if messages[-1].content == 'crash' %}{{ 1 + 'x' }}{% endif %}"
    + CHATML_TEMPLATE
)
NO_SYSTEM = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + CHATML_TEMPLATE)  # as Gemma's templates are
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def model(template: str, *, seconds: float = 5.0, **named: str) -> ServedModel:
    return ServedModel(id="fake", tokenizer=default_tokenizer(), chat_template=template, max_seq_len=2048,
                       default_loops=4, max_loops=8, vocab_size=4096, chat_templates=named,
                       render_limits=RenderLimits(seconds=seconds))


async def test_a_failing_template_is_a_500_and_a_refusal_a_400() -> None:
    def chat(content: str, role: str = "user") -> dict[str, Any]:
        return {"messages": [{"role": role, "content": content}], "max_tokens": 2}

    with trio.fail_after(30):
        async with running_server(Settings(port=0), FakeEngine(), model(TRAPPED, seconds=0.3)) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=20) as client:
            crash = await client.post("/v1/chat/completions", json=chat("crash"))
            boom = await client.post("/v1/chat/completions", json=chat("boom"))
            native = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "boom"}]})
            refused = await client.post("/v1/chat/completions", json=chat("hi", role="assistant"))
            fine = await client.post("/v1/chat/completions", json=chat("hi"))
    for resp, message in ((crash, "failed to render"), (boom, r"time limit \(0.3 s\)"),
                          (native, r"time limit \(0.3 s\)")):
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "chat_template_error")
        assert error["message"].startswith("the model's chat template")
        assert re.search(message, error["message"]), error
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "Conversation must start with the user" in refused.json()["error"]["message"]
    assert fine.status_code == 200, fine.text


def test_ordinary_templates_pass_the_load_check() -> None:
    for template in (CHATML_TEMPLATE, TRAPPED, NO_SYSTEM):
        model(template).check_chat_templates()
    model(CHATML_TEMPLATE, tool_use="{% for t in tools %}{{ t.function.name }}{% endfor %}").check_chat_templates()


@pytest.mark.parametrize(("templates", "message"), [
    ({"template": BOMB}, r"'default' cannot serve chats: chat template ran past its time limit \(0.2 s\)"),
    ({"template": "{{ 'x' * 10**9 }}"}, "'default' cannot serve chats: chat template: '\\*' would build"),
    ({"template": "{{ messages[0].content.nope() }}"}, "'default' cannot serve chats: chat template failed"),
    ({"template": "{% for %}"}, "'default' cannot serve chats: chat template does not compile"),
    ({"template": "{{ raise_exception('never') }}"}, "'default' cannot serve chats: it refuses every sample chat"),
    ({"template": CHATML_TEMPLATE, "tool_use": "{% if tools %}{{ tools.x.y }}{% endif %}"},
     "'tool_use' cannot serve chats: chat template failed to render"),
])
def test_a_template_that_cannot_render_a_sample_chat_refuses_the_model(templates: dict[str, str],
                                                                        message: str) -> None:
    named = {k: v for k, v in templates.items() if k != "template"}
    with pytest.raises(ConfigError, match=message):
        model(templates["template"], **named).check_chat_templates(RenderLimits(chars=2**18, seconds=0.2))


def test_the_composition_root_refuses_such_a_model() -> None:
    with pytest.raises(ConfigError, match=r"chat template 'default' cannot serve chats: .*would build"):
        served_model(tiny_engine(chat_template="{{ 'x' * 10**9 }}"), Settings())
    assert served_model(tiny_engine(), Settings()).chat_template == CHATML_TEMPLATE


async def test_the_render_time_limit_is_the_settings_chat_template_timeout() -> None:
    from tinyloop.errors import ChatTemplateError

    loops = ("{% if messages[-1].content == 'boom' %}{% for i in range(100000) %}{% for j in range(100000) %}"
             "{% endfor %}{% endfor %}{% endif %}" + CHATML_TEMPLATE)
    served = served_model(tiny_engine(chat_template=loops), Settings(chat_template_timeout=0.3))
    assert served.render_limits.seconds == 0.3
    start = trio.current_time()
    with pytest.raises(ChatTemplateError, match=r"time limit \(0.3 s\)"):
        await served.render_chat([{"role": "user", "content": "boom"}])
    assert trio.current_time() - start < 5  # not the default 5 s: the setting's 0.3 s (and a slow machine)
