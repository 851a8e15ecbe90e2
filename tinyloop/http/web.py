"""The browser playground: the page and its assets from the package's ``tinyloop/web`` (the only
copy; ``pip install`` carries it as package data), served at ``/`` and ``/ui/<name>``; a favicon
at ``/favicon.ico``; and ``/ui/model.json``, what the page needs to know of the served model
beyond its card: whether it is the bundled demo model and whether chat mode makes sense."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

from quart import Response, send_from_directory
from quart_trio import QuartTrio

from tinyloop.http.service import ServedModel, describe, served
from tinyloop.settings import BUNDLED_MODEL, Settings
from tinyloop.vocabulary import EXIT_DEFAULT_THRESHOLDS, EXIT_KINDS, GATE_KINDS

__all__ = ["install", "page_info", "web_root"]

DEMO_CHAT_REASON = ("The bundled demo model continues Python and a+b= lines; it was never trained on "
                    "chat turns, so its chat template gives nonsense. Use completion mode.")
NO_TEMPLATE_REASON = "This model has no chat template: use completion mode."


def web_root() -> Path | None:
    """``tinyloop/web`` of the installed package (None if it was installed without it)."""
    root = Path(str(files("tinyloop") / "web"))
    return root if (root / "index.html").is_file() else None


def is_demo(settings: Settings) -> bool:
    """Whether the server runs the bundled demo model."""
    bundled = Path(str(files("tinyloop") / "data" / BUNDLED_MODEL)).resolve()
    return not settings.model_path or Path(settings.model_path).resolve() == bundled


def page_info(model: ServedModel, settings: Settings) -> dict[str, Any]:
    """The model's card (``describe``) plus what the page offers for it: the exit rules it can
    run (the gate rules need a model with an exit gate) and whether chat mode makes sense."""
    demo = is_demo(settings)
    template = model.chat_template.strip() or None
    reason = DEMO_CHAT_REASON if demo else NO_TEMPLATE_REASON if template is None else None
    gate = model.gate or model.exit.kind in GATE_KINDS
    kinds = [k for k in EXIT_KINDS if gate or k not in GATE_KINDS]
    return {"id": model.id, "demo": demo, "context_length": model.max_seq_len, **describe(model),
            "exit_kinds": kinds, "exit_thresholds": {k: EXIT_DEFAULT_THRESHOLDS.get(k) for k in kinds},
            "chat": {"usable": reason is None, "reason": reason, "template": template}}


def install(app: QuartTrio) -> None:
    @app.get("/")
    async def index() -> Response:
        root = web_root()
        if root is None:
            return Response("TinyLoop is running. See /v1/models, /healthz, /metrics.\n",
                            content_type="text/plain")
        return await send_from_directory(root, "index.html")

    @app.get("/favicon.ico")
    async def favicon() -> Response:
        root = web_root()
        if root is None:
            return Response("", status=204)
        response = await send_from_directory(root, "favicon.svg")
        response.content_type = "image/svg+xml"
        return response

    @app.get("/ui/model.json")
    async def model_json() -> dict[str, Any]:
        s = served()
        return page_info(s.model, s.settings)

    @app.get("/ui/<path:name>")
    async def asset(name: str) -> Response:
        root = web_root()
        if root is None:
            from werkzeug.exceptions import NotFound
            raise NotFound()
        return await send_from_directory(root, name)
