"""Where a server's own log lines go: the ``tinyloop`` logger (its banner, shutdown steps and,
with ``--access-log``, one line per request) to stderr at INFO, formatted as hypercorn formats its
error log, so that TinyLoop's lines and hypercorn's read as one log.

Only the entry points call ``log_to_stderr`` (``tinyloop serve``, the lazily built app that
``hypercorn 'tinyloop.http:app'`` serves): a program that embeds the runtime keeps its own
logging configuration.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["FORMAT", "DATE_FORMAT", "log_to_stderr"]

FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] %(message)s"  # hypercorn's
DATE_FORMAT = "[%Y-%m-%d %H:%M:%S %z]"


def log_to_stderr(level: int = logging.INFO) -> None:
    """Send the ``tinyloop`` logger's records at ``level`` and above to stderr; nothing when it
    already has a handler (a second call, or one the embedding program set up)."""
    logger = logging.getLogger("tinyloop")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
