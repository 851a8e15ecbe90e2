"""Every kernel source compiles for sm_90 without a device: with nvcc where the toolkit is
installed, with NVRTC where CuPy and the NVRTC wheel are. Each skips cleanly without its tool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tinyloop.cuda import cupy_available, loader

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).is_file()), None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_every_kernel_compiles_with_nvcc_for_sm_90(tmp_path: Path) -> None:
    """One translation unit of every source (``#line`` markers name the failing file): nvcc
    starts once, so the suite pays about a second for it."""
    assert NVCC is not None
    src = tmp_path / "kernels.cu"
    src.write_text(loader.bundle(loader.KERNELS))
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Werror", "all-warnings", "-o",
                           str(tmp_path / "kernels.cubin"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "kernels.cubin").stat().st_size > 0


@pytest.mark.skipif(not cupy_available(), reason="CuPy not installed")
@pytest.mark.parametrize("name", loader.KERNELS)
def test_every_kernel_compiles_with_nvrtc_for_sm_90(name: str, tmp_path: Path) -> None:
    if not loader.include_dirs():
        pytest.skip("no CUDA headers (cuda_fp16.h): install nvidia-cuda-runtime")
    try:
        import cupy_backends.cuda.libs.nvrtc  # noqa: F401
    except Exception as exc:  # no libnvrtc: the NVRTC wheel is missing
        pytest.skip(f"NVRTC unavailable: {exc}")
    path = loader.cached_cubin(name, "sm_90", directory=tmp_path)
    assert path.stat().st_size > 0
