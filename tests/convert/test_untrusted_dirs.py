"""A model directory is untrusted input: sizes and values in ``config.json`` are checked against
limits and against the tensors the directory holds before anything is allocated, its files are
read only when they are regular files inside it and up to a cap, its shards stay inside it, and
``convert`` refuses to write an artifact it could not load. Each refusal names the key or file.

The cases whose regression would hang or exhaust memory (huge sizes, ``/dev/zero``, a FIFO)
run in one child process under an address-space cap and a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from tests.convert.checkpoints import CHECKPOINTS, assert_refused, writable_copy
from tinyloop.convert import FileLimits, convert, writer
from tinyloop.errors import ArtifactError, ConfigError
from tinyloop.model.artifact import load_artifact

HUGINN = CHECKPOINTS / "huginn-tiny"
OURO = CHECKPOINTS / "ouro-tiny"
MEMORY_CAP = 1536 << 20  # the child's address space: torch and a tiny conversion fit in well under this
CHILD_TIMEOUT_S = 60


def _edit_config(hf: Path, **changes: Any) -> Path:
    config = json.loads((hf / "config.json").read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            config[outer][inner] = value
        else:
            config[key] = value
    (hf / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python writes them
    return hf


def _copy(fixture: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(fixture, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


# -- run where a regression would hang or take all memory -------------------------------------

_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from tinyloop.convert import convert
from tinyloop.errors import TinyLoopError
for name, hf, out in json.loads(sys.argv[1]):
    try:
        convert(hf, out)
        result = "converted"
    except TinyLoopError as exc:
        result = type(exc).__name__ + ": " + str(exc)
    except MemoryError:
        result = "MemoryError"
    print(json.dumps([name, result]), flush=True)
"""

_SIZES = {  # case -> config.json changes, what the refusal names
    "recurrent layers 1e6": ({"n_layers_in_recurrent_block": 1_000_000}, "n_layers_in_recurrent_block is 1000000"),
    "prelude layers 1e5": ({"n_layers_in_prelude": 100_000}, "n_layers_in_prelude is 100000"),
    "block_size 3e8": ({"block_size": 300_000_000}, "block_size is 300000000"),
    "block_size 1e12": ({"block_size": 10**12}, "block_size is 1000000000000"),
    "head_dim 1e7": ({"head_dim": 10**7}, "head_dim is 10000000"),
    "vocab 1e9": ({"padded_vocab_size": 10**9}, "padded_vocab_size is 1000000000"),
}
_SPECIAL_FILES = {  # case -> (file, what it is made)
    "tokenizer.json -> /dev/zero": ("tokenizer.json", "/dev/zero"),
    "config.json -> /dev/zero": ("config.json", "/dev/zero"),
    "tokenizer_config.json -> /dev/urandom": ("tokenizer_config.json", "/dev/urandom"),
    "generation_config.json -> /dev/zero": ("generation_config.json", "/dev/zero"),
    "index -> /dev/zero": ("model.safetensors.index.json", "/dev/zero"),
    "tokenizer.json a FIFO": ("tokenizer.json", "fifo"),  # last: before the fix it blocks for ever
}


def _special_file_dir(tmp_path: Path, case: str) -> Path:
    name, target = _SPECIAL_FILES[case]
    hf = _copy(HUGINN, tmp_path, f"special{len(list(tmp_path.iterdir()))}")
    (hf / name).unlink()
    if target == "fifo":
        os.mkfifo(hf / name)
    else:
        (hf / name).symlink_to(target)
    return hf


def test_hostile_directories_are_refused_fast_under_a_memory_cap(tmp_path: Path) -> None:
    cases: list[tuple[str, str, str]] = []
    for case, (changes, _) in _SIZES.items():
        hf = _edit_config(_copy(HUGINN, tmp_path, f"size{len(cases)}"), **changes)
        cases.append((case, str(hf), str(tmp_path / f"{len(cases)}.tinyloop")))
    for case in _SPECIAL_FILES:
        cases.append((case, str(_special_file_dir(tmp_path, case)), str(tmp_path / f"{len(cases)}.tinyloop")))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD.format(cap=MEMORY_CAP), json.dumps(cases)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        finished = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"still running after {CHILD_TIMEOUT_S} s, at case {len(finished.splitlines())} of "
                    f"{[c[0] for c in cases]}")
    assert done.returncode == 0, done.stderr[-3000:]
    results = dict(json.loads(line) for line in done.stdout.splitlines())
    for case, (_, named) in _SIZES.items():
        assert results[case].startswith("ConfigError: config.json: ") and named in results[case], results[case]
        assert "TinyLoop needs at most" in results[case]
    for case, (name, _) in _SPECIAL_FILES.items():
        assert results[case].startswith("ConfigError: "), (case, results[case])
        assert name in results[case], (case, results[case])
    assert "outside the model directory" in results["tokenizer.json -> /dev/zero"]
    assert "not a regular file" in results["tokenizer.json a FIFO"]
    assert not any(Path(out).exists() for _, _, out in cases)


# -- value ranges, naming the key the file holds ----------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    ({"mean_recurrence": 1_000_000_000}, "config.json: mean_recurrence is 1000000000; TinyLoop needs at most 1024"),
    ({"rope_base": float("inf")}, "config.json: rope_base must be a finite number > 0, got inf"),
    ({"init_values.embed_scale": float("nan")}, "config.json: init_values.embed_scale must be a finite number > 0"),
    ({"norm_eps": -1.0}, "config.json: norm_eps must be a finite number > 0"),
    ({"n_layers_in_coda": -1}, "config.json: n_layers_in_coda is -1; TinyLoop needs at least 0"),
    ({"block_size": 3e8}, "config.json: block_size must be an integer, got 300000000.0"),
    ({"init_values": [1, 2]}, "config.json: init_values must be an object"),
])
def test_config_values_are_refused_by_their_key(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    assert_refused(_edit_config(writable_copy(HUGINN, tmp_path), **changes), tmp_path, ConfigError, message)


def test_layers_the_checkpoint_does_not_hold_are_refused_before_any_model_is_built(tmp_path: Path) -> None:
    hf = _edit_config(writable_copy(HUGINN, tmp_path), n_layers_in_recurrent_block=1000)
    with pytest.raises(ArtifactError, match=r"checkpoint is missing tensor\(s\): ") as info:
        convert(hf, tmp_path / "out.tinyloop")
    assert re.search(r", \.\.\. \(\d{4} in all\)$", str(info.value)) and len(str(info.value)) < 1000


def test_unknown_tensors_are_named_a_few_with_their_count(tmp_path: Path) -> None:
    hf = writable_copy(OURO, tmp_path)
    state = load_file(str(hf / "model.safetensors"))
    save_file({**state, **{f"model.extra.{i}": state["model.norm.weight"][:1].clone() for i in range(3000)}},
              str(hf / "model.safetensors"))
    with pytest.raises(ArtifactError, match="the Ouro converter does not know: model.extra.0, ") as info:
        convert(hf, tmp_path / "out.tinyloop")
    assert "(3000 in all)" in str(info.value) and len(str(info.value)) < 600


# -- files: regular, capped, inside --------------------------------------------------------------

def test_a_json_file_over_its_cap_is_refused_naming_the_cap(tmp_path: Path) -> None:
    hf = writable_copy(HUGINN, tmp_path)
    with pytest.raises(ConfigError, match=r"tokenizer.json: 6091 bytes is more than the 4096 bytes a tokenizer.json "
                                          r"may take \(--max-tokenizer-mb raises it\)"):
        convert(hf, tmp_path / "out.tinyloop", limits=FileLimits(tokenizer_bytes=4096))
    with pytest.raises(ConfigError, match=r"config.json: .* \(--max-json-mb raises it\)"):
        convert(hf, tmp_path / "out.tinyloop", limits=FileLimits(json_bytes=1024))
    assert FileLimits().tokenizer_bytes == 64 << 20 and FileLimits().json_bytes == 16 << 20


def _outside_shard(tmp_path: Path, weight_map_name: str) -> Path:
    """huginn-tiny with its second shard moved out of the directory and named ``weight_map_name``."""
    hf = writable_copy(HUGINN, tmp_path)
    shard = "model-00002-of-00002.safetensors"
    shutil.move(hf / shard, tmp_path / "outside.safetensors")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: (weight_map_name if v == shard else v) for k, v in index["weight_map"].items()}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    return hf


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "/etc/passwd"])
def test_shards_outside_the_directory_are_refused_unopened(tmp_path: Path, name: str) -> None:
    name = str(tmp_path / "outside.safetensors") if name == "ABSOLUTE" else name
    hf = _outside_shard(tmp_path, name)
    with pytest.raises(ConfigError, match="outside the model directory; refused") as info:
        convert(hf, tmp_path / "out.tinyloop")
    assert "safetensors file" not in str(info.value) and "header" not in str(info.value).lower()
    assert not (tmp_path / "out.tinyloop").exists()


def test_a_shard_linked_outside_the_directory_is_refused(tmp_path: Path) -> None:
    hf = writable_copy(OURO, tmp_path)
    shutil.move(hf / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (hf / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    assert_refused(hf, tmp_path, ConfigError, "model.safetensors, outside the model directory; refused")


def test_a_hub_cache_snapshot_linking_into_its_blobs_converts(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--ouro-tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in OURO.iterdir():  # what huggingface_hub writes: relative links to content-addressed blobs
        shutil.copyfile(f, repo / "blobs" / f"blob-{f.name}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob-{f.name}")
    out = tmp_path / "out.tinyloop"
    convert(snapshot, out)
    assert load_artifact(out).config.n_core == 3


# -- convert writes only what loads ------------------------------------------------------------

def test_convert_refuses_a_header_safetensors_would_not_read_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert writer.MAX_HEADER_BYTES == 100 << 20  # safetensors' limit on reading
    monkeypatch.setattr(writer, "MAX_HEADER_BYTES", 8 << 10)  # huginn-tiny's header is ~20 KiB
    with pytest.raises(ArtifactError, match=r"header would take .* MiB, more than the 0.0078125 MiB safetensors reads "
                                            r"back \(largest entries: tinyloop.tokenizer"):
        convert(HUGINN, tmp_path / "out.tinyloop")
    assert list(tmp_path.iterdir()) == []
