"""An artifact's header is untrusted input: its config is bounded and checked field by field,
its tensors are checked against the config by arithmetic (``state_shapes``) before anything is
built, and reading the header (``inspect``, ``read_config``) allocates nothing the config sizes.

Headers are written by hand (struct + json), so a crafted file is a few hundred kilobytes; the
cases whose regression would take gigabytes run in one child process under an address-space cap
and a timeout."""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tinyloop.errors import ArtifactError, ConfigError
from tinyloop.model.artifact import inspect_artifact, load_artifact, read_config
from tinyloop.model.config import SIZE_LIMITS, ModelConfig
from tinyloop.model.looped import LoopedLM
from tinyloop.model.presets import PRESETS, empty_model, param_count, state_shapes
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import ExitRule

TINY = PRESETS["tiny"]
MEMORY_CAP = 1536 << 20
CHILD_TIMEOUT_S = 60


def _craft(path: Path, config: dict[str, Any], tensors: dict[str, list[int]]) -> Path:
    """A safetensors file whose header holds ``config`` and F32 ``tensors`` (name -> shape), with
    zero bytes of data each: an artifact as small as its header."""
    entries: dict[str, Any] = {"__metadata__": {
        "tinyloop.format_version": "1", "tinyloop.config": json.dumps(config),
        "tinyloop.tokenizer": default_tokenizer().to_json(), "tinyloop.chat_template": "",
        "tinyloop.special_tokens": json.dumps({"bos_id": 1, "eos_id": 2, "eos_ids": [2], "pad_id": None})}}
    offset = 0
    for name, shape in tensors.items():
        size = 4 * math.prod(shape)
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(offset))
    return path


# -- run where a regression would take gigabytes ----------------------------------------------

_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from tinyloop.errors import TinyLoopError
from tinyloop.model.artifact import inspect_artifact, load_artifact, read_config
for name, path in json.loads(sys.argv[1]):
    for reader in (read_config, inspect_artifact, load_artifact):
        try:
            reader(path)
            result = "read"
        except TinyLoopError as exc:
            result = type(exc).__name__ + ": " + str(exc)
        except MemoryError:
            result = "MemoryError"
        print(json.dumps([name, reader.__name__, result]), flush=True)
"""

_AT_THE_LIMITS = {"vocab_size": SIZE_LIMITS["vocab_size"][1], "hidden": SIZE_LIMITS["hidden"][1],
                  "n_core": SIZE_LIMITS["n_core"][1], "max_position": SIZE_LIMITS["max_position"][1],
                  "head_dim": 256, "heads": 4, "kv_heads": 4}
_HUGE = {  # case -> config changes, what the refusal names (None: the config is valid)
    "n_core 1e6": ({"n_core": 1_000_000}, "n_core must be a positive integer up to 1024, got 1000000"),
    "max_position 3e8": ({"max_position": 300_000_000}, "max_position must be a positive integer up to"),
    "head_dim 1e7": ({"head_dim": 10_000_000}, "head_dim must be a positive integer up to 1024"),
    "at the limits": (_AT_THE_LIMITS, None),  # 4 GiB of RoPE tables, 4e11 parameters, had it been built
}


def test_hostile_headers_are_refused_without_allocating(tmp_path: Path) -> None:
    cases = [(case, str(_craft(tmp_path / f"{i}.tinyloop", TINY.to_dict() | changes, {"embed.weight": [8, 64]})))
             for i, (case, (changes, _)) in enumerate(_HUGE.items())]
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD.format(cap=MEMORY_CAP), json.dumps(cases)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {CHILD_TIMEOUT_S} s: {[c[0] for c in cases]}")
    assert done.returncode == 0, done.stderr[-3000:]
    results = {(case, reader): result for case, reader, result in map(json.loads, done.stdout.splitlines())}
    for case, (_, named) in _HUGE.items():
        for reader in ("read_config", "inspect_artifact", "load_artifact"):
            result = results[case, reader]
            if named is None and reader == "read_config":
                assert result == "read"
            elif named is None:  # a valid config the file does not hold: refused by the tensors it lacks
                assert result.startswith("ArtifactError: ") and "missing tensor(s): prelude.0" in result, result
                assert re.search(r", \.\.\. \(\d+ in all\)$", result) and len(result) < 1500, result
            else:
                assert result.startswith("ArtifactError: ") and named in result, (case, reader, result)


# -- the config: every size bounded, every float finite, each refusal naming its field ------------

@pytest.mark.parametrize(("changes", "message"), [
    ({"default_loops": 10**9, "max_loops": 10**9}, "default_loops must be a positive integer up to 1024"),
    ({"max_loops": 2000}, "max_loops must be a positive integer up to 1024"),
    ({"vocab_size": 1 << 23}, "vocab_size must be a positive integer up to"),
    ({"intermediate": 1 << 20}, "intermediate must be a positive integer up to"),
    ({"n_coda": 5000}, "n_coda must be a non-negative integer up to 1024"),
    ({"max_position": 1 << 21, "head_dim": 1024}, "max_position 2097152 x head_dim 1024 exceeds"),
    ({"rope_theta": math.inf}, "rope_theta must be a finite number > 0, got inf"),
    ({"rope_theta": math.nan}, "rope_theta must be a finite number > 0, got nan"),
    ({"embed_scale": math.nan}, "embed_scale must be a finite number > 0, got nan"),
    ({"norm_eps": math.inf}, "norm_eps must be a finite number > 0"),
    ({"state_init_std": -1.0}, "state_init_std must be a finite number > 0"),
    ({"rope_scaling_factor": math.inf}, "rope_scaling_factor must be a finite number > 0"),
    ({"tie_embeddings": "yes"}, "tie_embeddings must be true or false"),
    ({"exit": ExitRule("kl", math.inf)}, "exit.threshold must be a finite number"),
])
def test_config_fields_are_bounded_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TINY.replace(**changes)


def test_a_config_from_json_with_a_wrong_exit_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="exit"):
        ModelConfig.from_dict(TINY.to_dict() | {"exit": {"kind": "kl", "threshold": 0.1, "min_loops": "2"}})


def test_default_loops_past_the_limit_is_refused_when_the_header_is_read(tmp_path: Path) -> None:
    path = _craft(tmp_path / "loops.tinyloop", TINY.to_dict() | {"default_loops": 10**9, "max_loops": 10**9}, {})
    with pytest.raises(ArtifactError, match="invalid tinyloop.config: default_loops must be a positive integer"):
        read_config(path)


# -- the tensors: checked by arithmetic, before anything is built --------------------------------

SHAPE_CONFIGS = {
    "tiny": TINY, "tiny-ouro": PRESETS["tiny-ouro"],
    "unfused-qk-bias-untied": TINY.replace(fused_qkv=False, qk_bias=True, tie_embeddings=False),
    "post-ln-qk-norm": TINY.replace(block_style="post_ln", qk_norm=True, n_prelude=0, n_coda=2),
    "pre-ln-no-injection": TINY.replace(block_style="pre_ln", injection="none", state_init="embed", exit_gate=True),
    "peri-ln-gqa": TINY.replace(block_style="peri_ln", heads=8, kv_heads=2, qk_bias=True),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CONFIGS))
def test_state_shapes_are_the_models_state_dict(name: str) -> None:
    config = SHAPE_CONFIGS[name]
    model = empty_model(config)
    assert list(state_shapes(config).items()) == [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert param_count(config) == sum(p.numel() for p in model.parameters())


def test_a_model_builds_its_rope_tables_on_first_use_and_a_loaded_one_at_load(tiny_artifact: Path) -> None:
    model = LoopedLM(TINY)
    assert not model.rope.built
    assert model.rope.cos.shape == (TINY.max_position, TINY.head_dim) and model.rope.built
    assert not empty_model(TINY).rope.built
    assert load_artifact(tiny_artifact).model.rope.built


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_refused_by_inspect(tiny_artifact: Path, tmp_path: Path) -> None:
    data = tiny_artifact.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    start, end = header["final_norm.weight"]["data_offsets"]
    header["final_norm.weight"]["data_offsets"] = [start, start + 4]  # claims 64 floats, holds one
    raw = json.dumps(header).encode()
    path = tmp_path / "short.tinyloop"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(ArtifactError, match=r"tensor final_norm.weight takes bytes \d+\.\.\d+ of the data, not the "
                                            r"256 its shape and dtype need"):
        inspect_artifact(path)


def test_missing_layers_are_named_a_few_with_their_count(tiny_artifact: Path, tmp_path: Path) -> None:
    shapes = {name: list(shape) for name, shape in state_shapes(TINY).items()}
    path = _craft(tmp_path / "deep.tinyloop", TINY.to_dict() | {"n_core": 1000}, shapes)
    with pytest.raises(ArtifactError, match=r"missing tensor\(s\): core\.2\..*, \.\.\. \(\d+ in all\)$") as info:
        inspect_artifact(path)
    assert len(str(info.value)) < 1000
