"""``tinyloop init`` and ``tinyloop inspect`` through ``main([...])``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tinyloop.cli import main
from tinyloop.model.artifact import load_artifact
from tinyloop.model.config import ModelConfig, kv_bytes_per_token
from tinyloop.model.presets import PRESETS, param_count
from tinyloop.vocabulary import KV_MODES, ExitRule, KVMode


def _inspect_json(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["inspect", str(path), "--json", *args]) == 0
    info: dict[str, Any] = json.loads(capsys.readouterr().out)
    return info


def test_init_then_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.tinyloop"
    assert main(["init", str(path), "--preset", "tiny", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out
    assert f"{param_count(PRESETS['tiny']):,}" in out
    assert f"{path.stat().st_size:,} bytes" in out

    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    for fragment in ("parameters", "float32", "4096 tokens", "eos_ids [0, 2]", "block_style",
                     "cache_window 4"):
        assert fragment in text
    fp16 = kv_bytes_per_token(PRESETS["tiny"], 4, 4, 2)
    assert f"{fp16:,} B fp16" in text


@pytest.mark.parametrize(("loops", "window"), [(None, None), (6, None), (6, 3), (1, None)])
def test_inspect_json_kv_bytes_follow_the_formula(tiny_artifact: Path, capsys: pytest.CaptureFixture[str],
                                                  loops: int | None, window: int | None) -> None:
    args = [*(["--loops", str(loops)] if loops else []), *(["--cache-window", str(window)] if window else [])]
    info = _inspect_json(tiny_artifact, capsys, *args)
    config = ModelConfig.from_dict(info["config"])
    assert config == PRESETS["tiny"]
    assert info["parameters"] == param_count(config)
    assert info["file_size"] == tiny_artifact.stat().st_size
    assert info["tokenizer_vocab_size"] == 4096
    assert info["special_tokens"] == {"bos_id": 0, "eos_id": 0, "eos_ids": [0, 2], "pad_id": None}
    kv = info["kv_cache"]
    n = loops or config.default_loops
    w = window or n
    assert (kv["loops"], kv["cache_window"]) == (n, w)
    assert kv["bytes_fp16"] == kv_bytes_per_token(config, n, w, 2)
    assert kv["bytes_dtype"] == kv_bytes_per_token(config, n, w, 4)
    rows = {r["cache_window"]: r for r in kv["by_cache_window"]}
    assert set(rows) == {1, min(2, n), n}
    for cw, row in rows.items():
        assert row["bytes_fp16"] == kv_bytes_per_token(config, n, cw, 2)
        assert row["bytes_dtype"] == kv_bytes_per_token(config, n, cw, 4)


def test_init_with_overrides_and_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ouro.tinyloop"
    code = main(["init", str(path), "--preset", "tiny-ouro", "--dtype", "bfloat16",
                 "--set", "default_loops=8", "--set", "exit.threshold=0.5", "--set", "block_style=pre_ln",
                 "--set", "vocab_size=100"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    info = _inspect_json(path, capsys)
    config = ModelConfig.from_dict(info["config"])
    assert config == PRESETS["tiny-ouro"].replace(
        default_loops=8, block_style="pre_ln", exit=ExitRule("gate", 0.5))
    assert config.vocab_size == 4096  # raised to the tokenizer's
    assert info["dtype"] == "bfloat16"
    assert info["kv_cache"]["loops"] == 8
    assert info["kv_cache"]["bytes_dtype"] == info["kv_cache"]["bytes_fp16"] == kv_bytes_per_token(config, 8)


def test_init_from_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = PRESETS["tiny"].replace(n_core=1, max_loops=8)
    cfg = tmp_path / "c.json"
    cfg.write_text(config.to_json())
    path = tmp_path / "m.tinyloop"
    assert main(["init", str(path), "--config", str(cfg)]) == 0
    assert load_artifact(path).config == config


@pytest.mark.parametrize(("argv", "fragment"), [
    (["inspect", "{tmp}/absent.tinyloop"], "absent.tinyloop: no such artifact file"),
    (["init", "{tmp}/x.tinyloop", "--set", "wat=1"], "unknown config field(s): wat"),
    (["init", "{tmp}/x.tinyloop", "--set", "heads"], "--set expects KEY=VALUE"),
    (["init", "{tmp}/x.tinyloop", "--set", "hidden.x=1"], "'hidden' is not a config object"),
    (["init", "{tmp}/x.tinyloop", "--config", "{tmp}/none.json"], "cannot read config file"),
    (["init", "{tmp}/no/dir/x.tinyloop"], "cannot write artifact"),
])
def test_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      argv: list[str], fragment: str) -> None:
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert fragment in captured.err
    assert "Traceback" not in captured.err


def test_inspect_loops_beyond_max_loops_is_refused(tiny_artifact: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tiny_artifact), "--loops", "99"]) == 2
    assert "max_loops=16" in capsys.readouterr().err


def test_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init"]) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["int4", "h-mode+int4"])
def test_inspect_reports_kv_bytes_per_mode(tiny_artifact: Path, capsys: pytest.CaptureFixture[str],
                                           mode: str) -> None:
    info = _inspect_json(tiny_artifact, capsys, "--kv-mode", mode, "--cache-window", "2")
    config = ModelConfig.from_dict(info["config"])
    kv = info["kv_cache"]
    assert kv["kv_mode"] == mode
    assert kv["bytes_fp16"] == KVMode.parse(mode).bytes_per_token(config, 4, 2, 2)
    table = {r["mode"]: r for r in kv["by_mode"]}
    assert list(table) == list(KV_MODES)
    full = kv_bytes_per_token(config, 4, 2, 2)
    for name, row in table.items():
        assert row["bytes_fp16"] == KVMode.parse(name).bytes_per_token(config, 4, 2, 2)
        assert row["cut_vs_full_fp16"] == round(1 - row["bytes_fp16"] / full, 4)
    assert main(["inspect", str(tiny_artifact), "--kv-mode", mode]) == 0
    text = capsys.readouterr().out
    assert f"mode {mode})" in text and "h-mode-fp16-qkv+int4" in text


def test_convert_takes_the_json_size_caps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = Path(__file__).parent / "data" / "checkpoints" / "huginn-tiny"
    assert main(["convert", str(hf), str(tmp_path / "a.tinyloop"), "--max-json-mb", "0.0001"]) != 0
    assert "--max-json-mb raises it" in capsys.readouterr().err
    assert main(["convert", str(hf), str(tmp_path / "b.tinyloop"), "--max-tokenizer-mb", "0.001"]) != 0
    assert "--max-tokenizer-mb raises it" in capsys.readouterr().err
    assert main(["convert", str(hf), str(tmp_path / "c.tinyloop")]) == 0
