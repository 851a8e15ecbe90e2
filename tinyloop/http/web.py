"""The browser UI: static files from ``web/`` served at ``/``."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from quart import Response, send_from_directory
from quart_trio import QuartTrio

__all__ = ["install", "web_root"]


def web_root() -> Path | None:
    """``tinyloop/web`` in an installed package, else the repository's ``web/``."""
    for candidate in (Path(str(files("tinyloop") / "web")), Path(__file__).resolve().parents[2] / "web"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


def install(app: QuartTrio) -> None:
    @app.get("/")
    async def index() -> Response:
        root = web_root()
        if root is None:
            return Response("TinyLoop is running. See /v1/models, /healthz, /metrics.\n",
                            content_type="text/plain")
        return await send_from_directory(root, "index.html")

    @app.get("/ui/<path:name>")
    async def asset(name: str) -> Response:
        root = web_root()
        if root is None:
            from werkzeug.exceptions import NotFound
            raise NotFound()
        return await send_from_directory(root, name)
