"""The kernel seam of the model forward: what the torch reference and a GPU backend both provide.

The model's weights and control flow (prelude, loops, exit rules, coda) are torch everywhere;
what a backend replaces is the work that dominates a looped model's serving cost: RMSNorm
(alone, and fused with a block's residual add), SwiGLU, RoPE, and attention over the paged KV
pool (writing the new positions' K and V, or h, into the slots of their block tables, reading
every key position back, attending under the causal or tree-verification mask).
``LoopedLM.use_backend`` routes every call of a model through one backend; ``PagedContext`` and
``FullContext`` take theirs from the engine (``Engine.context``). ``TorchBackend`` is the
reference every other backend is tested against.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tinyloop.model.kvstore import KVStore

__all__ = ["Backend", "TORCH", "TorchBackend"]


class Backend(Protocol):
    """The kernels a model forward calls (shapes as the torch reference uses them)."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x ``[..., H]`` normalised in float32, scaled by ``weight`` ``[H]``, in x's dtype."""
        ...

    def rms_norm_cast_first(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As ``rms_norm``, the reference order: x normalised in float32, cast to x's dtype, then
        scaled by ``weight``."""
        ...

    def residual_norm(self, x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                      style: str, eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A sublayer's output ``a`` joining the residual ``x`` (``[..., H]`` each) per block style:
        ``pre_ln`` r = x + a; ``peri_ln`` and ``post_ln`` r = x + N(a, w_in); ``sandwich``
        r = N(x + a, w_in); and the next norm y = N(r, w_out) (None without ``w_out``). N is
        ``rms_norm``, or ``rms_norm_cast_first`` with ``cast_first``."""
        ...

    def swiglu(self, fc: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused projection ``fc`` = ``[gate; up]`` ``[..., 2I]`` -> ``[..., I]``."""
        ...

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        """x ``[R, H, T, D]`` rotated by cos/sin ``[R, T, D]`` (or ``[R, 1, T, D]``, ready to
        broadcast over the heads); ``style`` ``half`` or ``interleaved``."""
        ...

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
                q_bias: torch.Tensor | None, k_bias: torch.Tensor | None,
                compute_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[R, T, Hq, D]`` and k ``[R, T, Hkv, D]`` straight from the projection: each bias
        (``[H, D]``) added, then rotated as ``rope`` (in float32 when ``compute_float32``, the
        result cast back); returned as ``[R, H, T, D]``. May rotate q and k in place."""
        ...

    def kv_write(self, store: KVStore, rows: torch.Tensor, **values: torch.Tensor) -> None:
        """Store ``values`` (``k`` and ``v`` ``[N, Hkv, D]``, or ``h`` ``[N, H]``) at pool rows ``[N]``."""
        ...

    def kv_read(self, store: KVStore, name: str, rows: torch.Tensor,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """What ``store`` keeps under ``name`` at ``rows`` (any shape), dequantized to ``dtype``."""
        ...

    def kv_copy(self, store: KVStore, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pool rows ``src`` to ``dst`` (``[N]`` each): an exited token's skipped slots."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """q ``[R, Hq, T, D]`` over k, v ``[R, Hkv, L, D]`` (GQA when Hkv < Hq); ``mask``
        ``[R, 1, T, L]``, boolean (True = may attend) or additive in q's dtype (0 or -inf), None
        for causal over ``T == L`` or, with one query (``T == 1``), every key."""
        ...

    def decode_attention(self, store: KVStore, q: torch.Tensor, rows: torch.Tensor, n_keys: torch.Tensor,
                         mask: torch.Tensor | None, tree: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a few new tokens a row (decode: one; a speculative verify: a few)
        over a pool that stores K and V (full or int4 mode, not h-mode): q ``[R, Hq, T, D]`` over
        the K and V ``store`` keeps at pool rows ``rows`` ``[R, L]``, row r's token t over its first
        ``n_keys[r] + t`` (``n_keys`` ``[R]`` int64, on the pool's device); ``mask``
        ``[R, 1, T, L]`` says the same (None: every key, or causal when T == L), for a backend
        that gathers. ``tree`` ``[R, T, T]`` bool (a tree's verify, on the pool's device): token t
        sees the row's new token j only where ``tree[r, t, j]``, as ``mask`` says too. ``[R, Hq, T, D]``."""
        ...

    def paged_attention(self, store: KVStore, q: torch.Tensor, tables: torch.Tensor, n_keys: torch.Tensor,
                        max_keys: int) -> torch.Tensor:
        """Decode attention through block tables, at fixed shapes and with no host read (what a
        CUDA graph captures): q ``[R, Hq, 1, D]``; ``tables`` ``[R, MB]`` each row's block ids in
        the slot it attends (padded with any block); row r over its first ``n_keys[r]`` keys,
        every one ``<= max_keys <= MB * block_size``. ``[R, Hq, 1, D]``."""
        ...


class TorchBackend:
    """The reference backend: plain torch ops, on whatever device the tensors are."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == weight.dtype == torch.float32:  # the same ops in one call (no casts to make)
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype)

    def rms_norm_cast_first(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return out * weight.to(x.dtype)

    def residual_norm(self, x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                      style: str, eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm = self.rms_norm_cast_first if cast_first else self.rms_norm
        if style == "pre_ln":
            r = x + a
        elif style == "sandwich":
            r = norm(x + a, w_in, eps)  # type: ignore[arg-type]
        else:  # peri_ln, post_ln
            r = x + norm(a, w_in, eps)  # type: ignore[arg-type]
        return r, None if w_out is None else norm(r, w_out, eps)

    def swiglu(self, fc: torch.Tensor) -> torch.Tensor:
        gate, up = fc.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if style == "half":
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat([-x2, x1], dim=-1)
        else:
            pairs = x.unflatten(-1, (-1, 2))  # type: ignore[no-untyped-call]  # [..., D/2, 2]
            rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        out: torch.Tensor = x * cos + rotated * sin
        return out

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
                q_bias: torch.Tensor | None, k_bias: torch.Tensor | None,
                compute_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        def one(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            x = (x if bias is None else x + bias).transpose(1, 2)  # [R, H, T, D]
            if compute_float32 and x.dtype != torch.float32:
                return self.rope(x.float(), cos, sin, style).to(x.dtype)
            return self.rope(x, cos, sin, style)
        return one(q, q_bias), one(k, k_bias)

    def kv_write(self, store: KVStore, rows: torch.Tensor, **values: torch.Tensor) -> None:
        store.write(rows, **values)

    def kv_read(self, store: KVStore, name: str, rows: torch.Tensor,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        return store.read(name, rows, dtype)

    def kv_copy(self, store: KVStore, src: torch.Tensor, dst: torch.Tensor) -> None:
        store.copy_rows(src, dst)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if mask is None:  # SDPA's causal mask is aligned top-left: one query would see key 0 only
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[-2] > 1, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def decode_attention(self, store: KVStore, q: torch.Tensor, rows: torch.Tensor, n_keys: torch.Tensor,
                         mask: torch.Tensor | None, tree: torch.Tensor | None = None) -> torch.Tensor:
        keys_k = self.kv_read(store, "k", rows, q.dtype).transpose(1, 2)  # [R, KVH, L, D]
        keys_v = self.kv_read(store, "v", rows, q.dtype).transpose(1, 2)
        return self.attention(q, keys_k, keys_v, mask)

    def paged_attention(self, store: KVStore, q: torch.Tensor, tables: torch.Tensor, n_keys: torch.Tensor,
                        max_keys: int) -> torch.Tensor:
        """``decode_attention`` over the pool rows of every table entry, the keys past each row's
        ``n_keys`` masked out (the reference: it reads ``max_keys`` keys a row whatever their count).
        A masked key is read from the row's first key instead of where its table points (the null
        block, which padding rows and held loops write): whatever they left there, even a NaN,
        cannot reach a real row through a zero weight."""
        bs = store.block_size
        offsets = torch.arange(bs, dtype=tables.dtype, device=tables.device)
        rows = (tables[:, :, None] * bs + offsets).flatten(1)[:, :max_keys]  # [R, L]
        seen = torch.arange(rows.shape[1], device=rows.device) < n_keys[:, None]  # [R, L]
        rows = torch.where(seen, rows, rows[:, :1])
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        return self.decode_attention(store, q, rows, n_keys.long(), mask[:, None, None])


TORCH: Backend = TorchBackend()
