"""``CudaBackend``: the model's ``Backend`` seam (``tinyloop/model/backend.py``) on the kernels.

What is wired today: RMSNorm (both reference orders; alone, and fused with each block's residual
add and the norms around it), SwiGLU and RoPE (q and k together, in place, biases added) run on
this package's kernels, as do the new tokens' K and V stored in the pool (one kernel for
both, quantizing them for an int4 pool). Decode attention
over a pool that stores K and V in the model's dtype, or in int4 with fp16 group parameters
(dequantized in the read), runs on the paged decode kernel: ``decode_attention`` reads the pool
in place through the block tables behind the rows the context hands it (``reference.tables_of``),
one token a row or a few (a speculative verify: each over one key more, a tree's nodes over
their ancestors only);
``paged_attention`` reads through the tables themselves at fixed shapes (the step
``tinyloop/engine/graphs.py`` captures). h-mode's writes and reads and prefill's attention stay
with the torch reference, as does any call the kernels do not cover (a dtype
without a kernel, a tensor off CUDA).

    model.use_backend(CudaBackend())   # after model.to("cuda"); or use_cuda_kernels(model)
"""

from __future__ import annotations

import torch

from tinyloop.cuda import gpu_available, kernels
from tinyloop.cuda.reference import tables_of
from tinyloop.errors import ConfigError
from tinyloop.model.backend import TorchBackend
from tinyloop.model.kvstore import Int4Buffer, KVStore, PlainBuffer

__all__ = ["CudaBackend", "use_cuda_kernels"]


def _covered(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in kernels.SUFFIX


class CudaBackend(TorchBackend):
    name = "cuda"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _covered(x) or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps, cast_first=False)

    def rms_norm_cast_first(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _covered(x) or weight.dtype != x.dtype:
            return super().rms_norm_cast_first(x, weight, eps)
        return kernels.rms_norm(x, weight, eps, cast_first=True)

    def residual_norm(self, x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                      style: str, eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = [w for w in (w_in, w_out) if w is not None]
        if not _covered(x) or a.dtype != x.dtype or any(w.dtype != x.dtype for w in weights):
            return super().residual_norm(x, a, w_in, w_out, style, eps, cast_first)
        return kernels.residual_rmsnorm(x.contiguous(), a.contiguous(), w_in, w_out, style, eps, cast_first)

    def swiglu(self, fc: torch.Tensor) -> torch.Tensor:
        if not _covered(fc) or fc.stride(-1) != 1:
            return super().swiglu(fc)
        return kernels.swiglu(fc)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        """x ``[R, H, T, D]`` -> a rotated copy, token-major (``[R, T, H, D]`` in memory): one
        kernel reads x where it lies when its tokens are evenly spaced (the heads of the fused
        projection ``Attention`` rotates together), else a token-major copy is rotated in place."""
        if not _covered(x) or cos.numel() != x.shape[0] * x.shape[2] * x.shape[3]:
            return super().rope(x, cos, sin, style)
        r, h, t, d = x.shape
        y = torch.empty((r, t, h, d), dtype=x.dtype, device=x.device)
        tokens = x.transpose(1, 2)  # [R, T, H, D]
        src = tokens.view(r * t, h, d) if _tokens_flat(tokens) else y.copy_(tokens).view(r * t, h, d)
        kernels.rope_(src, None, cos.reshape(r * t, d), sin.reshape(r * t, d), style, out=(y.view(r * t, h, d), None))
        return y.transpose(1, 2)

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
                q_bias: torch.Tensor | None, k_bias: torch.Tensor | None,
                compute_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Both rotated in place, biases added, by one kernel: q and k are views into the fused
        projection's output, read at their own strides (no copy, no cast)."""
        r, t = q.shape[:2]
        biases = [b for b in (q_bias, k_bias) if b is not None]
        if (not _covered(q) or k.dtype != q.dtype or any(b.dtype != q.dtype or not b.is_contiguous() for b in biases)
                or not all(_tokens_flat(x) for x in (q, k)) or cos.numel() != r * t * q.shape[-1]):
            return super().rope_qk(q, k, cos, sin, style, q_bias, k_bias, compute_float32)
        d = q.shape[-1]
        kernels.rope_(q.view(r * t, q.shape[2], d), k.view(r * t, k.shape[2], d), cos.reshape(r * t, d),
                      sin.reshape(r * t, d), style, q_bias, k_bias, compute_float32)
        return q.transpose(1, 2), k.transpose(1, 2)

    def kv_write(self, store: KVStore, rows: torch.Tensor, **values: torch.Tensor) -> None:
        """K and V into the pool in one kernel (torch: an index_put for each of the pool's
        tensors, and for an int4 pool about eighteen ops to quantize each of K and V); else torch's."""
        k, v = store.fields.get("k"), store.fields.get("v")
        nk, nv = values.get("k"), values.get("v")
        if (nk is None or nv is None or len(values) != 2 or not _covered(nk) or nv.dtype != nk.dtype
                or rows.dtype != torch.int64 or rows.dim() != 1 or nk.stride(-1) != 1 or nv.stride(-1) != 1):
            return super().kv_write(store, rows, **values)
        if isinstance(k, PlainBuffer) and isinstance(v, PlainBuffer) and k.data.dtype == v.data.dtype == nk.dtype:
            kernels.kv_write(nk, nv, k.data, v.data, rows)
        elif isinstance(k, Int4Buffer) and isinstance(v, Int4Buffer) and k.group == v.group:
            kernels.kv_write_int4(nk, nv, (k.codes, k.meta), (v.codes, v.meta), rows, k.group)
        else:
            return super().kv_write(store, rows, **values)
        return None

    def decode_attention(self, store: KVStore, q: torch.Tensor, rows: torch.Tensor, n_keys: torch.Tensor,
                         mask: torch.Tensor | None, tree: torch.Tensor | None = None) -> torch.Tensor:
        kv = _pool(store, q)
        if kv is None:
            return super().decode_attention(store, q, rows, n_keys, mask, tree)
        # token t of row r over its first n_keys[r] + t keys (a verify; decode: t = 0), a tree's
        # nodes over their ancestors only; the rows' key count bounds them: no host read
        return kernels.paged_decode_attention(q, *kv, tables_of(rows, store.block_size), n_keys, store.block_size,
                                              max_len=rows.shape[1], tree=tree)

    def paged_attention(self, store: KVStore, q: torch.Tensor, tables: torch.Tensor, n_keys: torch.Tensor,
                        max_keys: int) -> torch.Tensor:
        kv = _pool(store, q)
        if kv is None:
            return super().paged_attention(store, q, tables, n_keys, max_keys)
        r, hq, _, d = q.shape
        out = kernels.paged_decode_attention(q[:, :, 0], *kv, tables, n_keys, store.block_size, max_len=max_keys)
        return out.view(r, hq, 1, d)


def _tokens_flat(x: torch.Tensor) -> bool:
    """Whether ``[R, T, H, D]`` views as ``[R*T, H, D]`` in place (rows spaced by whole tokens), D contiguous."""
    return x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))


def _pool(store: KVStore, q: torch.Tensor) -> tuple[kernels.KVStoreArg, kernels.KVStoreArg] | None:
    """The pool's K and V as the attention kernel reads them (plain in q's dtype, or int4 with
    fp16 meta), or None where it has no kernel (h-mode, another dtype, q off CUDA)."""
    k, v = store.fields.get("k"), store.fields.get("v")
    if not _covered(q):
        return None
    if isinstance(k, PlainBuffer) and isinstance(v, PlainBuffer) and k.data.dtype == q.dtype:
        return k.data, v.data
    if isinstance(k, Int4Buffer) and isinstance(v, Int4Buffer) and k.meta.dtype == torch.float16:
        return (k.codes, k.meta), (v.codes, v.meta)
    return None


def use_cuda_kernels(model: torch.nn.Module) -> None:
    """Run ``model``'s norms, SwiGLU, RoPE and decode attention on the kernels
    (``Engine(cuda_kernels=True)``, ``TINYLOOP_CUDA_KERNELS``); ConfigError, saying what is
    missing, unless the model is on a CUDA device and CuPy sees one."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ConfigError(f"the CUDA kernels need the model on a CUDA device, not {device}")
    if not gpu_available():
        raise ConfigError("the CUDA kernels need CuPy and the NVRTC wheel: pip install -e \".[cuda]\" "
                          "(\".[cuda12]\" for a CUDA 12 driver)")
    model.use_backend(CudaBackend())  # type: ignore[operator]
