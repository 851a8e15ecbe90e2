"""A real hypercorn on 127.0.0.1:0 over the runtime, started the way production starts it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import trio

from tinyloop.actors.runtime import Runtime, open_runtime
from tinyloop.engine.engine import Engine
from tinyloop.http.serve import serve_http
from tinyloop.http.service import ServedModel
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer


def tiny_engine(max_seq_len: int = 256, **options: Any) -> Engine:
    """A tiny random model with peaked logits (no greedy ties), named ``tiny``."""
    model = init_model(PRESETS["tiny"].replace(max_position=max_seq_len), seed=2)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return Engine(model, default_tokenizer(), max_seq_len=max_seq_len, block_size=8, name="tiny",
                  **options)


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded; ``[DONE]`` kept as the string."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    runtime: Runtime
    engine: Any
    model: ServedModel
    settings: Settings


@asynccontextmanager
async def running_server(settings: Settings | None = None, engine: Any = None,
                         model: ServedModel | None = None) -> AsyncIterator[LiveServer]:
    """Start runtime + hypercorn in this task's nursery; stop both on exit.

    ``engine`` may be a real ``Engine`` (default: ``tiny_engine()``) or a ``FakeEngine`` (then
    pass ``model``, e.g. ``ServedModel(id="fake", tokenizer=default_tokenizer(), ...)``).
    """
    settings = settings or Settings(port=0, max_batch_size=8)
    engine = engine if engine is not None else tiny_engine()
    if model is None:
        model = ServedModel.from_engine(engine, settings)
    async with trio.open_nursery() as nursery:
        async with open_runtime(engine, settings) as rt:
            binds = await nursery.start(partial(serve_http, rt, model, settings))
            yield LiveServer(binds[0], rt, engine, model, settings)
            nursery.cancel_scope.cancel()
