"""Pure pieces of one training step: the loop-count draw, the composed forward, the LR schedule.

The training forward composes ``LoopedLM``'s own modules (embed, prelude, inject + core, tail)
on a ``FullContext`` instead of calling ``LoopedLM.forward``, for two reasons: the earlier loops
run under ``torch.no_grad()`` (truncated backprop through the last ``k`` loops, as Huginn
trains), and the initial state is drawn for the whole batch at once rather than per position.
With ``backprop >= loops`` and ``state_init`` zeros or embed it computes exactly what
``LoopedLM.forward(tokens, FullContext(...), [RowSpec(loops, loops)] * B, last_only=False)``
does; the tests hold it to that.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tinyloop.model.context import FullContext
from tinyloop.model.looped import LoopedLM

__all__ = ["sample_loops", "train_forward", "lm_loss", "lr_at"]


def sample_loops(seed: int, step: int, mean: float, max_loops: int, sigma: float = 0.5) -> int:
    """Huginn's heavy-tailed draw: ``1 + Poisson(tau)``, ``tau ~ LogNormal`` with mean ``mean - 1``.

    Clipped to ``1..max_loops``; a pure function of ``(seed, step)`` so a resumed run agrees.
    """
    rng = np.random.default_rng([seed, 4, step])
    mu = math.log(max(mean - 1.0, 1e-6)) - sigma ** 2 / 2
    tau = rng.lognormal(mu, sigma)
    return int(min(max(1 + rng.poisson(tau), 1), max_loops))


def _initial_state(model: LoopedLM, e: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    c = model.config
    if c.state_init == "zeros":
        return torch.zeros_like(e)
    if c.state_init == "embed":
        return e.clone()
    # randn: one truncated-normal draw for the whole batch (not LoopedLM's per-position seeding,
    # which is exact for serving but far too slow to run per training step)
    noise = torch.randn(e.shape, generator=generator).clamp_(-3.0, 3.0) * c.state_init_std
    return noise.to(e.dtype)


def _loop(model: LoopedLM, s: torch.Tensor, e: torch.Tensor, ctx: FullContext,
          slots: torch.Tensor) -> torch.Tensor:
    c = model.config
    h = model.inject(s, e)
    for i, layer in enumerate(model.core):
        h = layer(h, ctx, model.rope, None, slots + i)
    return model.final_norm(h) if c.loop_norm == "every_loop" else h


def train_forward(model: LoopedLM, tokens: torch.Tensor, loops: int, backprop: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """tokens ``[B, T]`` -> logits ``[B, T, V]``; gradients flow through the last ``backprop`` loops.

    The prelude still gets gradients through the injection in those loops.
    """
    c = model.config
    bsz, n_tok = tokens.shape
    ctx = FullContext(model.rope, bsz, n_tok)
    x = model.embed(tokens)  # [B, T, H]
    if c.embed_scale != 1.0:
        x = x * c.embed_scale
    for i, layer in enumerate(model.prelude):
        x = layer(x, ctx, model.rope, None, torch.full((bsz,), i, dtype=torch.long))
    e = x  # [B, T, H]
    s = _initial_state(model, e, generator)
    slots = torch.full((bsz,), c.n_prelude, dtype=torch.long)  # FullContext ignores slots
    n_free = max(loops - backprop, 0)
    if n_free:
        with torch.no_grad():
            for _ in range(n_free):
                s = _loop(model, s, e, ctx, slots)
        s = s.detach()
    for _ in range(loops - n_free):
        s = _loop(model, s, e, ctx, slots)
    windows = torch.full((bsz,), loops, dtype=torch.long)
    return model.tail(s, ctx, windows, None, last_only=False)  # [B, T, V]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in float32; logits ``[B, T, V]``, targets ``[B, T]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine down to ``peak * min_ratio``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
