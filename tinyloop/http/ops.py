"""Operations routes: ``/healthz`` (plain text), ``/metrics`` (Prometheus exposition) and
``/version`` (the package's version, torch's and the engines' devices, as JSON).

``/health`` is the same probe under vLLM's name: routers built for vLLM (vllm-router waits on it
at startup whatever its ``--health-check-endpoint``) find a TinyLoop replica healthy the same way.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, current_app

import tinyloop
from tinyloop.metrics import CONTENT_TYPE
from tinyloop.version import torch_version

__all__ = ["blueprint"]

blueprint = Blueprint("ops", __name__)


@blueprint.get("/healthz")
@blueprint.get("/health")
async def healthz() -> Response:
    state = current_app.extensions.get("tinyloop")
    if state is None:
        return Response("model not loaded\n", status=503, content_type="text/plain")
    stats = state.runtime.statistics()
    if not stats.healthy:
        return Response(f"engine broken: {stats.broken}\n", status=503, content_type="text/plain")
    if stats.shutting_down:
        return Response("shutting down\n", status=503, content_type="text/plain")
    if len(stats.engines) <= 1:
        return Response("ok\n", content_type="text/plain")
    # several engines: still serving while one works; a line per engine says which
    lines = [f"engine {i}: {'ok' if e.broken is None else 'broken: ' + e.broken}" for i, e in enumerate(stats.engines)]
    return Response("ok\n" + "\n".join(lines) + "\n", content_type="text/plain")


@blueprint.get("/metrics")
async def metrics() -> Response:
    state = current_app.extensions.get("tinyloop")
    if state is None:
        return Response("", content_type=CONTENT_TYPE)
    return Response(state.runtime.metrics_text(), content_type=CONTENT_TYPE)


@blueprint.get("/version")
async def version() -> dict[str, Any]:
    """``{"version": ...}`` (what ``tinyloop --version`` prints), torch's version and, once a
    model is loaded, the devices its engines run on."""
    out: dict[str, Any] = {"version": tinyloop.__version__, "torch": torch_version()}
    state = current_app.extensions.get("tinyloop")
    if state is not None:
        out["devices"] = list(dict.fromkeys(state.settings.engine_devices))
    return out
