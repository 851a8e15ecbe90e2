"""The CPU's own kernels: C compiled on first use where a compiler exists (``kernels.py``), behind
the model's ``Backend`` seam (``backend.CpuBackend``); torch ops everywhere else."""
