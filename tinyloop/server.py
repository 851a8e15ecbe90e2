"""The composition root: load the model the settings name, start the runtime, serve HTTP.

The only module that joins the engine (torch, the model) with the HTTP layer; ``tinyloop serve``
and ``hypercorn 'tinyloop.http:app'`` both come through here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import trio
from quart_trio import QuartTrio

from tinyloop.actors.runtime import open_runtime
from tinyloop.banner import banner
from tinyloop.convert.cache import converted_artifact, is_hf_dir
from tinyloop.convert.hfdir import FileLimits
from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.errors import ConfigError
from tinyloop.http.connection import install_protocol_errors
from tinyloop.http.factory import attach, create_app
from tinyloop.http.serve import serve_http
from tinyloop.http.service import ServedModel
from tinyloop.http.web import web_root
from tinyloop.logs import log_to_stderr
from tinyloop.model.artifact import read_config
from tinyloop.model.config import ModelConfig
from tinyloop.settings import Settings

__all__ = ["serve", "load_engine", "load_engines", "lazy_app", "check_device", "check_default_loops", "served_model",
           "load_served", "trained_context"]

log = logging.getLogger("tinyloop")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str) -> None:
    """ConfigError unless torch can place a model on ``device`` (``cpu``, ``cuda``, ``cuda:N``)."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) sees no CUDA device or driver")
        raise ConfigError(f"device {device!r} (--device / TINYLOOP_DEVICE, or --devices) needs a CUDA GPU, but {why}; "
                          "use --device cpu, or install a CUDA build of torch on a machine with an NVIDIA GPU")
    suffix = device.partition(":")[2]
    if suffix and not suffix.isdigit():
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    index = int(suffix or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} (--device / TINYLOOP_DEVICE): only "
                          f"{torch.cuda.device_count()} CUDA device(s) visible")


def check_default_loops(settings: Settings, config: ModelConfig | None = None) -> None:
    """ConfigError unless the settings' ``default_loops`` (when set) is one the model may run:
    at most ``config.max_loops`` (``config``: the model's; read from the artifact's header when
    not given, and not checked here for a Hugging Face directory, whose config is read once
    converted, in ``load_engine``)."""
    if settings.default_loops is None:
        return
    if config is None:
        path = settings.resolve_model_path()
        if is_hf_dir(path):
            return
        config = read_config(path)
    if settings.default_loops > config.max_loops:
        raise ConfigError(f"default loops {settings.default_loops} (--default-loops / TINYLOOP_DEFAULT_LOOPS) "
                          f"exceeds the model's max_loops {config.max_loops}")


def load_engine(settings: Settings) -> Engine:
    """The engine the settings describe (the bundled demo model when no path is set), with the
    KV cache mode of the KV flags. A Hugging Face model directory is converted first (once: the
    artifact is kept in the cache directory, ``tinyloop.convert.cache``)."""
    check_device(settings.device)
    path, options = _artifact(settings)
    config = read_config(path)
    check_default_loops(settings, config)
    max_position = config.max_position
    engine = Engine.load(path, max_seq_len=settings.context_for(max_position), **options,
                       default_loops=settings.default_loops,
                       device=settings.device, dtype=_DTYPES.get(settings.dtype or "", None),
                       kv_cache_mb=settings.kv_cache_mb, block_size=settings.kv_block_size,
                       prefill_chunk=settings.prefill_chunk, kv_mode=settings.kv_mode,
                       prefix_caching=settings.prefix_caching, max_draft_nodes=settings.max_draft_nodes,
                       pack_weights=settings.pack_weights, weights=settings.weights,
                       draft_min_prob=settings.draft_min_prob, draft_weights=settings.draft_weights,
                       decode_burst=settings.decode_burst,
                       cpu_kernels=settings.cpu_kernels, cuda_kernels=settings.cuda_kernels,
                       cuda_graphs=settings.cuda_graphs)
    if engine.context_capped_by_kv:
        log.warning("context %d tokens (the model's is %d): what the KV cache holds for one sequence at "
                    "%d loops; set TINYLOOP_KV_CACHE_MB or TINYLOOP_MAX_SEQ_LEN to change it",
                    engine.max_seq_len, max_position, engine.config.default_loops)
    return engine


def _artifact(settings: Settings) -> tuple[Path, dict[str, str]]:
    """The artifact the settings name, and the engine options its source implies: a Hugging Face
    directory is converted (once) and named after the directory."""
    path = settings.resolve_model_path()
    options = {}
    if is_hf_dir(path):
        options["name"] = path.resolve().name  # the model's id: the directory's name
        path = converted_artifact(path, Path(settings.cache_dir) if settings.cache_dir else None,
                                  FileLimits(tokenizer_bytes=int(settings.max_tokenizer_mb * 2**20),
                                             json_bytes=int(settings.max_json_mb * 2**20)))
    return path, options


def trained_context(settings: Settings) -> int:
    """The context the settings' model was built for: its artifact's ``max_position``, read from
    the header (a loaded engine's config holds the served context, which may extend it)."""
    return read_config(_artifact(settings)[0]).max_position


def load_engines(settings: Settings) -> list[Engine]:
    """The engines the runtime drives: one per CUDA device of ``devices``, else ``engines`` on
    ``device``. Engines on one device share its model's weights (``Engine.replica``); on the CPU
    each computes on ``settings.cpu_threads`` torch threads (every engine steps in its own
    worker thread; by default they split the cores but one, which the event loop keeps)."""
    devices = settings.engine_devices
    if "cpu" in devices:  # before loading: the CPU weight layouts depend on the threads (cpu_linear.py)
        torch.set_num_threads(settings.cpu_threads)
        if settings.cpu_kernels and kernels.available():
            kernels.set_threads(settings.cpu_kernel_threads)
    engines: list[Engine] = []
    by_device: dict[str, Engine] = {}
    for device in devices:
        first = by_device.get(device)
        engine = first.replica() if first else load_engine(settings.replace(device=device, devices=None))
        by_device.setdefault(device, engine)
        engines.append(engine)
        if engine.graphs is not None:  # the default loops' decode graphs, before the first request: every
            # row at the default loops, and rows some of which ask fewer (the dial turned down)
            ready = sum(engine.graphs.capture_ahead(engine.default_loops, rows=settings.max_batch_size, mixed=mixed)
                        for mixed in (False, True))
            log.info("engine %d: %d decode graphs captured ahead (loops %d)", len(engines) - 1, ready,
                     engine.default_loops)
    return engines


def served_model(engine: Engine, settings: Settings, context: int | None = None) -> ServedModel:
    """What the HTTP layer serves of ``engine`` (``context``: the context the model was built for,
    None when not known), once its chat templates rendered a sample chat (ConfigError naming the
    template otherwise: a model whose template fails, or does not end in time, on an ordinary
    chat is refused at load rather than on every request)."""
    model = ServedModel.from_engine(engine, settings, trained_context=context)
    model.check_chat_templates()
    return model


def load_served(settings: Settings) -> tuple[list[Engine], ServedModel]:
    """The engines the settings describe and what the HTTP layer serves of them, which knows
    the context the model was built for."""
    engines = load_engines(settings)
    return engines, served_model(engines[0], settings, trained_context(settings))


async def serve(settings: Settings, *, engine: Engine | None = None,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                handle_signals: bool = True,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Load the model, start the runtime and serve HTTP until a signal or ``shutdown_trigger``.

    Reports the bound addresses (``http://host:port``) through ``task_status`` and logs the
    banner (``tinyloop.banner``) then, on shutdown, each step of the drain. An ``engine`` given
    is served as built (its default loops are its own, not ``settings.default_loops``; the
    context its model was built for is not known).
    """
    if engine is None:
        engines, model = await trio.to_thread.run_sync(load_served, settings)
    else:
        engines, model = [engine], await trio.to_thread.run_sync(served_model, engine, settings)
    path = None if engine is not None else str(settings.resolve_model_path())
    async with open_runtime(engines, settings) as rt:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve_http, rt, model, settings, shutdown_trigger=shutdown_trigger,
                                                handle_signals=handle_signals))
            log.info("%s", banner(engines, model, settings, binds, path, playground=web_root() is not None))
            task_status.started(binds)
        log.info("shutdown: stopping the engines")
    log.info("shutdown: engines stopped; bye")


def lazy_app() -> QuartTrio:
    """An app for ``hypercorn 'tinyloop.http:app'``: the model loads when serving starts."""
    settings = Settings.from_env()
    app = create_app(None, None, settings)
    install_protocol_errors()
    scope: dict[str, Any] = {}

    async def run_runtime(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        engines, model = await trio.to_thread.run_sync(load_served, settings)
        log.info("%s", banner(engines, model, settings, (), str(settings.resolve_model_path())))
        with trio.CancelScope() as cancel:
            scope["cancel"] = cancel
            async with open_runtime(engines, settings) as rt:
                attach(app, rt, model, settings)
                task_status.started()
                await trio.sleep_forever()

    @app.before_serving
    async def startup() -> None:
        log_to_stderr()  # serving starts: the banner, the access log
        await app.nursery.start(run_runtime)

    @app.after_serving
    async def shutdown() -> None:
        app.extensions.pop("tinyloop", None)
        if "cancel" in scope:
            scope["cancel"].cancel()

    return app
