"""The HTTP face of TinyLoop: a Quart-trio app over the runtime, served by hypercorn.

``create_app(runtime, model, settings)`` builds the app; ``serve(settings)`` runs the runtime
and hypercorn in one nursery. ``tinyloop.http:app`` is built from the ``TINYLOOP_*``
variables on its first ASGI call, for ``hypercorn 'tinyloop.http:app' --worker-class trio``.
"""

from __future__ import annotations

from typing import Any

from quart_trio import QuartTrio

from tinyloop.http.factory import attach as attach
from tinyloop.http.factory import create_app as create_app
from tinyloop.http.service import ServedModel as ServedModel


class _LazyApp:
    """The ASGI app ``tinyloop.http:app``: ``tinyloop.server.lazy_app()``, built on the first ASGI call (the
    lifespan startup), so importing this package reads no variable and builds nothing.

    It must be a real name in this module: hypercorn resolves ``module:name`` with
    ``eval(name, vars(module))``, which never consults a module ``__getattr__``.
    """

    def __init__(self) -> None:
        self._app: QuartTrio | None = None

    def get(self) -> QuartTrio:
        """The app (built now if it was not yet)."""
        if self._app is None:
            from tinyloop.server import lazy_app

            self._app = lazy_app()
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.get()(scope, receive, send)


app = _LazyApp()
