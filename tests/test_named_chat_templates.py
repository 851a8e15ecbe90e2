"""HF's list of named chat templates (``[{"name": "default", ...}, {"name": "tool_use", ...}]``):
read from ``tokenizer_config.json``, kept in the artifact, and the ``tool_use`` one chosen for a
chat with tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.convert.checkpoints import CHECKPOINTS, writable_copy
from tinyloop.convert import convert
from tinyloop.engine.engine import Engine
from tinyloop.errors import ArtifactError, ConfigError, TokenizerError
from tinyloop.http.chat import plan_chat
from tinyloop.http.schemas import ChatCompletionRequest
from tinyloop.http.service import ServedModel
from tinyloop.model.artifact import KEY_CHAT_TEMPLATES, artifact_metadata, load_artifact, save_artifact
from tinyloop.model.looped import LoopedLM
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.settings import Settings
from tinyloop.tokenizer import CHATML_TEMPLATE, MAX_NAMED_TEMPLATES, Tokenizer, default_tokenizer, split_chat_templates

TOOL_USE = ("TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
NAMED = [{"name": "default", "template": CHATML_TEMPLATE}, {"name": "tool_use", "template": TOOL_USE}]
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_a_string_is_the_default_and_a_list_is_split_by_name() -> None:
    assert split_chat_templates("{{ x }}") == ("{{ x }}", {})
    assert split_chat_templates(None) == ("", {})
    assert split_chat_templates(NAMED) == (CHATML_TEMPLATE, {"tool_use": TOOL_USE})


@pytest.mark.parametrize(("value", "message"), [
    ({"default": "x"}, "a string or a list"),
    ([{"name": "tool_use", "template": "x"}], "no 'default' one"),
    ([{"name": "default", "template": "x"}, {"name": "default", "template": "y"}], r"chat_template\[1\] repeats"),
    ([{"name": "default", "template": 3}], r"chat_template\[0\] must be an object"),
    ([{"name": "", "template": "x"}], r"chat_template\[0\] must be an object"),
    (["default"], r"chat_template\[0\] must be an object"),
    ([{"name": f"t{i}", "template": "x"} for i in range(MAX_NAMED_TEMPLATES + 1)], "at most 16"),
])
def test_a_malformed_list_is_refused_naming_the_entry(value: object, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        split_chat_templates(value)


def _hf_with_templates(tmp_path: Path, templates: object) -> Path:
    hf = writable_copy(CHECKPOINTS / "ouro-tiny", tmp_path)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    config["chat_template"] = templates
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    return hf


def test_a_converted_model_keeps_its_named_templates(tmp_path: Path) -> None:
    out = tmp_path / "named.tinyloop"
    convert(_hf_with_templates(tmp_path, NAMED), out)
    engine = Engine.load(out, dtype=torch.float32, kv_cache_mb=4)
    assert engine.chat_template == CHATML_TEMPLATE
    assert engine.tokenizer.chat_templates == {"tool_use": TOOL_USE}
    assert ServedModel.from_engine(engine, Settings()).chat_templates == {"tool_use": TOOL_USE}


def test_a_list_without_a_default_is_refused_at_conversion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: chat_template lists 'tool_use' but no 'default'"):
        convert(_hf_with_templates(tmp_path, NAMED[1:]), tmp_path / "out.tinyloop")


def _tokenizer_with_named() -> Tokenizer:
    tok = Tokenizer.from_json(default_tokenizer().to_json())  # a copy: the shared one stays as it is
    tok.chat_templates = {"tool_use": TOOL_USE}
    return tok


@pytest.fixture(scope="module")
def tiny_model() -> LoopedLM:
    return init_model(PRESETS["tiny"], seed=0)


def test_an_artifact_round_trips_its_named_templates(tmp_path: Path, tiny_model: LoopedLM) -> None:
    path = tmp_path / "a.tinyloop"
    save_artifact(path, tiny_model, _tokenizer_with_named())
    art = load_artifact(path)
    assert art.tokenizer.chat_templates == {"tool_use": TOOL_USE}
    assert art.chat_template == CHATML_TEMPLATE
    with pytest.raises(ArtifactError, match="may not override 'tinyloop.chat_templates'"):
        save_artifact(path, tiny_model, _tokenizer_with_named(),
                      extra_metadata={KEY_CHAT_TEMPLATES: "{}"})
    with pytest.raises(ArtifactError, match="may not override 'tinyloop.chat_templates'"):  # ours without any too
        save_artifact(path, tiny_model, default_tokenizer(), extra_metadata={KEY_CHAT_TEMPLATES: "{}"})


@pytest.mark.parametrize(("stored", "message"), [
    ("not json", "is not JSON"),
    (json.dumps(["x"]), "must map at most 16 names"),
    (json.dumps({"default": "x"}), "other than 'default'"),
    (json.dumps({"tool_use": 1}), "must map"),
])
def test_malformed_named_templates_in_an_artifact_are_refused(tmp_path: Path, tiny_model: LoopedLM, stored: str,
                                                              message: str) -> None:
    model = tiny_model
    path = tmp_path / "bad.tinyloop"
    metadata = artifact_metadata(path, model.config, _tokenizer_with_named(), CHATML_TEMPLATE,
                                 {"bos_id": 0, "eos_id": 0, "eos_ids": [0], "pad_id": None})
    metadata[KEY_CHAT_TEMPLATES] = stored
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=metadata)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path)


def _served(chat_templates: dict[str, str]) -> ServedModel:
    return ServedModel(id="m", tokenizer=default_tokenizer(), chat_template=CHATML_TEMPLATE, max_seq_len=4096,
                       default_loops=4, max_loops=8, vocab_size=4096, chat_templates=chat_templates)


async def test_a_chat_with_tools_renders_through_the_tool_use_template() -> None:
    model = _served({"tool_use": TOOL_USE})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = await plan_chat(model, ChatCompletionRequest.model_validate({"messages": messages,
                                                                              "tools": [WEATHER]}))
    assert with_tools.prompt_text == "TOOLS get_weather\nuser: Weather in Paris?\n"
    without = await plan_chat(model, ChatCompletionRequest.model_validate({"messages": messages}))
    assert without.prompt_text == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    plain = await plan_chat(_served({}), ChatCompletionRequest.model_validate({"messages": messages,
                                                                               "tools": [WEATHER]}))
    assert plain.prompt_text.startswith("<|im_start|>system\n# Tools")  # ChatML: the default tool prompt
