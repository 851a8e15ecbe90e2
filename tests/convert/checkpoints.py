"""What the converter tests share: the tiny reference checkpoints, a writable copy of one, and
the logits comparison over the tokenizer's ids."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tinyloop.convert import convert
from tinyloop.engine.engine import Engine
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.vocabulary import ExitRule

CHECKPOINTS = Path(__file__).parent.parent / "data" / "checkpoints"
TOL = 1e-4  # max |dlogit| in fp32 (the fixtures' README expects ~1e-6)


def max_diff(engine: Engine, logits: torch.Tensor, ref: torch.Tensor) -> float:
    """Over the tokenizer's ids: the engine masks the checkpoint's padding rows (-inf)."""
    n = engine.tokenizer.vocab_size
    assert torch.isneginf(logits[..., n:]).all()
    return (logits[..., :n].float() - ref[..., :n]).abs().max().item()


def writable_copy(fixture: Path, tmp_path: Path) -> Path:
    """A copy of ``fixture`` under ``tmp_path`` whose files a test may rewrite."""
    dst = tmp_path / "hf"
    shutil.copytree(fixture, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def converted_engine(fixture: Path, out_dir: Path, **options: Any) -> Engine:
    """``fixture`` converted (``options`` go to ``convert``) and loaded in float32."""
    out = out_dir / f"{fixture.name}.tinyloop"
    convert(fixture, out, **options)
    return Engine.load(out, dtype=torch.float32, kv_cache_mb=4)


def full_logits(engine: Engine, ids: list[int], loops: int, exit: ExitRule | None = None) -> torch.Tensor:
    """Logits at every position of ``ids`` from one forward (the engine's verify path)."""
    seq = engine.start(GenerationRequest(prompt_tokens=tuple(ids), loops=loops, max_tokens=1, exit=exit))
    try:
        seq.kv.reserve(len(ids))
        return engine.verify([seq], [ids])[0]
    finally:
        engine.free(seq)


def cached_decode_logits(engine: Engine, ids: list[int], loops: int = 4) -> torch.Tensor:
    """The last token's logits ``[V]``, decoded with the KV the prefill of the others left."""
    seq = engine.start(GenerationRequest(prompt_tokens=tuple(ids[:-1]), loops=loops, max_tokens=2))
    try:
        engine.prefill(seq)
        seq.pending = ids[-1]
        return engine.decode([seq])[0]
    finally:
        engine.free(seq)


def greedy_tokens(engine: Engine, ids: list[int], n: int, loops: int = 4, exit: ExitRule | None = None) -> list[int]:
    """``n`` greedy tokens after ``ids`` (end-of-sequence ignored)."""
    req = GenerationRequest(prompt_tokens=tuple(ids), loops=loops, max_tokens=n, exit=exit,
                            sampling=SamplingParams(temperature=0.0, ignore_eos=True))
    return list(engine.generate(req).tokens)


def assert_refused(hf: Path, out_dir: Path, error: type[Exception], message: str) -> None:
    """Converting ``hf`` raises ``error`` whose text holds ``message`` and writes no artifact."""
    out = out_dir / "out.tinyloop"
    with pytest.raises(error, match=re.escape(message)):
        convert(hf, out)
    assert not out.exists()
