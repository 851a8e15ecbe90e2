"""``CpuBackend``: the model's ``Backend`` seam (``tinyloop/model/backend.py``) with decode
attention on this package's C kernel (``kernels.py``), everything else torch.

A decode step's attention on torch gathers every key's K and V out of the paged pool into a
fresh tensor (``index_select``), then runs SDPA on the copy. The K and V a layer wrote one step
ago are cold by then (the step streams the weights through the cache in between), so at 16 rows
the gathers and SDPA cost about as much as the rest of the step's work outside the matrix
products, and more as the context grows. The kernel reads each key's K and V once, in place.

It covers a float32 full-mode pool on the CPU; any other call (int4 or h-mode, another dtype,
a kernel that cannot be built here) runs the torch reference.

    use_cpu_kernels(model)   # what ``Engine`` does for a CPU model (``cpu_kernels=True``)
"""

from __future__ import annotations

import torch

from tinyloop.cpu import kernels
from tinyloop.model.backend import TorchBackend
from tinyloop.model.kvstore import KVStore, PlainBuffer
from tinyloop.model.looped import LoopedLM

__all__ = ["CpuBackend", "CPU", "use_cpu_kernels"]


class CpuBackend(TorchBackend):
    name = "cpu"

    def decode_attention(self, store: KVStore, q: torch.Tensor, rows: torch.Tensor, n_keys: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        k, v = store.fields.get("k"), store.fields.get("v")
        if (not isinstance(k, PlainBuffer) or not isinstance(v, PlainBuffer) or q.device.type != "cpu"
                or q.dtype != torch.float32 or k.data.dtype != torch.float32):
            return super().decode_attention(store, q, rows, n_keys, mask)
        r, hq, _, d = q.shape
        out = kernels.decode_attention(q.reshape(r, hq, d).contiguous(), k.data, v.data, rows.contiguous(),
                                       n_keys.contiguous())
        return out.view(r, hq, 1, d)


CPU = CpuBackend()


def use_cpu_kernels(model: LoopedLM) -> bool:
    """Run ``model``'s decode attention on the C kernel (building it if need be) when the model
    is on the CPU and the kernel builds here; True when it does."""
    if next(model.parameters()).device.type != "cpu" or not kernels.available():
        return False
    model.use_backend(CPU)
    return True
