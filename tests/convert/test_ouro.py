"""``tinyloop convert`` on the tiny Ouro reference checkpoint: parity with the reference code's
"last step" outputs (vLLM's semantics: every loop runs, the last one feeds the head; the shared
fixtures' README lists them), the exit gate loaded, and refusals by tensor name."""

from __future__ import annotations

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
from tinyloop.convert import convert, detect_family
from tinyloop.engine.engine import Engine
from tinyloop.errors import ArtifactError, ConfigError, RequestError
from tinyloop.limits import ModelLimits
from tinyloop.model.context import FullContext
from tinyloop.model.looped import RowSpec
from tinyloop.requests import GenerationRequest
from tinyloop.vocabulary import ExitRule

FIXTURE = CHECKPOINTS / "ouro-tiny"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return converted_engine(FIXTURE, tmp_path_factory.mktemp("ouro"))


@pytest.mark.parametrize("loops", [1, 2, 4, 6])
def test_full_forward_logits_match_the_reference_last_step(engine: Engine, reference: dict[str, torch.Tensor],
                                                           loops: int) -> None:
    ids = reference["input_ids"][0].tolist()
    diff = max_diff(engine, full_logits(engine, ids, loops), reference[f"logits_last_step_loops{loops}"][0])
    assert diff <= TOL, f"max |dlogit| {diff:.3g} at {loops} loops"


def _model_states(engine: Engine, ids: torch.Tensor, loops: int,
                  exit_rule: ExitRule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = FullContext(engine.model.rope, 1, ids.shape[1])
    with torch.no_grad():
        out = engine.model(ids, ctx, [RowSpec(loops=loops, window=loops, exit=exit_rule)], last_only=False)
    return out.logits, out.state


def test_padding_rows_match_the_reference_in_the_model(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    logits, _ = _model_states(engine, reference["input_ids"], 4)
    assert (logits - reference["logits_last_step_loops4"]).abs().max().item() <= TOL


def test_exit_gate_is_loaded_and_matches_the_reference_lambdas(engine: Engine,
                                                               reference: dict[str, torch.Tensor]) -> None:
    """After loop t the normed state feeds the gate: sigmoid(gate) equals the reference's lambda_t."""
    assert engine.config.exit.kind == "none" and engine.config.has_exit_gate
    assert ModelLimits.from_engine(engine).has_gate
    lambdas = []
    for t in range(1, 5):
        _, state = _model_states(engine, reference["input_ids"], t)
        with torch.no_grad():
            lambdas.append(torch.sigmoid(engine.model.exit_gate(state)).squeeze(-1))
    got = torch.stack(lambdas, dim=-1)  # [1, T, 4]
    assert (got - reference["gate_lambdas_loops4"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_gate_select_matches_the_reference_exit_selection(engine: Engine, reference: dict[str, torch.Tensor],
                                                          threshold: float) -> None:
    """HF's semantics: every loop runs; per position the gate's CDF picks the loop that feeds the head."""
    expected = reference[f"logits_threshold{threshold}_loops4"]
    logits, _ = _model_states(engine, reference["input_ids"], 4, ExitRule("gate_select", threshold))
    assert (logits - expected).abs().max().item() <= TOL
    ids = reference["input_ids"][0].tolist()
    seq = engine.start(GenerationRequest(prompt_tokens=tuple(ids), loops=4, max_tokens=1,
                                         exit=ExitRule("gate_select", threshold)))
    try:
        last = engine.prefill(seq)
    finally:
        engine.free(seq)
    assert seq.last_loops == 4  # nothing stopped early
    assert max_diff(engine, last, expected[0, -1]) <= TOL


@pytest.mark.parametrize("loops", [2, 4])
def test_gate_expected_matches_the_reference_weighted_exit(engine: Engine, reference: dict[str, torch.Tensor],
                                                           loops: int) -> None:
    """``use_weighted_exit``: the head's logits averaged over the loops by the exit distribution
    (``reference_weighted.safetensors``: the reference's forward with ``use_weighted_exit=True``)."""
    expected = load_file(str(FIXTURE / "reference_weighted.safetensors"))[f"logits_weighted_loops{loops}"]
    ids = reference["input_ids"][0].tolist()
    rule = ExitRule.of("gate_expected")
    logits, _ = _model_states(engine, reference["input_ids"], loops, rule)
    assert (logits - expected).abs().max().item() <= TOL
    served = full_logits(engine, ids, loops, exit=rule)  # the engine's verify path, the request's rule
    assert max_diff(engine, served, expected[0]) <= TOL
    if loops == 4:  # not the last step's logits: the comparison above is not vacuous
        assert (expected - reference["logits_last_step_loops4"]).abs().max().item() > 0.1


def test_gate_expected_is_refused_on_a_model_with_a_coda() -> None:
    """Each loop's logits would run the coda, whose KV keeps only the last call's: a prefix-cache
    hit would then differ from a cold prefill. Ouro has no coda; models with one use gate_select."""
    limits = ModelLimits(max_seq_len=64, vocab_size=100, default_loops=4, max_loops=8, gate=True, coda=True)
    req = GenerationRequest(prompt_tokens=(1, 2), max_tokens=1, exit=ExitRule.of("gate_expected"))
    with pytest.raises(RequestError, match="without coda layers") as caught:
        limits.check(req)
    assert caught.value.param == "exit"
    assert limits.check(GenerationRequest(prompt_tokens=(1, 2), max_tokens=1,
                                          exit=ExitRule.of("gate_select"))).exit.kind == "gate_select"


def test_gate_select_at_half_picks_earlier_loops_than_the_last(reference: dict[str, torch.Tensor]) -> None:
    """The fixture's gate makes 0.5 select loop 2 at some positions: the test above is not vacuous."""
    last = reference["logits_last_step_loops4"]
    assert (reference["logits_threshold0.5_loops4"] - last).abs().amax(-1).min().item() > 0.1


def test_cached_decode_matches_the_reference(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    logits = cached_decode_logits(engine, reference["input_ids"][0].tolist())
    diff = max_diff(engine, logits, reference["decode_last_logits_loops4"])
    assert diff <= TOL, f"max |dlogit| {diff:.3g}"


@pytest.mark.parametrize("exit_rule", [None, ExitRule("none")])
def test_greedy_continuation_matches_the_reference(engine: Engine, reference: dict[str, torch.Tensor],
                                                   exit_rule: ExitRule | None) -> None:
    expected = reference["greedy_last_step_loops4"].tolist()
    assert greedy_tokens(engine, reference["input_ids"][0].tolist(), len(expected), exit=exit_rule) == expected


def test_artifact_carries_chatml_and_both_stop_tokens(engine: Engine) -> None:
    tok = engine.tokenizer
    assert (tok.bos_id, tok.eos_id, sorted(tok.eos_ids)) == (0, 0, [0, 2])
    turns = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(turns, template=engine.chat_template) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    c = engine.config
    assert (c.block_style, c.loop_norm, c.injection, c.state_init, c.tie_embeddings) == (
        "peri_ln", "every_loop", "none", "embed", False)
    assert (c.default_loops, c.kv_heads, c.heads, c.rope_theta, c.max_position) == (4, 2, 4, 1e6, 128)


def test_streamed_artifact_has_exactly_the_canonical_tensors(tmp_path: Path) -> None:
    out = tmp_path / "o.tinyloop"
    result = convert(FIXTURE, out, dtype="bfloat16")
    assert result.family == "ouro" and result.tensors == 35
    with safe_open(str(out), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
        fc = f.get_tensor("core.1.mlp.fc.weight")
    src = load_file(str(FIXTURE / "model.safetensors"))
    assert torch.equal(fc, torch.cat([src["model.layers.1.mlp.gate_proj.weight"],
                                      src["model.layers.1.mlp.up_proj.weight"]]).bfloat16())
    assert {"embed.weight", "lm_head.weight", "exit_gate.weight", "exit_gate.bias", "core.2.attn.k.weight",
            "core.0.attn_post_norm.weight", "final_norm.weight"} <= names


def test_family_is_detected_from_model_type_or_architectures() -> None:
    assert detect_family({"model_type": "ouro"}) == "ouro"
    assert detect_family({"architectures": ["OuroForCausalLM"]}) == "ouro"


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    ("missing", r"missing tensor\(s\): model.early_exit_gate.bias"),
    ("unknown", "does not know: model.extra.weight"),
    ("shape", r"model.layers.2.mlp.up_proj.weight has shape \[95, 64\], expected \[96, 64\]"),
])
def test_bad_tensors_are_refused_by_name(tmp_path: Path, change: str, message: str) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    path = hf / "model.safetensors"
    tensors = load_file(str(path))
    if change == "missing":
        del tensors["model.early_exit_gate.bias"]
    elif change == "unknown":
        tensors["model.extra.weight"] = torch.zeros(3)
    else:
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, str(path))
    with pytest.raises(ArtifactError, match=message):
        convert(hf, tmp_path / "out.tinyloop")
    assert not (tmp_path / "out.tinyloop").exists()


def test_a_different_layout_is_refused(tmp_path: Path) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    text = (hf / "config.json").read_text().replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    (hf / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="tie_word_embeddings is True"):
        convert(hf, tmp_path / "out.tinyloop")
    with pytest.raises(ConfigError, match="is a ouro checkpoint, not huginn"):
        convert(FIXTURE, tmp_path / "out.tinyloop", family="huginn")


def test_cli_converts_with_family_ouro(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.tinyloop"
    assert main(["convert", str(FIXTURE), str(out), "--family", "ouro"]) == 0
    assert "ouro, 35 tensors, float32" in capsys.readouterr().out


def test_gate_select_needs_a_gate_and_a_threshold_up_to_one() -> None:
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        ExitRule("gate_select", 1.5)
    req = GenerationRequest(prompt_tokens=(1, 2), max_tokens=1, exit=ExitRule("gate_select", 0.5))
    with pytest.raises(RequestError, match="no exit gate"):
        ModelLimits(max_seq_len=16, vocab_size=8, default_loops=2, max_loops=4).check(req)
    assert ModelLimits(max_seq_len=16, vocab_size=8, default_loops=2, max_loops=4, gate=True).check(req).loops == 2
