"""``tinyloop convert`` on the tiny Huginn reference checkpoint: logits parity with the
reference code's outputs (tests/data/checkpoints/huginn-tiny/README in the shared fixtures), and
a clear refusal for every checkpoint it cannot convert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.convert.checkpoints import (
    CHECKPOINTS,
    TOL,
    cached_decode_logits,
    converted_engine,
    full_logits,
    greedy_tokens,
    max_diff,
    writable_copy,
)
from tinyloop.cli import main
from tinyloop.convert import convert
from tinyloop.engine.engine import Engine
from tinyloop.errors import ArtifactError, ConfigError, TokenizerError
from tinyloop.model.context import FullContext
from tinyloop.model.looped import RowSpec

FIXTURE = CHECKPOINTS / "huginn-tiny"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    # the reference ran with init_scale=0
    return converted_engine(FIXTURE, tmp_path_factory.mktemp("huginn"), state_init="zeros")


@pytest.mark.parametrize("loops", [1, 4, 8])
def test_full_forward_logits_match_the_reference(engine: Engine, reference: dict[str, torch.Tensor],
                                                 loops: int) -> None:
    ids = reference["input_ids"][0].tolist()
    diff = max_diff(engine, full_logits(engine, ids, loops), reference[f"logits_loops{loops}"][0])
    assert diff <= TOL, f"max |dlogit| {diff:.3g} at {loops} loops"


def test_padding_rows_match_the_reference_in_the_model(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    ids = reference["input_ids"]
    ctx = FullContext(engine.model.rope, 1, ids.shape[1])
    with torch.no_grad():
        logits = engine.model(ids, ctx, [RowSpec(loops=4, window=4)], last_only=False).logits
    assert (logits - reference["logits_loops4"]).abs().max().item() <= TOL


def test_cached_decode_matches_the_reference(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    logits = cached_decode_logits(engine, reference["input_ids"][0].tolist())
    diff = max_diff(engine, logits, reference["decode_last_logits_loops4"])
    assert diff <= TOL, f"max |dlogit| {diff:.3g}"


def test_greedy_continuation_matches_the_reference(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    expected = reference["greedy_loops4"].tolist()
    assert greedy_tokens(engine, reference["input_ids"][0].tolist(), len(expected)) == expected


def test_artifact_carries_tokenizer_specials_and_chat_template(engine: Engine) -> None:
    tok = engine.tokenizer
    assert (tok.bos_id, tok.eos_id, sorted(tok.eos_ids)) == (256, 257, [256, 257, 260])
    assert "{% generation %}" in engine.chat_template
    assert engine.config.state_init == "zeros" and engine.config.embed_scale == 8.0


def test_default_initial_state_is_the_seeded_truncated_normal(tmp_path: Path) -> None:
    config = convert(FIXTURE, tmp_path / "h.tinyloop").config
    assert config.state_init == "randn"
    assert config.state_init_std == pytest.approx(0.4 ** 0.5)


# -- refusals ----------------------------------------------------------------------------------


def _rewrite_shard(hf: Path, change: str) -> None:
    """Apply ``change`` to the second shard: drop, add or reshape one tensor (index kept in step)."""
    shard = hf / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    if change == "missing":
        del tensors["transformer.ln_f.weight"]
        del index["weight_map"]["transformer.ln_f.weight"]
    elif change == "unknown":
        tensors["transformer.extra.weight"] = torch.zeros(3)
        index["weight_map"]["transformer.extra.weight"] = shard.name
    else:
        tensors["transformer.prelude.0.mlp.fc.weight"] = torch.zeros(191, 64)
    save_file(tensors, str(shard))
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(("change", "message"), [
    ("missing", "missing tensor(s): transformer.ln_f.weight"),
    ("unknown", "does not know: transformer.extra.weight"),
    ("shape", "transformer.prelude.0.mlp.fc.weight has shape [191, 64], expected [192, 64]"),
])
def test_bad_tensors_are_refused_by_name(tmp_path: Path, change: str, message: str) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    _rewrite_shard(hf, change)
    with pytest.raises(ArtifactError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        convert(hf, tmp_path / "out.tinyloop")
    assert not (tmp_path / "out.tinyloop").exists()


def test_untied_head_is_refused(tmp_path: Path) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    shard = hf / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(shard))
    with pytest.raises(ArtifactError, match="lm_head.weight differs"):
        convert(hf, tmp_path / "out.tinyloop")


def test_unknown_model_type_is_refused(tmp_path: Path) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["model_type"], config["architectures"] = "mamba", ["MambaForCausalLM"]
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type 'mamba'.*not a family"):
        convert(hf, tmp_path / "out.tinyloop")


def test_streamed_artifact_has_exactly_the_canonical_tensors(tmp_path: Path) -> None:
    out = tmp_path / "h.tinyloop"
    convert(FIXTURE, out, dtype="bfloat16")
    with safe_open(str(out), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert "lm_head.weight" not in names and "freqs_cis" not in names
    assert {"embed.weight", "adapter.weight", "final_norm.weight", "core.1.attn.q_bias"} <= names


def test_cli_converts_and_reports_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "h.tinyloop"
    assert main(["convert", str(FIXTURE), str(out), "--family", "huginn", "--dtype", "float16"]) == 0
    assert "huginn, 43 tensors, float16" in capsys.readouterr().out
    assert main(["convert", str(tmp_path), str(tmp_path / "x.tinyloop")]) == 2
    assert "config.json: missing" in capsys.readouterr().err


def test_huginn_chat_template_renders_without_the_generation_tags(engine: Engine) -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "q"}]
    assert engine.tokenizer.render_chat(turns, template=engine.chat_template) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nhi<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\nyo<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\nq<|end_turn|><|begin_header|>Huginn<|end_header|>\n\n")


def test_a_tokenizer_that_is_not_byte_level_is_refused(tmp_path: Path) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    tok = json.loads((hf / "tokenizer.json").read_text())
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    tok["pre_tokenizer"], tok["decoder"] = metaspace, metaspace  # a sentencepiece-style pipeline
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TokenizerError, match="pre_tokenizer is Metaspace, not ByteLevel.*byte-level BPE"):
        convert(hf, tmp_path / "out.tinyloop")
    assert not (tmp_path / "out.tinyloop").exists()
