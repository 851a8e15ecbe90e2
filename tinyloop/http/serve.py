"""Serving HTTP: a running runtime behind hypercorn's trio worker, with graceful shutdown.

(Loading the model and starting the runtime is the composition root's job: ``tinyloop.server``.)

SIGTERM, SIGINT or SIGHUP (or ``shutdown_trigger``) first makes the runtime refuse new requests
(503), then stops hypercorn accepting connections; in-flight requests and streams get
``graceful_timeout`` seconds to finish, then the runtime drains and the process exits 0.

Each step is logged on the ``tinyloop.http`` logger at INFO: admission stopping, how many
requests are left to drain, the HTTP server stopped (``tinyloop.server.serve`` adds the
engines' stop).

A second signal while that drain runs forces the shutdown (as uvicorn's second Ctrl-C does):
it is logged, every open stream ends now with the ``shutting down`` error event and
``[DONE]``, and after ``FORCE_FLUSH_S`` for those last events to reach their clients (less
when every connection closed sooner) ``serve_http`` raises ``ShutdownForced``; ``tinyloop
serve`` then exits with 128 + the forcing signal's number (143 for SIGTERM, 130 for SIGINT,
129 for SIGHUP), the status a shell gives a process that signal ended.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import hypercorn.trio
import trio
from hypercorn.config import Config
from hypercorn.logging import Logger
from quart_trio import QuartTrio

from tinyloop.actors.runtime import Runtime
from tinyloop.http.connection import ServerConfig, install_protocol_errors
from tinyloop.http.drain import DRAIN_KEY, Drain
from tinyloop.http.factory import create_app
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings

__all__ = ["serve_http", "hypercorn_config", "ShutdownForced", "DRAIN_SIGNALS", "FORCE_FLUSH_S"]

log = logging.getLogger("tinyloop.http")

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORCE_FLUSH_S = 1.0  # what the last events of a forced shutdown get to reach their clients


class ShutdownForced(Exception):
    """Raised by ``serve_http`` once a second signal forced the shutdown and the server
    stopped; ``exit_status`` is what ``tinyloop serve`` exits with."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"shutdown forced by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def hypercorn_config(settings: Settings) -> ServerConfig:
    config = ServerConfig(settings.send_timeout)
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
    """Serve an already running runtime over HTTP until a signal or ``shutdown_trigger``;
    ``ShutdownForced`` when a second signal forced the end (the module docstring)."""
    app = create_app(rt, model, settings)
    install_protocol_errors()
    config = hypercorn_config(settings)
    async with trio.open_nursery() as nursery:
        shutdown = _Shutdown(rt, app.extensions[DRAIN_KEY], config, nursery.cancel_scope)
        if handle_signals:
            nursery.start_soon(_on_signal, shutdown, config.log)
        if shutdown_trigger is not None:
            nursery.start_soon(_on_trigger, shutdown_trigger, shutdown)
        binds = await nursery.start(_run_hypercorn, app, config, shutdown.stop, nursery)
        task_status.started(binds)
    if shutdown.forced_by is not None:
        raise ShutdownForced(shutdown.forced_by)
    log.info("shutdown: HTTP server stopped, every connection closed")


async def _run_hypercorn(app: QuartTrio, config: Config, stop: trio.Event, nursery: trio.Nursery,
                         task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    await hypercorn.trio.serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
    nursery.cancel_scope.cancel()


class _Shutdown:
    """One server's stop: ``begin`` once (the first signal or the trigger), ``force`` after."""

    def __init__(self, rt: Runtime, drain: Drain, config: ServerConfig, scope: trio.CancelScope) -> None:
        self.rt, self.drain, self.config, self.scope = rt, drain, config, scope
        self.stop = trio.Event()  # hypercorn's shutdown trigger
        self.forced_by: int | None = None  # the signal that forced it

    @property
    def begun(self) -> bool:
        return self.stop.is_set()

    def begin(self, cause: str = "shutdown trigger", forcible: bool = False) -> None:
        """Start the drain, logging its first steps; ``cause`` names what started it and
        ``forcible`` says a second signal may force it."""
        if self.begun:
            return
        timeout = self.config.graceful_timeout
        log.info("%s: shutting down; stopping admission (new requests get 503)", cause)
        self.rt.refuse_new_requests()
        stats = self.rt.statistics()
        log.info("shutdown: draining %d in-flight request%s (%d queued) for up to %g s%s", stats.in_flight,
                 "" if stats.in_flight == 1 else "s", stats.queue_depth, timeout,
                 " (a second signal forces it)" if forcible else "")
        self.drain.begin(timeout)  # streams still open near the deadline end in-band
        self.config.writes.close_by(trio.current_time() + timeout)  # hypercorn's deadline binds writes too
        self.stop.set()

    def force(self, signum: int) -> None:
        """End every stream now, and the server ``FORCE_FLUSH_S`` later at the latest."""
        self.begin()
        self.forced_by = signum
        deadline = trio.current_time() + FORCE_FLUSH_S
        self.drain.force()
        self.config.writes.close_by(deadline)
        self.scope.deadline = min(self.scope.deadline, deadline)


async def _on_signal(shutdown: _Shutdown, log: Logger) -> None:
    """Open for the whole of ``serve_http``: a signal never meets Python's default action (a
    second SIGTERM killing the process, a second SIGINT raising KeyboardInterrupt)."""
    with trio.open_signal_receiver(*DRAIN_SIGNALS) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not shutdown.begun:
                shutdown.begin(name, forcible=True)
            elif shutdown.forced_by is None:
                shutdown.force(signum)
                await log.warning(f"second signal ({name}): forcing shutdown; open streams end now")


async def _on_trigger(trigger: Callable[[], Awaitable[None]], shutdown: _Shutdown) -> None:
    await trigger()
    shutdown.begin()
