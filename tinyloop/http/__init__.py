"""The HTTP face of TinyLoop: a Quart-trio app over the runtime, served by hypercorn.

``create_app(runtime, model, settings)`` builds the app; ``serve(settings)`` runs the runtime
and hypercorn in one nursery. ``tinyloop.http:app`` is built on first access from the
``TINYLOOP_*`` variables, for ``hypercorn 'tinyloop.http:app'``.
"""

from __future__ import annotations

from typing import Any

from tinyloop.http.app import attach as attach, create_app as create_app
from tinyloop.http.service import ServedModel as ServedModel


def __getattr__(name: str) -> Any:
    if name == "app":
        from tinyloop.http.serve import lazy_app

        return lazy_app()
    raise AttributeError(name)
