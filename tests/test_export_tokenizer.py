"""``tinyloop export-tokenizer ARTIFACT DIR``: a Hugging Face tokenizer folder that encodes, decodes
and renders chats as TinyLoop does, read back with ``tokenizers`` (and with ``transformers`` where
it is installed: it is no dependency of TinyLoop's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.ext
import jinja2.nodes
import pytest
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyloop.cli import main
from tinyloop.convert import convert
from tinyloop.model.artifact import inspect_artifact, load_artifact
from tinyloop.tokenizer import HF_TOKENIZER_FILES

TEXTS = ["Once upon a time", "def add(a, b):\n    return a + b\n", "417+386=803", "héllo wörld ✓ 日本",
         "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces and trailing  ", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How deep?"},
            {"role": "assistant", "content": "Four loops."}, {"role": "user", "content": "Deeper?"}]
HUGINN = Path(__file__).parent / "data" / "checkpoints" / "huginn-tiny"


def export(artifact: Path, out: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """Run the command; the ``tokenizer_config.json`` it wrote."""
    assert main(["export-tokenizer", str(artifact), str(out), *args]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines() == [f"wrote {out / name}" for name in HF_TOKENIZER_FILES]
    config: dict[str, Any] = json.loads((out / "tokenizer_config.json").read_text())
    return config


class GenerationTags(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers' assistant-mask tags)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def render(template: str, add_generation_prompt: bool, **tokens: str) -> str:
    """The template rendered by jinja2 as transformers' ``apply_chat_template`` sets it up."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", GenerationTags])
    return env.from_string(template).render(messages=MESSAGES, add_generation_prompt=add_generation_prompt,
                                            **tokens)


@pytest.fixture(scope="module")
def huginn_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Huginn checkpoint converted: a BOS apart from its EOS, and a pad token."""
    out = tmp_path_factory.mktemp("huginn") / "huginn.tinyloop"
    convert(HUGINN, out)
    return out


def test_the_tokenizer_json_encodes_as_tinyloop_does(tiny_artifact: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tok"
    export(tiny_artifact, out, capsys)
    ours = load_artifact(tiny_artifact).tokenizer
    theirs = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text).ids == ids, text  # add_special_tokens=True by default: nothing is added
        assert theirs.decode(ids, skip_special_tokens=False) == ours.decode(ids, skip_special=False), text


def test_the_config_names_the_models_tokens_context_and_template(tiny_artifact: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = export(tiny_artifact, tmp_path / "tok", capsys)
    art = load_artifact(tiny_artifact)
    tok = art.tokenizer
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (tok.bos_token, tok.eos_token, None)
    assert config["model_max_length"] == art.config.max_position
    assert config["chat_template"] == art.chat_template
    assert (config["add_bos_token"], config["add_eos_token"], config["clean_up_tokenization_spaces"]) == (
        False, False, False)
    added = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["added_tokens"]
    assert config["added_tokens_decoder"] == {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in added}
    special = json.loads((tmp_path / "tok" / "special_tokens_map.json").read_text())
    assert special == {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    for generation_prompt in (True, False):
        assert render(config["chat_template"], generation_prompt, bos_token=tok.bos_token,
                      eos_token=tok.eos_token) == tok.render_chat(
            MESSAGES, template=art.chat_template, add_generation_prompt=generation_prompt)


def test_a_converted_checkpoint_gets_back_its_own_special_tokens(huginn_artifact: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = export(huginn_artifact, tmp_path / "tok", capsys)
    original = json.loads((HUGINN / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token"):
        assert config[key] == original[key], key
    info = inspect_artifact(huginn_artifact)
    assert config["model_max_length"] == info["config"]["max_position"]
    tok = load_artifact(huginn_artifact).tokenizer
    assert render(config["chat_template"], True, bos_token=config["bos_token"],
                  eos_token=config["eos_token"]) == tok.render_chat(MESSAGES, template=info["chat_template"])


def test_transformers_loads_the_folder_offline(tiny_artifact: Path, huginn_artifact: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name, artifact in (("tiny", tiny_artifact), ("huginn", huginn_artifact)):
        out = tmp_path / name
        export(artifact, out, capsys)
        art = load_artifact(artifact)
        hf = transformers.AutoTokenizer.from_pretrained(str(out))
        for text in TEXTS:
            ids = art.tokenizer.encode(text)
            assert hf.encode(text) == ids, (name, text)  # add_special_tokens=True: no BOS
            assert hf.decode(ids) == art.tokenizer.decode(ids, skip_special=False), (name, text)
        assert (hf.bos_token, hf.eos_token) == (art.tokenizer.bos_token, art.tokenizer.eos_token)
        assert hf.model_max_length == art.config.max_position
        assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
            art.tokenizer.render_chat(MESSAGES, template=art.chat_template))


def test_a_folder_that_is_not_empty_needs_force(tiny_artifact: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tok"
    out.mkdir()
    (out / "README.md").write_text("mine\n")
    assert main(["export-tokenizer", str(tiny_artifact), str(out)]) == 2
    assert "folder is not empty (--force writes into it)" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    export(tiny_artifact, out, capsys, "--force")
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", *HF_TOKENIZER_FILES])


@pytest.mark.parametrize(("artifact", "out", "fragment"), [
    ("{tmp}/absent.tinyloop", "{tmp}/tok", "absent.tinyloop: no such artifact file"),
    ("{tmp}", "{tmp}/tok", "is a directory, not an artifact file"),
    ("{artifact}", "{artifact}", "exists and is not a folder"),
])
def test_errors_exit_2_with_a_message(tiny_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      artifact: str, out: str, fragment: str) -> None:
    args = [a.format(tmp=tmp_path, artifact=tiny_artifact) for a in (artifact, out)]
    assert main(["export-tokenizer", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err
    assert not (tmp_path / "tok").exists()
