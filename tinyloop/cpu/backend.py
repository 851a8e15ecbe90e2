"""``CpuBackend``: the model's ``Backend`` seam (``tinyloop/model/backend.py``) with decode
attention, KV writes (float32 rows copied, 4-bit quantized) and RMSNorm on this package's C
kernels (``kernels.py``), everything else torch. Each falls back to the torch reference off the
cases it covers. ``use_cpu_kernels`` also gives the model's packed float32 weights
(``cpu_linear.PackedWeight``) and int8 and int4 weights (``quant.QuantWeight``) their panel
copies, so products of a few rows run on ``kernels.panel_matmul``.

RMSNorm: torch runs ``F.rms_norm`` on the CPU as six ops, about 12 us a call at decode sizes
against 2-3 us for the kernel, and a looped model normalises four times a layer application
(sandwich blocks): about a millisecond of a ``small`` decode step.

A decode step's attention on torch gathers every key's K and V out of the paged pool into a
fresh tensor (``index_select``), then runs SDPA on the copy. The K and V a layer wrote one step
ago are cold by then (the step streams the weights through the cache in between), so at 16 rows
the gathers and SDPA cost about as much as the rest of the step's work outside the matrix
products, and more as the context grows. The kernel reads each key's K and V once, in place.

It covers a pool that stores K and V on the CPU for a float32 model: in float32 (full mode) or
4-bit (int4 mode, dequantized row by row as it is read); any other call (h-mode, another dtype,
a kernel that cannot be built here) runs the torch reference.

    use_cpu_kernels(model)   # what ``Engine`` does for a CPU model (``cpu_kernels=True``)
"""

from __future__ import annotations

import torch

from tinyloop.cpu import kernels
from tinyloop.cpu.block import FusedBlock
from tinyloop.cpu.step import FusedStep
from tinyloop.model.backend import TORCH, TorchBackend
from tinyloop.model.cpu_linear import PackedWeight, packed_weights
from tinyloop.model.kvstore import Int4Buffer, KVStore, PlainBuffer
from tinyloop.model.layers import Block
from tinyloop.model.looped import LoopedLM
from tinyloop.model.quant import QuantWeight, quant_weights

__all__ = ["CpuBackend", "CPU", "use_cpu_kernels"]


_F32 = torch.float32


def _norm_covered(x: torch.Tensor, weight: torch.Tensor) -> bool:  # (called 4x a layer: the cheap checks)
    return (x.dtype is _F32 and weight.dtype is _F32 and x.is_cpu and x.is_contiguous() and weight.is_contiguous()
            and weight.numel() == x.shape[-1])


# A prefill's rows (a few and more): the residual joins and SwiGLU in one threaded C pass each
# (py-spy: 14% of a base100m prefill as torch's ops); a decode step's few rows stay on torch's.
_THREADED_ROWS = 8


class CpuBackend(TorchBackend):
    name = "cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _norm_covered(x, weight):
            return super().rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)

    def rms_norm_cast_first(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _norm_covered(x, weight):  # in float32 the cast between the two is no cast
            return super().rms_norm_cast_first(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)

    def residual_norm(self, x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                      style: str, eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # (in float32 cast_first's norm is the plain one: no cast between)
        rows = x.numel() // max(x.shape[-1], 1)
        covered = (rows >= _THREADED_ROWS and x.dtype is _F32 and x.is_cpu and x.is_contiguous() and a.shape == x.shape
                   and a.dtype is _F32 and a.is_cpu and a.is_contiguous() and (style == "pre_ln" or w_in is not None)
                   and all(_norm_covered(x, w) for w in (w_in, w_out) if w is not None))
        if not covered:
            return super().residual_norm(x, a, w_in, w_out, style, eps, cast_first)
        return kernels.residual_norm(x, a, w_in, w_out, style, eps)

    def swiglu(self, fc: torch.Tensor) -> torch.Tensor:
        rows = fc.numel() // max(fc.shape[-1], 1)
        if rows < _THREADED_ROWS or fc.dtype is not _F32 or not fc.is_cpu or not fc.is_contiguous() or fc.shape[-1] % 2:
            return super().swiglu(fc)
        return kernels.swiglu(fc)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        # cos and sin [R or 1, 1, T, D] (one table for every head) or [R or 1, T, D], contiguous:
        # the same memory as [R or 1, T, D], read so (no view made: a view costs more than the op)
        xs, cs = x.shape, cos.shape
        covered = (x.dtype is _F32 and cos.dtype is _F32 and sin.dtype is _F32 and x.is_cpu and len(xs) == 4
                   and cs == sin.shape and cs[-2:] == xs[2:] and (len(cs) == 3 or len(cs) == 4 and cs[1] == 1)
                   and cs[0] in (1, xs[0]) and xs[3] % 2 == 0 and cos.is_contiguous() and sin.is_contiguous())
        if not covered:
            return super().rope(x, cos, sin, style)
        return kernels.rope(x, cos, sin, style == "half")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None and q.shape[-2] > 1 and kernels.causal_covered(q, k, v):  # a first prefill chunk
            return kernels.causal_attention(q, k, v)
        return super().attention(q, k, v, mask)

    def kv_write(self, store: KVStore, rows: torch.Tensor, **values: torch.Tensor) -> None:
        fields = store.fields
        if not all(values[name].dtype == torch.float32 and values[name].is_cpu for name in fields):
            return super().kv_write(store, rows, **values)
        if all(isinstance(f, Int4Buffer) and f.codes.device.type == "cpu" for f in fields.values()):
            rows = rows.contiguous()
            for name, f in fields.items():
                assert isinstance(f, Int4Buffer)
                x = values[name].contiguous()
                kernels.quantize_int4_rows(x.view(x.shape[0], -1), rows, f.codes, f.meta, f.group)
            return None
        plain = all(isinstance(f, PlainBuffer) and f.data.dtype == torch.float32 and f.data.is_cpu
                    and f.data.is_contiguous() for f in fields.values())
        if plain and rows.dtype == torch.long:
            rows = rows.contiguous()  # (a batch's rows are a strided column of its context's table)
            for name, f in fields.items():  # (each value read in place: no op added to the step)
                assert isinstance(f, PlainBuffer)
                kernels.write_rows(values[name], rows, f.data)
            return None
        return super().kv_write(store, rows, **values)

    def decode_attention(self, store: KVStore, q: torch.Tensor, rows: torch.Tensor, n_keys: torch.Tensor,
                         mask: torch.Tensor | None, tree: torch.Tensor | None = None) -> torch.Tensor:
        k, v = store.fields.get("k"), store.fields.get("v")
        if q.device.type != "cpu" or q.dtype != torch.float32 or tree is not None:  # (a tree: torch's, by mask)
            return super().decode_attention(store, q, rows, n_keys, mask, tree)
        rows, n_keys = rows.contiguous(), n_keys.contiguous()  # (q: read in place, row by row)
        if isinstance(k, PlainBuffer) and isinstance(v, PlainBuffer) and k.data.dtype == torch.float32:
            return kernels.decode_attention(q, k.data, v.data, rows, n_keys)
        if isinstance(k, Int4Buffer) and isinstance(v, Int4Buffer) and k.meta.dtype == torch.float16:
            return kernels.decode_attention_int4(q, (k.codes, k.meta), (v.codes, v.meta), rows, n_keys, k.group)
        return super().decode_attention(store, q, rows, n_keys, mask)


CPU = CpuBackend()


def use_cpu_kernels(model: LoopedLM, on: bool = True, fused: bool = True) -> bool:
    """Run ``model``'s decode attention, 4-bit KV writes, RMSNorm and few-row products (of its
    packed weights: ``cpu_linear.pack_linears`` first) on the C kernels (building them if need
    be) when the model is on the CPU and they build here; True when they do. ``on=False`` puts a
    model this backend was given back on torch's (a model shared by engines of both settings
    follows the last one built). ``fused``: each covered block's decode step as one call
    (``cpu.block.FusedBlock``)."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not on or next(model.parameters()).device.type != "cpu" or not kernels.available():
        if model.backend is CPU:
            model.use_backend(TORCH)
        _set_panels(model, False)
        for block in blocks:
            block.fused = None
        model.fused_step = None
        return False
    model.use_backend(CPU)
    _set_panels(model, True)
    for block in blocks:
        block.fused = FusedBlock.for_block(block) if fused else None
    model.fused_step = FusedStep.for_model(model) if fused and isinstance(model, LoopedLM) else None
    return True


def _set_panels(model: LoopedLM, on: bool) -> None:
    """Give every packed float32 and quantized weight of ``model`` its panels (kept where it has
    them; the float32 ones packed together, on huge pages where the OS gives them:
    ``kernels.pack_panels_all``; int8, int4 and bf16 ones each in its own layout), or drop them.
    Where the kernels run on at least torch's threads the float32 weights' oneDNN blocked copies
    go (the panels serve prefill too); they come back with the panels off."""
    packed, quants = packed_weights(model), quant_weights(model)
    weights: list[PackedWeight | QuantWeight] = [*packed, *quants]
    for one in packed:  # on as many threads as torch the panels serve every row count
        one.set_blocked(not (on and kernels.covers_torch()))
    if not on:
        for weight in weights:
            weight.panels = None
        return
    todo = [w for w in packed if w.panels is None]
    for weight, panels in zip(todo, kernels.pack_panels_all([w.panel_source for w in todo]), strict=True):
        weight.panels = panels
    for quant in quants:  # int8, int4 and bf16: their own layouts (qmatmul.c)
        quant.set_panels(True)
