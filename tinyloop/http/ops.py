"""Operations routes: ``/healthz`` (plain text) and ``/metrics`` (Prometheus exposition).

``/health`` is the same probe under vLLM's name: routers built for vLLM (vllm-router waits on it
at startup whatever its ``--health-check-endpoint``) find a TinyLoop replica healthy the same way.
"""

from __future__ import annotations

from quart import Blueprint, Response, current_app

from tinyloop.metrics import CONTENT_TYPE

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
