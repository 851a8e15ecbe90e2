"""Serving HTTP: a running runtime behind hypercorn's trio worker, with graceful shutdown.

(Loading the model and starting the runtime is the composition root's job: ``tinyloop.server``.)

SIGTERM or SIGINT (or ``shutdown_trigger``) first makes the runtime refuse new requests (503),
then stops hypercorn accepting connections; in-flight requests and streams get
``graceful_timeout`` seconds to finish, then the runtime drains and the process exits 0.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from functools import partial

import hypercorn.trio
import trio
from hypercorn.config import Config
from quart_trio import QuartTrio

from tinyloop.actors.runtime import Runtime
from tinyloop.http.connection import install_protocol_errors
from tinyloop.http.drain import DRAIN_KEY, Drain
from tinyloop.http.factory import create_app
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings

__all__ = ["serve_http", "hypercorn_config"]


def hypercorn_config(settings: Settings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.graceful_timeout = settings.graceful_timeout
    config.accesslog = None
    config.errorlog = "-"
    config.keep_alive_timeout = settings.keep_alive_timeout
    return config


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
