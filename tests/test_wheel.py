"""What a user's install gets: the wheel built from this checkout, installed into a fresh virtual
environment and run from outside the checkout; and the C kernels' fallback where there is no C
compiler (an install needs none).

The virtual environment takes its dependencies from this one (``--system-site-packages``, the
wheel installed with ``--no-deps``): nothing is downloaded, and the wheel is what is tested.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinyloop"
STARTUP_S = 90  # a cold Python + torch import under a loaded CI machine
# what the package ships beside its code (pyproject's package-data): a checkout has these files,
# and a wheel that lost one still imports but serves no playground, builds no kernel, has no model
DATA_GLOBS = ("web/*", "data/*", "cuda/*.cu", "cpu/*.c", "cpu/*.h", "py.typed")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without TINYLOOP_* and PYTHONPATH: nothing points back at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_") and k != "PYTHONPATH"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the checkout (setuptools writes ``build/`` and an egg-info
    beside the sources; the checkout stays as it is)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(PACKAGE, src / "tinyloop", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [built] = out.glob("tinyloop-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed; its ``bin`` folder."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(home)], check=True)
    bindir = home / "bin"
    done = subprocess.run([str(bindir / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                           str(wheel)], capture_output=True, text=True, check=False, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return bindir


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory outside the checkout, so ``import tinyloop`` cannot find it from the cwd."""
    assert not tmp_path.is_relative_to(ROOT)
    return tmp_path


def test_the_wheel_holds_the_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for pattern in DATA_GLOBS:
        shipped = sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.glob(pattern))
        assert shipped, pattern  # the checkout has some: the glob is not vacuous
        assert set(shipped) <= names, (pattern, sorted(set(shipped) - names))
    assert {"tinyloop/data/demo.tinyloop", "tinyloop/web/index.html", "tinyloop/cpu/kernels.c"} <= names
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]


def test_the_installed_wheel_imports_from_the_venv(venv: Path, outside: Path) -> None:
    script = ("import tinyloop, tinyloop.cpu.kernels as k; from tinyloop.settings import Settings; "
              "print(tinyloop.__file__); print(k.SOURCE); print(Settings().resolve_model_path())")
    done = subprocess.run([str(venv / "python"), "-c", script], cwd=outside, env=clean_env(),
                          capture_output=True, text=True, check=True)
    paths = [Path(line) for line in done.stdout.splitlines()]
    assert len(paths) == 3
    for path in paths:  # the package, the kernels' source and the bundled model: the venv's copies
        assert path.is_relative_to(venv.parent), (path, venv.parent)
        assert path.is_file()


def test_the_installed_cli_reports_the_projects_version(venv: Path, outside: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([str(venv / "tinyloop"), "--version"], cwd=outside, env=clean_env(),
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith(f"tinyloop {version}"), done.stdout


@pytest.fixture
def served(venv: Path, outside: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """``tinyloop serve`` from the venv on the bundled model, on a port the OS picks; stopped
    (and reaped) when the test ends."""
    log = outside / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(venv / "tinyloop"), "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--threads", "1"], cwd=outside, env=clean_env(OMP_NUM_THREADS="1"),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, _wait_serving(proc, log), log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _wait_serving(proc: subprocess.Popen[bytes], log: Path) -> str:
    """The address the server announces once it serves (``--port 0``: the OS chose it)."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if (found := re.search(r"serving on (http://127\.0\.0\.1:\d+)", log.read_text())) is not None:
            return found[1]
        assert proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"not serving after {STARTUP_S} s:\n{log.read_text()}")


def test_the_installed_server_serves_the_bundled_model(served: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    proc, url, log = served
    with httpx.Client(base_url=url, timeout=60) as client:
        health = client.get("/healthz")
        assert (health.status_code, health.text) == (200, "ok\n")
        resp = client.post("/generate", json={"prompt": "def fibonacci(n):", "max_tokens": 4, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert len(body["tokens"]) == 4 and body["text"].strip()
        [model] = client.get("/v1/models").json()["data"]
        assert model["id"] == "demo"  # the bundled artifact's name
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()


def test_without_a_c_compiler_the_kernels_say_so_once_and_torch_generates(outside: Path) -> None:
    """No compiler anywhere (an empty PATH, the named ones missing): ``tinyloop generate`` still
    generates on the torch reference, and the log says why in one line, without a traceback."""
    empty = outside / "bin"
    empty.mkdir()
    env = clean_env(PATH=str(empty), TINYLOOP_CC=str(outside / "no-cc"), CC=str(outside / "no-cc"),
                    TINYLOOP_CPU_CACHE=str(outside / "cache"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tinyloop.cli", "generate", "--prompt", "def fibonacci(n):",
                           "--max-tokens", "3", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=STARTUP_S, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completion_tokens"] == 3
    notices = [line for line in done.stderr.splitlines() if "kernels" in line.lower()]
    assert len(notices) == 1, done.stderr
    assert "CPU kernels unavailable" in notices[0] and "no C compiler" in notices[0]
    assert "Traceback" not in done.stderr
    assert not (outside / "cache").exists()  # nothing was built
