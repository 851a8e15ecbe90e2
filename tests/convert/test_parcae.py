"""``tinyloop convert`` on the tiny Parcae reference checkpoint (the package's own format: a
``ParcaeConfig`` config.json without ``model_type``, weights as safetensors and as a pickle):
parity with the reference's full-forward logits and greedy trace at 1, 4 and 8 loops (initial
state zeros, as the fixture's traces ran), cached decode, bf16, the pickle read only by the
restricted unpickler, and refusals by name."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.convert.checkpoints import (
    CHECKPOINTS,
    assert_refused,
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
from tinyloop.model.context import FullContext
from tinyloop.model.looped import RowSpec

FIXTURE = CHECKPOINTS / "parcae-tiny"
TOL = 1e-5  # the bound in fp32 (measured: at most 7.7e-6)
LOOPS = (1, 4, 8)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return converted_engine(FIXTURE, tmp_path_factory.mktemp("parcae"), state_init="zeros")


def _model_logits(engine: Engine, ids: list[int], loops: int, last_only: bool = False) -> torch.Tensor:
    """Every vocabulary row (the checkpoint's padding included), straight from the model."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        out = engine.model(tokens, FullContext(engine.model.rope, 1, len(ids)),
                           [RowSpec(loops=loops, window=loops)], last_only=last_only)
    return out.logits[0]


def test_a_parcae_config_is_detected_by_its_class_name() -> None:
    config = json.loads((FIXTURE / "config.json").read_text())
    assert "model_type" not in config and detect_family(config) == "parcae"


def test_the_layout_is_mapped_onto_the_config(engine: Engine) -> None:
    c = engine.config
    assert (c.n_prelude, c.n_core, c.n_coda, c.default_loops, c.vocab_size) == (2, 2, 2, 8, 320)
    assert (c.injection, c.loop_norm, c.loop_output, c.mlp, c.block_style) == (
        "diagonal", "none", "linear", "relu2", "pre_ln")
    assert c.qk_head_norm and c.prelude_norm and not c.qk_norm and c.value_embeds == (1, 3, 5)
    assert (c.rope_theta, c.rope_style, c.rope_tables, c.rope_compute, c.norm_order) == (
        50000.0, "interleaved", "float32", "float32", "cast_then_weight")
    assert engine.tokenizer.bos_id == 0 and engine.tokenizer.eos_id == 1


@pytest.mark.parametrize("loops", LOOPS)
def test_full_forward_logits_match_the_reference(engine: Engine, reference: dict[str, torch.Tensor],
                                                 loops: int) -> None:
    ids = reference["input_ids"][0].tolist()
    expected = reference[f"logits_loops{loops}"][0]
    assert max_diff(engine, full_logits(engine, ids, loops), expected) <= TOL  # the served rows
    got = _model_logits(engine, ids, loops)  # and the padding rows the engine masks
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("loops", LOOPS)
def test_the_reference_greedy_trace_is_reproduced_step_by_step(engine: Engine, loops: int) -> None:
    """Each step's top-5 ids and log-probabilities over the whole vocabulary (the reference does
    not mask the padding rows its random weights favour), a full forward per step."""
    trace = json.loads((FIXTURE / "trace.json").read_text())
    ids = list(trace["prompt_tokens"])
    for step in trace["traces"][str(loops)]:
        logprobs = torch.log_softmax(_model_logits(engine, ids, loops, last_only=True)[-1], -1)
        top = torch.topk(logprobs, 5)
        assert top.indices.tolist() == [i for i, _ in step["top"]]
        assert max(abs(logprobs[i].item() - lp) for i, lp in step["top"]) <= 1e-4
        ids.append(step["token"])


@pytest.mark.parametrize("loops", LOOPS)
@pytest.mark.parametrize("chunk", [512, 5])
def test_cached_decode_matches_the_full_forward(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                loops: int, chunk: int) -> None:
    """Prefill 12 tokens (in one chunk, or chunks of 5), decode the 13th from the KV cache."""
    out = tmp_path / "p.tinyloop"
    convert(FIXTURE, out, state_init="zeros")
    engine = Engine.load(out, dtype=torch.float32, kv_cache_mb=4, prefill_chunk=chunk)
    ids = reference["input_ids"][0].tolist()
    last = cached_decode_logits(engine, ids, loops)
    assert max_diff(engine, last, reference[f"logits_loops{loops}"][0, -1]) <= TOL


def test_greedy_serving_starts_with_the_references_best_token(engine: Engine,
                                                              reference: dict[str, torch.Tensor]) -> None:
    """The first greedy token is the reference's best over the tokenizer's ids; the loop count
    changes the continuation."""
    ids = reference["input_ids"][0].tolist()
    n = engine.tokenizer.vocab_size
    runs = {loops: greedy_tokens(engine, ids, 6, loops) for loops in (1, 8)}
    for loops, tokens in runs.items():
        assert tokens[0] == int(reference[f"logits_loops{loops}"][0, -1, :n].argmax())
    assert runs[1] != runs[8]


def test_bf16_logits_are_the_references_to_bf16_rounding(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "p16.tinyloop"
    assert convert(FIXTURE, out, dtype="bfloat16", state_init="zeros").dtype == "bfloat16"
    engine = Engine.load(out, dtype=torch.bfloat16, kv_cache_mb=4)
    ids = reference["input_ids"][0].tolist()
    for loops in LOOPS:
        expected = reference[f"logits_loops{loops}"][0, :, :engine.tokenizer.vocab_size]
        got = full_logits(engine, ids, loops)[:, :engine.tokenizer.vocab_size].float()
        # bf16 keeps 8 bits: a weight is off by up to 2^-9 of itself (measured: 1.2% of the largest logit)
        assert (got - expected).abs().max().item() <= 0.03 * expected.abs().max().item()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_default_initial_state_is_the_references_law(tmp_path: Path) -> None:
    """config.json's ``like-init``: a truncated normal of std sqrt(2 / (5 n_embd)), seeded per
    request here; ``state_init`` zeros (or ``--state-init zeros``) reproduces the fixtures."""
    config = convert(FIXTURE, tmp_path / "r.tinyloop").config
    assert config.state_init == "randn" and config.state_init_std == pytest.approx(math.sqrt(2 / (5 * 64)))
    hf = writable_copy(FIXTURE, tmp_path)
    _edit(hf, state_init="zero")
    assert convert(hf, tmp_path / "z.tinyloop").config.state_init == "zeros"


# -- the pickle ---------------------------------------------------------------------------------


def _pickle_only(tmp_path: Path) -> Path:
    hf = writable_copy(FIXTURE, tmp_path)
    (hf / "model.safetensors").unlink()
    return hf


def test_pickled_weights_load_through_the_restricted_unpickler(tmp_path: Path) -> None:
    """``pytorch_model.bin`` alone converts to the same tensors as ``model.safetensors``."""
    from_pickle, from_safetensors = tmp_path / "a.tinyloop", tmp_path / "b.tinyloop"
    assert convert(_pickle_only(tmp_path), from_pickle).family == "parcae"
    convert(FIXTURE, from_safetensors)
    with safe_open(str(from_pickle), "pt") as a, safe_open(str(from_safetensors), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


class _Payload:
    """Unpickled freely, this creates ``marker`` (a stand-in for any code a pickle may run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    hf = _pickle_only(tmp_path)
    marker = tmp_path / "ran"
    state = load_file(str(FIXTURE / "model.safetensors"))
    torch.save({**state, "transformer.wte.weight": _Payload(marker)}, hf / "pytorch_model.bin")
    assert_refused(hf, tmp_path, ConfigError, "refused: it does not load as plain tensors")
    assert not marker.exists()
    with pytest.raises(ConfigError, match="never unpickles a checkpoint freely"):
        convert(hf, tmp_path / "x.tinyloop")
    assert not marker.exists()
    torch.load(hf / "pytorch_model.bin", weights_only=False)  # the payload is live: a free unpickle runs it
    assert marker.exists()


def test_a_pickle_of_something_other_than_tensors_is_refused(tmp_path: Path) -> None:
    hf = _pickle_only(tmp_path)
    torch.save([1, 2, 3], hf / "pytorch_model.bin")
    assert_refused(hf, tmp_path, ConfigError, "not a mapping of tensor names to tensors")


# -- refusals -------------------------------------------------------------------------------------


def _edit(hf: Path, **changes: Any) -> Path:
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))
    return hf


def _rewrite_tensors(hf: Path, drop: tuple[str, ...] = (), **put: torch.Tensor) -> Path:
    state = load_file(str(hf / "model.safetensors"))
    for name in drop:
        del state[name]
    state.update(put)
    save_file(state, str(hf / "model.safetensors"))
    return hf


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_key_value_heads": 2}, "num_key_value_heads 2 != 4 heads"),
    ({"injection_type": "add"}, "injection_type 'add'"),
    ({"init_strategy": "takase"}, "init_strategy 'takase'"),
    ({"nonlin_name": "GELU"}, "nonlin_name is 'GELU'"),
    ({"recurrent_embedding_dimension": 128}, "recurrent_embedding_dimension 128 differs"),
    ({"state_init": "unit"}, "state_init 'unit'"),
    ({"n_layers_in_recurrent_block": 10**6}, "n_layers_in_recurrent_block is 1000000"),
])
def test_a_config_the_mapping_does_not_cover_is_refused_by_key(tmp_path: Path, changes: dict[str, Any],
                                                               message: str) -> None:
    assert_refused(_edit(writable_copy(FIXTURE, tmp_path), **changes), tmp_path, ConfigError, message)


def test_a_missing_tensor_is_refused_not_left_random(tmp_path: Path) -> None:
    """The reference's loader (``strict=False``) would keep a random C; here it is refused."""
    hf = _rewrite_tensors(writable_copy(FIXTURE, tmp_path), drop=("transformer.C.weight",))
    assert_refused(hf, tmp_path, ArtifactError, "missing tensor(s): transformer.C.weight")


def test_an_unknown_tensor_is_refused(tmp_path: Path) -> None:
    hf = _rewrite_tensors(writable_copy(FIXTURE, tmp_path), **{"transformer.extra.weight": torch.zeros(2)})
    assert_refused(hf, tmp_path, ArtifactError, "does not know: transformer.extra.weight")


def test_a_misshapen_tensor_is_refused(tmp_path: Path) -> None:
    bad = {"transformer.coda.1.attn.c_k.weight": torch.zeros(64, 32)}
    hf = _rewrite_tensors(writable_copy(FIXTURE, tmp_path), **bad)
    assert_refused(hf, tmp_path, ArtifactError, "transformer.coda.1.attn.c_k.weight has shape [64, 32]")


def test_a_rope_buffer_at_another_base_is_refused(tmp_path: Path) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    freqs = load_file(str(hf / "model.safetensors"))["freqs_cis"]
    hf = _rewrite_tensors(hf, freqs_cis=freqs.roll(1, dims=1))
    assert_refused(hf, tmp_path, ArtifactError, "freqs_cis is not RoPE at base 50000")


def test_an_untied_head_that_differs_is_refused_when_the_config_ties_it(tmp_path: Path) -> None:
    hf = writable_copy(FIXTURE, tmp_path)
    head = load_file(str(hf / "model.safetensors"))["lm_head.weight"]
    hf = _rewrite_tensors(hf, **{"lm_head.weight": head + 1})
    assert_refused(hf, tmp_path, ArtifactError, "lm_head.weight differs from transformer.wte.weight")


def test_h_mode_is_refused_for_its_attention(tmp_path: Path) -> None:
    """h-mode recomputes K,V as a projection of h: Parcae's value embeddings and per-head norm
    after RoPE are not, so the mode is refused by name rather than served wrong."""
    out = tmp_path / "p.tinyloop"
    convert(FIXTURE, out)
    with pytest.raises(RequestError, match="kv_cache_mode h-mode is not available for this model") as caught:
        Engine.load(out, kv_cache_mb=4, kv_mode="h-mode")
    assert caught.value.param == "kv_cache_mode"
    assert Engine.load(out, kv_cache_mb=4, kv_mode="int4").kv_mode.name == "int4"


def test_cli_converts_a_parcae_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.tinyloop"
    assert main(["convert", str(FIXTURE), str(out), "--family", "parcae", "--state-init", "zeros"]) == 0
    assert "parcae, 49 tensors, float32" in capsys.readouterr().out
    assert main(["convert", str(FIXTURE), str(out), "--family", "huginn"]) == 2
    assert "is a parcae checkpoint, not huginn" in capsys.readouterr().err


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_weight_only_modes_and_self_speculation_serve_it(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                         weights: str) -> None:
    """Weight-only int8/int4/bf16 products (a value gate too narrow for int4 stays float) and the
    self-speculative chain, whose output is plain greedy's."""
    from tinyloop.requests import GenerationRequest, SamplingParams

    out = tmp_path / "p.tinyloop"
    convert(FIXTURE, out, state_init="zeros")
    float_engine = Engine.load(out, dtype=torch.float32, kv_cache_mb=4)
    engine = Engine.load(out, dtype=torch.float32, kv_cache_mb=4, weights=weights)
    ids = reference["input_ids"][0].tolist()
    plain = greedy_tokens(engine, ids, 8, 8)
    top3 = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    first = float_engine.generate(GenerationRequest(prompt_tokens=tuple(ids), loops=8, max_tokens=1, sampling=top3))
    assert first.logprobs is not None
    # int4 on this tiny random model: float32's top two are 0.24 apart in logprob, int4's error is
    # larger, so its pick is held to float32's top three
    assert plain[0] in ([first.tokens[0]] if weights != "int4" else [t for t, _ in first.logprobs[0].top])
    request = GenerationRequest(prompt_tokens=tuple(ids), loops=8, max_tokens=8, mode="speculative",
                                sampling=SamplingParams(temperature=0.0, ignore_eos=True))
    assert list(engine.generate(request).tokens) == plain


@pytest.mark.parametrize("kind", ["latent_diff", "kl"])
def test_stop_rules_run_on_its_state_and_coda(engine: Engine, reference: dict[str, torch.Tensor], kind: str) -> None:
    """A stop rule reads the raw state (latent_diff) or runs the projection C, the coda and the
    head at each check (kl); with a threshold no step can miss, every decoded token stops at its
    first check (``min_loops``), and the tokens stay in the vocabulary."""
    from tinyloop.requests import GenerationRequest, SamplingParams
    from tinyloop.vocabulary import ExitRule

    ids = tuple(reference["input_ids"][0].tolist())
    rule = ExitRule.of(kind, threshold=1e9, min_loops=2)
    out = engine.generate(GenerationRequest(prompt_tokens=ids, loops=8, max_tokens=4, exit=rule,
                                            sampling=SamplingParams(temperature=0.0, ignore_eos=True)))
    assert len(out.tokens) == 4 and max(out.tokens) < engine.tokenizer.vocab_size
    assert out.mean_loops == pytest.approx((8 + 3 * 2) / 4)  # the prompt's last token runs all 8
