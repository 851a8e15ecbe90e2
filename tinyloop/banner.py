"""The block the server logs once it serves: what runs, where, with how much KV, and its URLs.

A pure function of the loaded engines, the served model, the settings and the bound addresses,
so a test reads it without starting anything; ``tinyloop.server.serve`` logs it at INFO.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings
from tinyloop.version import package_version
from tinyloop.vocabulary import kv_slots_per_token

if TYPE_CHECKING:
    from tinyloop.engine.engine import Engine

__all__ = ["banner", "browser_url"]

# a bind on every interface is reached from this machine through loopback
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}


def browser_url(bind: str) -> str:
    """``bind`` (``http://host:port``) as a browser on this machine opens it."""
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{_WILDCARDS.get(host, host)}:{port}"


def banner(engines: Sequence[Engine], model: ServedModel, settings: Settings, binds: Sequence[str],
           path: str | None = None, playground: bool = True) -> str:
    """The startup block: the version and model (``path``: its artifact, when known), the
    engines' device, dtype, weights and KV mode, their batch and KV pool, the context, the
    listening URLs and the playground's (``playground``: the page is installed)."""
    first = engines[0]
    devices = ", ".join(dict.fromkeys(str(e.device) for e in engines))
    lines = [f"TinyLoop {package_version()} serving {model.id}" + (f" ({path})" if path else ""),
             f"  device {devices}; dtype {str(first.dtype).removeprefix('torch.')}, weights {first.weights}, "
             f"KV cache {first.kv_mode.name}",
             f"  engines {len(engines)}; max batch {settings.max_batch_size} per engine, "
             f"queue depth {settings.max_queue_depth}",
             f"  KV pool {_kv_pool(first)} per engine",
             f"  context {model.max_seq_len} tokens; {_own_context(model)}"]
    lines += [f"  listening on {bind}" for bind in binds]
    if binds and playground:
        lines.append(f"  playground {browser_url(binds[0])}/")
    return "\n".join(lines)


def _kv_pool(engine: Engine) -> str:
    """Blocks, what they hold at the default loops, and their memory."""
    stats = engine.pool.statistics()
    loops = engine.default_loops
    slots = kv_slots_per_token(engine.config, loops, loops)
    tokens = stats.blocks_total // slots * stats.block_size
    mib = stats.blocks_total * stats.bytes_per_block / 2**20
    return (f"{stats.blocks_total:,} blocks of {stats.block_size} tokens: {tokens:,} tokens at {loops} loops, "
            f"{mib:,.1f} MiB")


def _own_context(model: ServedModel) -> str:
    own = model.trained_context
    if own is None:
        return "the model's own is not known (a request without max_tokens may use all of it)"
    if own < model.max_seq_len:
        return f"the model was built for {own} (a request without max_tokens stops there)"
    return f"the model was built for {own}"
