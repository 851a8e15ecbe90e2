"""Every benchmark in ``bench/`` still runs: ``run_all.py``'s smoke sizes (seconds each), so a
change that breaks one fails here, not at the next full run (the KV pool's null block once
broke ``kv_modes.py``'s byte count unnoticed). Timings are never checked: speed lives in the
benches' own tables."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# smoke-run by their own tests: tests/test_bundled_model.py, tests/cpu/test_cpu_kernels.py, below
SMOKED_ELSEWHERE = {"demo_model", "decode_attention", "structured"}  # structured: below, its tables checked


def bench_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [name for name in module.BENCHES if name not in SMOKED_ELSEWHERE]


@pytest.mark.slow
def test_every_benchmark_runs_at_smoke_sizes() -> None:
    names = bench_names()
    assert {"overhead", "engine_vs_hf", "batching", "kv_modes", "speculative", "prefix"} <= set(names)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run_all.py"), "--quick", "--threads", "1",
                           "--only", *names], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for name in names:
        assert f"=== {name}: exit 0" in done.stdout, name


@pytest.mark.slow
def test_structured_outputs_benchmark_runs_at_smoke_size() -> None:
    # its own smoke run (run_all.py lists it for full runs), both tables printed
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "structured.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "JSON-schema tok/s" in done.stdout and "| llguidance |" in done.stdout
