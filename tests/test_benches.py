"""Every benchmark in ``bench/`` still runs: ``run_all.py``'s smoke sizes (seconds each), so a
change that breaks one fails here, not at the next full run (the KV pool's null block once
broke ``kv_modes.py``'s byte count unnoticed). Timings are never checked: speed lives in the
benches' own tables.

The smoke run takes a minute or two of one core, mostly in processes that wait on each other;
``tests/conftest.py`` starts it (``SMOKE.start``) when the session has collected its test, so it
runs beside the first modules of the suite, and the test collects its result.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

from tests.bench_scripts import load

ROOT = Path(__file__).resolve().parents[1]
# smoke-run by their own tests: tests/test_bundled_model.py, tests/cpu/test_cpu_kernels.py, below
SMOKED_ELSEWHERE = {"demo_model", "decode_attention", "structured"}  # structured: below, its tables checked


def bench_names() -> list[str]:
    return [name for name in load("run_all").BENCHES if name not in SMOKED_ELSEWHERE]


class SmokeRun:
    """``run_all.py --quick`` over every bench here, in the background: ``start`` once, then
    ``result`` waits for it (``close`` ends one nobody collected)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] | None = None

    def start(self) -> None:
        if self._process is not None:
            return
        self._output = tempfile.TemporaryFile()  # not a pipe: nobody reads it until the end
        self._process = subprocess.Popen([sys.executable, str(ROOT / "bench" / "run_all.py"), "--quick",
                                          "--threads", "1", "--only", *bench_names()],
                                         stdout=self._output, stderr=subprocess.STDOUT, cwd=ROOT)

    def result(self, timeout: float) -> tuple[int, str]:
        self.start()
        assert self._process is not None and self._output is not None
        try:
            code = self._process.wait(timeout=timeout)
            self._output.seek(0)
            return code, self._output.read().decode(errors="replace")
        finally:
            self.close()

    def close(self) -> None:
        """End the run if it still goes, and drop its output."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._output is not None:
            self._output.close()


SMOKE = SmokeRun()


@pytest.mark.slow
def test_every_benchmark_runs_at_smoke_sizes() -> None:
    names = bench_names()
    assert {"overhead", "engine_vs_hf", "batching", "kv_modes", "speculative", "prefix"} <= set(names)
    code, output = SMOKE.result(timeout=900)
    assert code == 0, output[-6000:]
    for name in names:
        assert f"=== {name}: exit 0" in output, name


@pytest.mark.slow
def test_structured_outputs_benchmark_runs_at_smoke_size() -> None:
    # its own smoke run (run_all.py lists it for full runs), both tables printed
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "structured.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "JSON-schema tok/s" in done.stdout and "| llguidance |" in done.stdout
