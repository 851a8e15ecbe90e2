"""The bundled demo model: what `tinyloop serve` and `tinyloop generate` load by default."""

from __future__ import annotations

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
