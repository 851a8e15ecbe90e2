"""``CudaBackend``: the model's ``Backend`` seam (``tinyloop/model/backend.py``) on the kernels.

What is wired today: RMSNorm (both reference orders) and RoPE run on this package's kernels;
KV writes and reads and attention stay with the torch reference, decode attention included
(``decode_attention`` gets the pool rows of every key from the context, what the paged decode
kernel needs to read the pool in place: not wired yet). Any call
the kernels do not cover (a dtype without a kernel, a tensor off CUDA) falls back to torch.

    model.use_backend(CudaBackend())   # after model.to("cuda")
"""

from __future__ import annotations

import torch

from tinyloop.cuda import kernels
from tinyloop.model.backend import TorchBackend

__all__ = ["CudaBackend"]


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

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        """x ``[R, H, T, D]`` -> a rotated copy: token-major ``[R*T, H, D]`` for the kernel."""
        if not _covered(x):
            return super().rope(x, cos, sin, style)
        r, h, t, d = x.shape
        y = x.transpose(1, 2).contiguous()  # [R, T, H, D]
        kernels.rope_(y.view(r * t, h, d), None, cos.reshape(r * t, d), sin.reshape(r * t, d), style)
        return y.transpose(1, 2)
