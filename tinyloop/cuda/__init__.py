"""CUDA kernels for the looped decode hot path, compiled at run time with CuPy (NVRTC).

- ``*.cu``: the kernel sources (package data; ``common.cu`` is put in front of each)
- ``loader``: NVRTC compile for the device's architecture, an on-disk cubin cache, module load
- ``launch``: grid, block and shared-memory arithmetic (pure Python, tested without a GPU)
- ``reference``: the torch reference each kernel is checked against
- ``kernels``: the wrappers (torch CUDA tensors in and out)

Importing this package imports neither CuPy nor anything that needs a GPU. Without CuPy, an
NVIDIA device and the NVRTC wheel (``pip install "tinyloop[cuda]"``) the wrappers cannot run.
"""

from __future__ import annotations

import importlib.util

__all__ = ["cupy_available", "gpu_available"]


def cupy_available() -> bool:
    """Whether CuPy is installed (importable); says nothing about a device."""
    return importlib.util.find_spec("cupy") is not None


def gpu_available() -> bool:
    """Whether the kernels can run here: CuPy installed, torch and CuPy both see a CUDA device."""
    if not cupy_available():
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    import cupy

    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # a broken driver or runtime install: no device for us
        return False
