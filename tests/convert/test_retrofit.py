"""``tinyloop convert`` on the tiny retrofitted-recurrence reference checkpoints (a Llama-3.2-style
one with llama3 RoPE scaling and GQA, an OLMo-2-style one with post-norm blocks and QK-norm):
logits parity with the reference code's outputs (each fixture's README), and a clear refusal for
every checkpoint the converter cannot convert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.convert import checkpoints as ck
from tinyloop.cli import main
from tinyloop.convert import convert, detect_family
from tinyloop.engine.engine import Engine
from tinyloop.errors import ArtifactError, ConfigError

LLAMA = ck.CHECKPOINTS / "retrofit-llama-tiny"
OLMO = ck.CHECKPOINTS / "retrofit-olmo-tiny"
FIXTURES = [LLAMA, OLMO]


@pytest.fixture(scope="module", params=FIXTURES, ids=lambda f: f.name)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Engine, dict[str, torch.Tensor]]:
    fixture: Path = request.param
    reference = load_file(str(fixture / "reference_outputs.safetensors"))
    # the reference ran with init_scale=0
    return ck.converted_engine(fixture, tmp_path_factory.mktemp(fixture.name), state_init="zeros"), reference


@pytest.mark.parametrize("loops", [1, 4, 8])
def test_full_forward_logits_match_the_reference(case: tuple[Engine, dict[str, torch.Tensor]], loops: int) -> None:
    engine, reference = case
    ids = reference["input_ids"][0].tolist()
    diff = ck.max_diff(engine, ck.full_logits(engine, ids, loops), reference[f"logits_loops{loops}"][0])
    assert diff <= ck.TOL, f"max |dlogit| {diff:.3g} at {loops} loops"


def test_cached_decode_matches_the_reference(case: tuple[Engine, dict[str, torch.Tensor]]) -> None:
    engine, reference = case
    logits = ck.cached_decode_logits(engine, reference["input_ids"][0].tolist())
    diff = ck.max_diff(engine, logits, reference["decode_last_logits_loops4"])
    assert diff <= ck.TOL, f"max |dlogit| {diff:.3g}"


def test_greedy_continuation_matches_the_reference(case: tuple[Engine, dict[str, torch.Tensor]]) -> None:
    engine, reference = case
    expected = reference["greedy_loops4"].tolist()
    assert ck.greedy_tokens(engine, reference["input_ids"][0].tolist(), len(expected)) == expected


def test_the_layout_follows_the_base_model(tmp_path: Path) -> None:
    llama = convert(LLAMA, tmp_path / "l.tinyloop")
    olmo = convert(OLMO, tmp_path / "o.tinyloop")
    assert (llama.family, olmo.family) == ("retrofit", "retrofit")
    lc, oc = llama.config, olmo.config
    assert (lc.block_style, lc.qk_norm, lc.rope_scaling, lc.rope_compute) == ("pre_ln", False, "llama3", "input")
    assert (lc.rope_scaling_factor, lc.rope_low_freq_factor, lc.rope_high_freq_factor,
            lc.rope_original_max_position) == (8.0, 1.0, 4.0, 64)
    assert (oc.block_style, oc.qk_norm, oc.rope_scaling, oc.rope_compute) == ("post_ln", True, "none", "float32")
    for c in (lc, oc):
        assert (c.loop_norm, c.injection, c.tie_embeddings, c.embed_scale, c.kv_heads) == (
            "none", "concat_linear", False, 1.0, 2)
        assert c.state_init == "randn" and c.state_init_std == pytest.approx((2 / (5 * 5280)) ** 0.5)
        assert (c.rope_theta, c.max_position, c.default_loops) == (500000.0, 256, 4)


def test_artifacts_carry_the_tokenizer_specials_and_chat_template(case: tuple[Engine, dict[str, torch.Tensor]]
                                                                  ) -> None:
    engine, _ = case
    tok = engine.tokenizer
    if engine.config.qk_norm:  # OLMo-2: <|endoftext|> is bos, eos and the only stop
        assert (tok.bos_id, tok.eos_id, sorted(tok.eos_ids)) == (256, 256, [256])
        return
    assert (tok.bos_id, tok.eos_id, sorted(tok.eos_ids)) == (256, 260, [256, 257, 260])
    turns = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(turns, template=engine.chat_template) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_huginn_and_retrofit_are_told_apart() -> None:
    huginn = json.loads((ck.CHECKPOINTS / "huginn-tiny" / "config.json").read_text())
    retro = json.loads((LLAMA / "config.json").read_text())
    assert huginn["model_type"] == retro["model_type"] == "huginn_raven"
    assert (detect_family(huginn), detect_family(retro)) == ("huginn", "retrofit")


def test_the_wrong_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a retrofit checkpoint, not huginn"):
        convert(LLAMA, tmp_path / "out.tinyloop", family="huginn")
    with pytest.raises(ConfigError, match="is a huginn checkpoint, not retrofit"):
        convert(ck.CHECKPOINTS / "huginn-tiny", tmp_path / "out.tinyloop", family="retrofit")


def test_cli_converts_with_family_retrofit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(OLMO), str(tmp_path / "o.tinyloop"), "--family", "retrofit"]) == 0
    assert "retrofit, 36 tensors, float32" in capsys.readouterr().out


# -- refusals ----------------------------------------------------------------------------------


def _rewrite(hf: Path, change: str) -> None:
    """Drop, add or reshape one tensor of the single ``model.safetensors``."""
    path = hf / "model.safetensors"
    tensors = load_file(str(path))
    if change == "missing":
        del tensors["transformer.core_block.1.attn.k_norm.weight"]
    elif change == "unknown":
        tensors["transformer.core_block.0.norm_3.weight"] = torch.ones(64)
    else:
        tensors["transformer.coda.0.attn.q_norm.weight"] = torch.ones(48)
    save_file(tensors, str(path))


@pytest.mark.parametrize(("change", "message"), [
    ("missing", "missing tensor(s): transformer.core_block.1.attn.k_norm.weight"),
    ("unknown", "does not know: transformer.core_block.0.norm_3.weight"),
    ("shape", "transformer.coda.0.attn.q_norm.weight has shape [48], expected [64]"),
])
def test_bad_tensors_are_refused_by_name(tmp_path: Path, change: str, message: str) -> None:
    hf = ck.writable_copy(OLMO, tmp_path)
    _rewrite(hf, change)
    ck.assert_refused(hf, tmp_path, ArtifactError, message)


def _edit_config(hf: Path, **changes: object) -> None:
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling .*supports only rope_type 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling needs factor, low_freq_factor"),
    ({"qk_bias": True}, "qk_bias is True; the retrofit converter supports only False"),
    ({"head_dim": 8}, "head_dim 8 x 4 heads != n_embd 64"),
])
def test_unsupported_configs_are_refused(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    hf = ck.writable_copy(LLAMA, tmp_path)
    _edit_config(hf, **changes)
    with pytest.raises(ConfigError, match=message):
        convert(hf, tmp_path / "out.tinyloop")


def test_a_tied_head_must_equal_the_embeddings(tmp_path: Path) -> None:
    hf = ck.writable_copy(LLAMA, tmp_path)
    _edit_config(hf, tie_embeddings=True)
    with pytest.raises(ArtifactError, match="lm_head.weight differs from transformer.wte.weight"):
        convert(hf, tmp_path / "out.tinyloop")
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, str(hf / "model.safetensors"))
    result = convert(hf, tmp_path / "out.tinyloop")
    assert result.config.tie_embeddings
    with safe_open(str(result.path), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
