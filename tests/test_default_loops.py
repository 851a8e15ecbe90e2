"""A server-wide default loop count (``--default-loops`` / ``TINYLOOP_DEFAULT_LOOPS``): a request
that names no ``loops`` runs at it, one that does runs at its own, and everything sized or reported
from the default (limits, the KV pool, the model card, the metrics gauge) sees it; past the model's
``max_loops`` it is refused before serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.http.conftest import running_server
from tinyloop.cli import build_parser, main
from tinyloop.engine.engine import Engine
from tinyloop.errors import ConfigError
from tinyloop.http.service import ServedModel
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest
from tinyloop.server import load_engines
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Once upon a time"


def settings_for(artifact: Path, **changes: Any) -> Settings:
    return Settings(model_path=str(artifact), port=0, threads=1, kernel_threads=1, **changes)


def test_the_variable_and_the_flag_set_it() -> None:
    assert Settings.from_env({}).default_loops is None
    assert Settings.from_env({"TINYLOOP_DEFAULT_LOOPS": "2"}).default_loops == 2
    args = build_parser().parse_args(["serve", "--default-loops", "3"])
    assert Settings.from_env({"TINYLOOP_DEFAULT_LOOPS": "2"}, default_loops=args.default_loops).default_loops == 3
    with pytest.raises(ConfigError, match="default_loops must be >= 1"):
        Settings(default_loops=0)
    with pytest.raises(ConfigError, match="TINYLOOP_DEFAULT_LOOPS"):
        Settings.from_env({"TINYLOOP_DEFAULT_LOOPS": "two"})


def test_the_engine_is_sized_as_if_the_model_said_so() -> None:
    """Limits and the default KV pool of an engine given default loops 2 are those of the same
    model whose own config says 2; its max_loops is the model's."""
    tok = default_tokenizer()
    dialled = Engine(init_model(PRESETS["tiny"], seed=0), tok, default_loops=2)
    native = Engine(init_model(PRESETS["tiny"].replace(default_loops=2), seed=0), tok)
    plain = Engine(init_model(PRESETS["tiny"], seed=0), tok)
    assert dialled.default_loops == dialled.limits.default_loops == 2
    assert dialled.limits == native.limits and dialled.config == native.config
    assert dialled.pool.num_blocks == native.pool.num_blocks != plain.pool.num_blocks
    assert dialled.config.max_loops == plain.config.max_loops == 16
    with pytest.raises(ConfigError, match="exceeds max_loops"):
        Engine(init_model(PRESETS["tiny"], seed=0), tok, default_loops=17)


def test_a_loaded_engine_runs_requests_without_loops_at_it(tiny_artifact: Path) -> None:
    (engine,) = load_engines(settings_for(tiny_artifact, default_loops=2))
    assert engine.config.default_loops == 2
    assert ServedModel.from_engine(engine, Settings()).default_loops == 2
    ids = tuple(engine.tokenizer.encode(PROMPT))
    assert engine.generate(GenerationRequest(prompt_tokens=ids, max_tokens=2)).loops_used == 2
    assert engine.generate(GenerationRequest(prompt_tokens=ids, max_tokens=2, loops=3)).loops_used == 3


async def test_the_server_reports_and_runs_it(tiny_artifact: Path) -> None:
    settings = settings_for(tiny_artifact, default_loops=2)
    (engine,) = load_engines(settings)
    with trio.fail_after(60):
        async with running_server(settings, engine) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            out = (await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 3})).json()
            assert out["loops"] == out["mean_loops"] == 2
            out = (await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 3, "loops": 3})).json()
            assert out["loops"] == 3
            lms = (await client.post("/api/v0/completions", json={"prompt": PROMPT, "max_tokens": 2})).json()
            assert lms["stats"]["loops"] == 2 and lms["model_info"]["default_loops"] == 2
            card = (await client.get("/v1/models")).json()["data"][0]
            assert card["default_loops"] == 2
            metrics = (await client.get("/metrics")).text
            assert "tinyloop_default_loops 2.0" in metrics.splitlines()


def test_past_the_models_max_loops_it_is_refused_before_serving(tiny_artifact: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    message = "default loops 17 (--default-loops / TINYLOOP_DEFAULT_LOOPS) exceeds the model's max_loops 16"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_engines(settings_for(tiny_artifact, default_loops=17))
    assert main(["serve", "--model", str(tiny_artifact), "--port", "0", "--default-loops", "17"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
