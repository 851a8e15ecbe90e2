"""Faster float32 linear layers on the CPU: the weight layouts decode reads fastest.

What a decode step costs on the CPU is its matrix products (about 90% of a step, measured with
``torch.profiler`` on the ``base100m`` preset), and torch's default ``F.linear`` on a row-major
``[N, K]`` weight is far from the memory bandwidth a memory-bound decode could reach:

- one row (batch-1 decode): MKL's matrix-vector product reads a column-major weight (``[K, N]``
  contiguous, i.e. ``x @ W_t``) 1.3-1.7x faster than the row-major one when it has at least as
  many outputs as inputs (q/k/v, o, gate/up, the LM head); with fewer (the MLP's down
  projection, the loop adapter) the row-major one is faster and stays;
- one row on two or more threads: MKL runs a matrix-vector product on one thread, so one core's
  bandwidth (about 20-25 GB/s here against 34 GB/s for two). The weights are then all
  column-major and the product is split along K into one slice per thread: a batched product
  (``torch.bmm`` of ``x`` viewed ``[P, 1, K/P]`` by ``W_t`` viewed ``[P, K/P, N]``, no copy) whose
  P partial sums add up; MKL runs the batch on the intra-op threads, 1.4-1.8x faster than one
  thread's product at every base100m and ``small`` shape (``bench/engine_vs_hf.py`` at 2 threads);
- 2 or more rows (batched decode, prefill): oneDNN on a weight reordered once into its blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing uses) runs
  1.5-2.2x faster than MKL on either plain layout.

``pack_linears(model)`` re-lays every float32 ``nn.Linear`` of a model on the CPU (and the tied
LM head) that way: the parameter itself is re-laid in place where that pays (same values, same
``Parameter``, no extra memory; ``F.linear`` on it takes the fast one-row path) and, where oneDNN is available,
a blocked copy serves calls of more than one row (one more copy of the weights in memory). The
results agree with ``F.linear`` to float32 rounding (the sums run in another order).

With the C kernels (``tinyloop/cpu``, ``Engine(cpu_kernels=True)``), each weight also gets a
copy in 16-column panels (``kernels.pack_panels``) and calls of 1 to 16 rows run on
``kernels.panel_matmul`` instead: one sequential, prefetched pass over the weight that keeps every
row's sums in registers. Measured on this machine's two cores (``bench/panel_matmul.py``), it
runs the ``small`` preset's products 1.2-2x faster than oneDNN's blocked kernel at 1-16 rows with
the weights out of cache (what a decode step sees), and 1-3x faster than the one-row paths
above, on one thread. Products of 4 rows and more (and of fewer rows over weights of 256 kB or
more) split their panels among the kernels' own threads (``kernels.set_threads``: helpers that
take tasks only while their core is free). Where the kernels run on fewer threads than torch
they serve only products small enough for torch's threads to cost more than they save
(``kernels.serves_rows``; on two threads, up to 2^24 multiply-adds: measured inside decode
steps). Where they run on at least torch's threads (the
server's default: torch keeps one core fewer), the panels replace the blocked copy
(``cpu.backend.use_cpu_kernels``): the kernel then runs prefill's products too, each chunk of
panels kept in L2 while every block of 16 rows passes over it, at 0.85-1.2x oneDNN's speed on
one thread (bench/LOG.md, 2026-12-01 00:33), and the weights are held twice, not three times.

The blocked and panel copies are made once: a model whose weights change afterwards must be
packed again (``pack_linears`` re-packs; ``unpack_linears`` drops the copies). The engine packs
its model when it is built (``Engine(..., pack_weights=...)``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyloop.cpu import kernels

__all__ = ["PackedWeight", "PackedLinear", "pack_linears", "unpack_linears", "packable", "onednn_available",
           "split_parts", "packed_weights", "packed_bytes"]

# The batch the blocked layout is chosen for: measured best over 2..16 rows (a hint to oneDNN;
# every row count runs on it).
_PACK_ROWS = 16
# The smallest weight (elements) whose one-row product is split over threads.
_SPLIT_MIN = 1 << 15


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear kernels ``PackedWeight`` uses."""
    built: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return built and all(hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))


def packable(weight: torch.Tensor) -> bool:
    """A float32 CPU matrix: the weights this module lays out."""
    return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"


def relayout(weight: torch.Tensor, split: bool = False) -> None:
    """Store ``weight`` ``[N, K]`` column-major in place (``weight.t()`` contiguous) when N >= K
    or the product is ``split`` over threads, else row-major: same values, the layout one-row
    products read fastest."""
    n, k = weight.shape
    if (n >= k or split) and not weight.t().is_contiguous():
        weight.data = weight.data.t().contiguous().t()
    elif n < k and not weight.is_contiguous():
        weight.data = weight.data.contiguous()


def split_parts(k: int) -> int:
    """Into how many K slices a one-row product of ``k`` inputs splits: the intra-op threads,
    fewer where they do not divide ``k`` (1: no split)."""
    parts = torch.get_num_threads()
    while k % parts:
        parts -= 1
    return parts


class PackedWeight:
    """A float32 weight in its one-row layout and, for calls of several rows, its oneDNN blocked copy."""

    __slots__ = ("weight", "blocked", "splittable", "_split", "panels", "_blockable")

    def __init__(self, weight: torch.Tensor, blocked: bool = True, split: bool | None = None) -> None:
        relayout(weight, torch.get_num_threads() > 1 if split is None else split)
        self.weight = weight
        # one-row products split over threads (split_parts) where the weight is column-major and
        # large enough to pay for the three more ops (measured: 1.4x faster at 256 x 256, slower below)
        self.splittable = weight.t().is_contiguous() and weight.numel() >= _SPLIT_MIN
        self._split: tuple[int, torch.Tensor] | None = None  # (parts, W_t viewed [P, K/P, N])
        self.blocked: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None  # the C kernels' layout, set by ``set_panels``
        self._blockable = blocked and onednn_available()
        self.set_blocked(True)

    def set_blocked(self, on: bool) -> None:
        """Make the oneDNN blocked copy (where oneDNN is built and the weight was packed with one),
        or drop it: with panels on at least torch's threads, the panel kernel serves every row count."""
        if on and self._blockable and self.blocked is None:
            with torch.no_grad():
                self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_ROWS)
        elif not on:
            self.blocked = None

    @property
    def panel_source(self) -> torch.Tensor:
        """What ``kernels.pack_panels`` lays out for this weight."""
        return self.weight.detach()

    def set_panels(self, on: bool) -> None:
        """Lay the weight out in panels for ``kernels.panel_matmul`` (the C kernels built), or
        drop them (``cpu.backend.use_cpu_kernels`` packs a model's weights together instead)."""
        self.panels = kernels.pack_panels(self.panel_source) if on else None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: a few rows on the panel kernel where the weight has
        panels (any number where it has no blocked copy); else one row on the re-laid weight
        (split over the threads where there are several), more on the blocked."""
        k, n = x.shape[-1], self.weight.shape[0]
        rows = x.numel() // k
        if self.panels is not None and x.dtype is torch.float32 and kernels.serves_rows(
                rows, n, k, any_rows=self.blocked is None):
            return kernels.panel_matmul(x.reshape(-1, k).contiguous(), self.panels, n, bias).view(*x.shape[:-1], n)
        if x.numel() <= k:
            parts = split_parts(k) if self.splittable and x.numel() == k else 1  # (not for no rows)
            if parts == 1:
                return F.linear(x, self.weight, bias)
            if self._split is None or self._split[0] != parts:
                weight_t = self.weight.t()
                self._split = parts, weight_t.view(parts, k // parts, weight_t.shape[1])
            chunks = self._split[1]
            y = torch.bmm(x.reshape(parts, 1, k // parts), chunks).sum(0)  # [1, N]: the partial sums added
            if bias is not None:
                y += bias
            return y.view(*x.shape[:-1], chunks.shape[2])
        if self.blocked is None:
            return F.linear(x, self.weight, bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.blocked, bias, "none", [], "")
        return out


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs on its ``PackedWeight`` (same parameters, same state
    dict; ``pack_linears`` turns a packable ``nn.Linear`` into one in place)."""

    packed: PackedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # as layers.HookFree: no hooks, 1-2 us less a call
        return self.packed.linear(x, self.bias)


def pack_linears(model: nn.Module, blocked: bool = True) -> int:
    """Lay out every packable ``nn.Linear`` of ``model`` (and the weight its ``head_weight``
    names, kept as its ``packed_head``) for fast CPU decode; returns how many weights it packed."""
    packed: dict[int, PackedWeight] = {}
    for module in model.modules():
        if type(module) is nn.Linear and packable(module.weight):  # a subclass keeps its forward
            weight = PackedWeight(module.weight, blocked)
            packed[id(module.weight)] = weight
            module.__class__ = PackedLinear
            setattr(module, "packed", weight)  # noqa: B010 (not an nn.Module attribute type)
    head = getattr(model, "head_weight", None)
    if isinstance(head, nn.Parameter) and packable(head):
        packed.setdefault(id(head), PackedWeight(head, blocked))
        setattr(model, "packed_head", packed[id(head)])  # noqa: B010
    return len(packed)


def unpack_linears(model: nn.Module) -> None:
    """Back to plain ``nn.Linear`` forwards (the weights keep their layout: same values)."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            del module.packed
            module.__class__ = nn.Linear  # type: ignore[assignment]
    if getattr(model, "packed_head", None) is not None:
        setattr(model, "packed_head", None)  # noqa: B010


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """Every ``PackedWeight`` of ``model`` (its packed linears' and its head's), each once."""
    weights: list[Any] = [m.packed for m in model.modules() if isinstance(m, PackedLinear)]
    weights.append(getattr(model, "packed_head", None))
    return list({id(p): p for p in weights if isinstance(p, PackedWeight)}.values())


def packed_bytes(model: nn.Module) -> int:
    """The memory the blocked and panel copies take (beyond the parameters)."""
    total = 0
    for p in packed_weights(model):
        if p.blocked is not None:
            total += p.weight.numel() * p.weight.element_size()
        if p.panels is not None:
            total += p.panels.numel() * p.panels.element_size()
    return total
