"""The bundled demo model: what `tinyloop serve` and `tinyloop generate` load by default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinyloop.engine.engine import Engine
from tinyloop.model.artifact import inspect_artifact
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings


def test_the_bundled_demo_model_loads_and_generates() -> None:
    path = Settings().resolve_model_path()  # no TINYLOOP_MODEL_PATH: the bundled artifact
    assert path.name == "demo.tinyloop"
    info = inspect_artifact(path)
    assert info["config"]["n_core"] >= 1 and info["file_size"] < 30 * 2**20
    engine = Engine.load(path, max_seq_len=256)
    prompt = tuple(engine.tokenizer.encode("def fibonacci(n):"))
    results = {loops: engine.generate(GenerationRequest(
        prompt_tokens=prompt, max_tokens=6, loops=loops,
        sampling=SamplingParams(temperature=0, ignore_eos=True))) for loops in (1, 4)}
    for result in results.values():
        assert result.completion_tokens == 6 and result.text.strip()
    assert engine.kv_statistics().blocks_used == 0


def test_the_quality_benchmark_runs_on_the_bundled_model() -> None:
    """``bench/demo_model.py`` (the model card's tables) at smoke sizes."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "demo_model.py"), "--loops", "1,2", "--windows", "2",
         "--problems", "12", "--threads", "1", "--sample-tokens", "4", "--spec-tokens", "4"],
        capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    for heading in ("Text validation loss", "Held-out addition", "Greedy completions",
                    "Chain self-speculation"):
        assert heading in out.stdout
    spec_rows = [line for line in out.stdout.splitlines() if line.startswith(("| code", "| addition"))]
    assert len(spec_rows) == 2 and all(row.rstrip(" |").endswith("yes") for row in spec_rows)


@pytest.mark.usefixtures("one_torch_thread")  # small batches
def test_more_loops_solve_more_held_out_additions() -> None:
    """The point of the bundled model: the dial. Deterministic (greedy, fixed weights); the margin
    at the model card's scale is about 20 points."""
    import torch

    from tinyloop.model.artifact import load_artifact
    from tinyloop.train.corpus import CorpusSpec, held_out_problems
    from tinyloop.train.evaluate import addition_accuracy

    art = load_artifact(Settings().resolve_model_path(), dtype=torch.float32)
    spec = CorpusSpec(**json.loads(art.metadata["tinyloop.train"])["corpus_spec"])  # as trained
    pairs = held_out_problems(spec.seed, spec.n_held_out, spec.max_digits)[:120]
    acc = {r: addition_accuracy(art.model, art.tokenizer, pairs, r) for r in (1, art.config.default_loops)}
    assert acc[art.config.default_loops] >= acc[1] + 0.08, acc
