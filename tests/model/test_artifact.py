"""The .tinyloop artifact: bit-exact round trips, and a named ArtifactError for every bad file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model.artifacts import rewrite_artifact as _rewrite
from tinyloop.errors import ArtifactError
from tinyloop.model.artifact import FORMAT_VERSION, inspect_artifact, load_artifact, save_artifact
from tinyloop.model.config import ModelConfig
from tinyloop.model.context import FullContext
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.model.presets import PRESETS, init_model, param_count
from tinyloop.tokenizer import default_tokenizer

TINY = PRESETS["tiny"]
CONFIGS = {
    "tied": TINY,
    "untied": TINY.replace(tie_embeddings=False),
    "gate": PRESETS["tiny-ouro"],
    "unfused-qk-bias": TINY.replace(fused_qkv=False, qk_bias=True, rope_style="interleaved",
                                    block_style="pre_ln"),
}


def _logits(model: LoopedLM, tokens: torch.Tensor, loops: int = 2) -> torch.Tensor:
    ctx = FullContext(model.rope, 1, tokens.shape[0])
    with torch.no_grad():
        return model(tokens[None], ctx, [RowSpec(loops=loops, window=loops)], last_only=False).logits


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_bit_exact(tmp_path: Path, name: str) -> None:
    config = CONFIGS[name]
    model = init_model(config, seed=3)
    path = tmp_path / "m.tinyloop"
    save_artifact(path, model, default_tokenizer(), extra_metadata={"origin": "test"})
    art = load_artifact(path)
    assert art.config == config
    assert art.path == path
    saved, loaded = model.state_dict(), art.model.state_dict()
    assert saved.keys() == loaded.keys()
    for key, tensor in saved.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    assert ("lm_head.weight" in loaded) == (not config.tie_embeddings)
    assert ("exit_gate.bias" in loaded) == (config.exit.kind == "gate")
    assert not art.model.training
    assert not any(p.requires_grad or p.is_meta for p in art.model.parameters())
    assert art.model.rope.cos.shape == (config.max_position, config.head_dim)
    assert art.metadata["origin"] == "test"
    assert art.metadata["tinyloop.format_version"] == str(FORMAT_VERSION)


def test_loaded_model_computes_the_same_logits(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    tokens = torch.arange(5, 17)
    assert torch.equal(_logits(art.model, tokens), _logits(init_model(TINY, seed=0), tokens))


def test_tokenizer_template_and_special_tokens_round_trip(tmp_path: Path) -> None:
    tok = default_tokenizer()
    path = tmp_path / "m.tinyloop"
    save_artifact(path, init_model(TINY, 0), tok, chat_template="{{ messages[0]['content'] }}")
    art = load_artifact(path)
    assert art.tokenizer.to_json() == tok.to_json()
    assert art.chat_template == art.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert art.special_tokens == {"bos_id": tok.bos_id, "eos_id": tok.eos_id,
                                  "eos_ids": sorted(tok.eos_ids), "pad_id": None}
    assert tok.chat_template != art.chat_template  # the shared default tokenizer is untouched


def test_empty_chat_template_falls_back_to_the_tokenizers(tmp_path: Path) -> None:
    path = tmp_path / "m.tinyloop"
    save_artifact(path, init_model(TINY, 0), default_tokenizer(), chat_template="")
    art = load_artifact(path)
    assert art.chat_template == default_tokenizer().chat_template


def test_bfloat16_weights_load_as_stored_or_converted(tmp_path: Path) -> None:
    model = init_model(TINY, 0).to(torch.bfloat16)
    path = tmp_path / "m.tinyloop"
    save_artifact(path, model, default_tokenizer())
    assert load_artifact(path).model.embed.weight.dtype == torch.bfloat16
    as_f32 = load_artifact(path, dtype=torch.float32)
    assert torch.equal(as_f32.model.embed.weight, model.embed.weight.float())


def test_save_is_atomic_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "m.tinyloop"
    save_artifact(path, init_model(TINY, 0), default_tokenizer())
    save_artifact(path, init_model(TINY, 1), default_tokenizer())  # replaces in place
    assert os.listdir(tmp_path) == ["m.tinyloop"]
    assert torch.equal(load_artifact(path).model.embed.weight, init_model(TINY, 1).embed.weight)


def test_save_refuses_to_override_owned_metadata(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="tinyloop.config"):
        save_artifact(tmp_path / "m.tinyloop", init_model(TINY, 0), default_tokenizer(),
                      extra_metadata={"tinyloop.config": "{}"})


def test_save_into_a_missing_directory_is_an_artifact_error(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="cannot write"):
        save_artifact(tmp_path / "no" / "m.tinyloop", init_model(TINY, 0), default_tokenizer())


def test_max_seq_len_extends_the_config_and_rope(tmp_path: Path) -> None:
    config = TINY.replace(max_position=16)
    path = tmp_path / "m.tinyloop"
    save_artifact(path, init_model(config, 0), default_tokenizer())
    art = load_artifact(path, max_seq_len=40)
    assert art.config == config.replace(max_position=40)
    assert art.model.rope.cos.shape[0] == 40
    logits = _logits(art.model, torch.arange(40), loops=1)  # positions past the stored 16
    assert logits.shape == (1, 40, config.vocab_size) and torch.isfinite(logits).all()
    # the first 16 positions are unchanged by the longer table
    short = _logits(load_artifact(path).model, torch.arange(16), loops=1)
    assert torch.allclose(logits[:, :16], short, atol=1e-5)
    assert load_artifact(path, max_seq_len=8).config.max_position == 16  # never shrinks


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_reads_the_header(tiny_artifact: Path) -> None:
    info = inspect_artifact(tiny_artifact)
    assert ModelConfig.from_dict(info["config"]) == TINY
    assert info["parameters"] == param_count(TINY) == sum(
        t.numel() for t in init_model(TINY, 0).state_dict().values())
    assert info["file_size"] == tiny_artifact.stat().st_size
    assert info["dtypes"] == ["float32"] and info["dtype"] == "float32"
    assert info["tokenizer_vocab_size"] == 4096
    assert info["special_tokens"]["eos_id"] == 0
    json.dumps(info)  # serialisable as is


# -- bad artifacts ---------------------------------------------------------------------------


def _config_json(**changes: Any) -> str:
    return TINY.replace(**changes).to_json()


BAD_CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "missing metadata key": ({"metadata": {"tinyloop.tokenizer": None}},
                             ["metadata is missing", "'tinyloop.tokenizer'"]),
    "wrong format version": ({"metadata": {"tinyloop.format_version": "2"}},
                             ["format version '2'", "reads version 1"]),
    "config not JSON": ({"metadata": {"tinyloop.config": "{nope"}},
                        ["invalid tinyloop.config", "not valid JSON"]),
    "config invalid": ({"metadata": {"tinyloop.config": json.dumps({**TINY.to_dict(), "heads": 3})}},
                       ["invalid tinyloop.config", "kv_heads"]),
    "config unknown field": ({"metadata": {"tinyloop.config": json.dumps({**TINY.to_dict(), "wat": 1})}},
                             ["unknown config field", "wat"]),
    "missing tensor": ({"tensors": {"core.1.mlp.fc.weight": None}},
                       ["missing tensor", "core.1.mlp.fc.weight"]),
    "unexpected tensor": ({"tensors": {"lm_head.weight": torch.zeros(4096, 64)}},
                          ["unexpected tensor", "lm_head.weight"]),
    "wrong shape": ({"tensors": {"prelude.0.attn.o.weight": torch.zeros(64, 32)}},
                    ["prelude.0.attn.o.weight", "shape [64, 32]", "expected [64, 64]"]),
    "tokenizer invalid": ({"metadata": {"tinyloop.tokenizer": '{"model": 5}'}},
                          ["invalid tinyloop.tokenizer"]),
    "tokenizer larger than vocab": ({"metadata": {"tinyloop.config": _config_json(vocab_size=1000)},
                                     "tensors": {"embed.weight": torch.zeros(1000, 64)}},
                                    ["tokenizer has 4096 tokens", "vocab_size 1000"]),
    "special tokens invalid": ({"metadata": {"tinyloop.special_tokens": "[]"}},
                               ["invalid tinyloop.special_tokens"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_artifact_is_named(tiny_artifact: Path, tmp_path: Path, case: str) -> None:
    changes, fragments = BAD_CASES[case]
    path = _rewrite(tiny_artifact, tmp_path / "bad.tinyloop", **changes)
    for reader in (load_artifact, inspect_artifact):
        with pytest.raises(ArtifactError) as info:
            reader(path)
        message = str(info.value)
        assert str(path) in message
        for fragment in fragments:
            assert fragment in message, (case, message)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.tinyloop"
    with pytest.raises(ArtifactError, match="no such artifact file") as info:
        load_artifact(path)
    assert str(path) in str(info.value)


def test_directory_is_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="is a directory"):
        load_artifact(tmp_path)


def test_truncated_file(tiny_artifact: Path, tmp_path: Path) -> None:
    data = tiny_artifact.read_bytes()
    path = tmp_path / "half.tinyloop"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="truncated") as info:
        load_artifact(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", [b"", b"hello", b"\x10\x00\x00\x00\x00\x00\x00\x00not json here!!!",
                                     b"\xff" * 64])
def test_not_a_safetensors_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.tinyloop"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match="not a safetensors file"):
        load_artifact(path)


def test_cut_inside_the_header(tiny_artifact: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.tinyloop"
    path.write_bytes(tiny_artifact.read_bytes()[:100])
    with pytest.raises(ArtifactError, match="truncated"):
        inspect_artifact(path)
