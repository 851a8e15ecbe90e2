"""``tinyloop.server.serve`` in this process, as ``tinyloop serve`` runs it (the model loaded from
its artifact by the settings, the banner and the shutdown's steps logged), on 127.0.0.1:0."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from tinyloop.model.artifact import save_artifact
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.server import serve
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer

TRAINED = 48  # the context the test artifact says its model was built for


def short_context_artifact(path: Path, trained: int = TRAINED) -> Path:
    """A ``tiny`` model built for ``trained`` positions (served with a longer context)."""
    save_artifact(path, init_model(PRESETS["tiny"].replace(max_position=trained), seed=0), default_tokenizer())
    return path


def settings_for(artifact: Path, **changes: object) -> Settings:
    """Serving ``artifact`` on a free port, one thread, a served context of 128 tokens."""
    base = Settings(model_path=str(artifact), port=0, threads=1, kernel_threads=1, max_seq_len=128,
                    max_batch_size=4, graceful_timeout=10)
    return base.replace(**changes)


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    stop: trio.Event  # set: the shutdown begins, as on SIGTERM


@asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[Served]:
    """Serve until the body ends (or sets ``stop``), then wait for the drain to finish."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop.wait, handle_signals=False))
        yield Served(binds[0], stop)
        stop.set()
