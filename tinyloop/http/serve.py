"""Serving: the runtime and hypercorn's trio worker in one nursery, with graceful shutdown.

SIGTERM or SIGINT (or ``shutdown_trigger``) first makes the runtime refuse new requests (503),
then stops hypercorn accepting connections; in-flight requests and streams get
``graceful_timeout`` seconds to finish, then the runtime drains and the process exits 0.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import hypercorn.trio
import torch
import trio
from hypercorn.config import Config
from quart_trio import QuartTrio

from tinyloop.actors.runtime import Runtime, open_runtime
from tinyloop.engine.engine import Engine
from tinyloop.http.connection import install_protocol_errors
from tinyloop.http.drain import DRAIN_KEY, Drain
from tinyloop.http.factory import attach, create_app
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings

__all__ = ["serve", "serve_http", "load_engine", "lazy_app", "hypercorn_config"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_engine(settings: Settings) -> Engine:
    """The engine the settings describe (the bundled demo model when no path is set), with the
    KV cache mode of the KV flags."""
    return Engine.load(settings.resolve_model_path(), max_seq_len=settings.max_seq_len,
                       device=settings.device, dtype=_DTYPES.get(settings.dtype or "", None),
                       kv_cache_mb=settings.kv_cache_mb, block_size=settings.kv_block_size,
                       prefill_chunk=settings.prefill_chunk, kv_mode=settings.kv_mode,
                       prefix_caching=settings.prefix_caching, max_draft_nodes=settings.max_draft_nodes)


def hypercorn_config(settings: Settings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.graceful_timeout = settings.graceful_timeout
    config.accesslog = None
    config.errorlog = "-"
    config.keep_alive_timeout = settings.keep_alive_timeout
    return config


async def serve(settings: Settings, *, engine: Engine | None = None,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                handle_signals: bool = True,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Load the model, start the runtime and serve HTTP until a signal or ``shutdown_trigger``.

    Reports the bound addresses (``http://host:port``) through ``task_status``.
    """
    if engine is None:
        engine = await trio.to_thread.run_sync(load_engine, settings)
    model = ServedModel.from_engine(engine, settings)
    async with open_runtime(engine, settings) as rt:
        await serve_http(rt, model, settings, shutdown_trigger=shutdown_trigger,
                         handle_signals=handle_signals, task_status=task_status)


async def serve_http(rt: Runtime, model: ServedModel, settings: Settings, *,
                     shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                     handle_signals: bool = False,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve an already running runtime over HTTP until a signal or ``shutdown_trigger``."""
    stop = trio.Event()
    app = create_app(rt, model, settings)
    install_protocol_errors()
    begin = partial(_begin_shutdown, rt, stop, app.extensions[DRAIN_KEY], settings.graceful_timeout)
    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(_on_signal, begin)
        if shutdown_trigger is not None:
            nursery.start_soon(_on_trigger, shutdown_trigger, begin)
        binds = await nursery.start(_run_hypercorn, app, hypercorn_config(settings), stop, nursery)
        task_status.started(binds)


async def _run_hypercorn(app: QuartTrio, config: Config, stop: trio.Event, nursery: trio.Nursery,
                         task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    await hypercorn.trio.serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
    nursery.cancel_scope.cancel()


def _begin_shutdown(rt: Runtime, stop: trio.Event, drain: Drain, graceful_timeout: float) -> None:
    rt.refuse_new_requests()
    drain.begin(graceful_timeout)  # streams still open near the deadline end in-band
    stop.set()


async def _on_signal(begin: Callable[[], None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            begin()
            return


async def _on_trigger(trigger: Callable[[], Awaitable[None]], begin: Callable[[], None]) -> None:
    await trigger()
    begin()


def lazy_app() -> QuartTrio:
    """An app for ``hypercorn 'tinyloop.http:app'``: the model loads when serving starts."""
    settings = Settings.from_env()
    app = create_app(None, None, settings)
    install_protocol_errors()
    scope: dict[str, Any] = {}

    async def run_runtime(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        engine = await trio.to_thread.run_sync(load_engine, settings)
        with trio.CancelScope() as cancel:
            scope["cancel"] = cancel
            async with open_runtime(engine, settings) as rt:
                attach(app, rt, ServedModel.from_engine(engine, settings), settings)
                task_status.started()
                await trio.sleep_forever()

    @app.before_serving
    async def startup() -> None:
        await app.nursery.start(run_runtime)

    @app.after_serving
    async def shutdown() -> None:
        app.extensions.pop("tinyloop", None)
        if "cancel" in scope:
            scope["cancel"].cancel()

    return app


