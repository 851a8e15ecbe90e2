"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tinyloop.cpu import kernels
from tinyloop.model.artifact import save_artifact
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.tokenizer import default_tokenizer


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the benchmarks' smoke run now when the session runs its test (``tests/test_benches.py``)."""
    if any(item.nodeid.endswith("test_benches.py::test_every_benchmark_runs_at_smoke_sizes") for item in session.items):
        from tests.test_benches import SMOKE

        SMOKE.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.test_benches import SMOKE

    SMOKE.close()  # a session that stopped early (-x, Ctrl-C) leaves no bench running


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``tiny`` preset artifact (seed 0, the default tokenizer), written once per session.

    Read-only: a test that needs to damage or rewrite an artifact copies it first.
    """
    path = tmp_path_factory.mktemp("artifacts") / "tiny.tinyloop"
    save_artifact(path, init_model(PRESETS["tiny"], seed=0), default_tokenizer())
    return path


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run every test on one torch thread, then restore the count. Tiny matmuls gain nothing from
    a second thread, and on a shared CPU two OpenMP threads spin against each other (4-10x
    slower measured beside a training job; the suite always has a neighbour, the benchmarks'
    smoke run). A test about threads sets its own count (``tests/model/test_cpu_linear.py``),
    and a count a test leaves behind (``load_engines`` sets the engines') is not passed on."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_kernel_thread() -> Iterator[None]:
    """Put the C kernels back on one thread after a test that served (``load_engines`` gives them
    every core), so the rest of the suite runs as it would alone."""
    yield
    if kernels.loaded() and kernels.threads() != 1:
        kernels.set_threads(1)
