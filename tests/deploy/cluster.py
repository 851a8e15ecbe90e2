"""Local replicas behind a router: N ``tinyloop serve`` processes on 127.0.0.1 and one router in
front (HAProxy with ``deploy/router/haproxy.cfg``, or vllm-router), for the multi-replica test and
``bench/router_choice.py``.

Blocking and process-based (``subprocess``), so a benchmark script and a test fixture use it
alike; ``Cluster`` is a context manager that kills every process it started, even on failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

ROOT = Path(__file__).resolve().parents[2]
ROUTER_DIR = ROOT / "deploy" / "router"
ROUTERS = ("haproxy", "haproxy-rr", "vllm-router")  # haproxy: the shipped config (prefix hash)
STARTUP_S = 90.0  # a cold Python + torch import on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def router_binary(router: str) -> str | None:
    """The executable a router needs, or None when it is not installed."""
    name = "vllm-router" if router == "vllm-router" else "haproxy"
    return shutil.which(name) or shutil.which(name, path="/usr/sbin")  # Debian's haproxy: not on every PATH


def counters(metrics_text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus exposition (``name value`` lines)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


@dataclass
class Replica:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        return counters(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def kill(self) -> None:
        """SIGKILL: the replica dies with its in-flight requests, as a crashed pod does."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@dataclass
class Cluster:
    """``n`` replicas of ``artifact`` and a router; ``url`` is the router's."""

    artifact: Path
    workdir: Path
    router: str = "haproxy"
    n: int = 3
    serve_args: tuple[str, ...] = ()
    replicas: list[Replica] = field(default_factory=list)
    url: str = ""
    _router: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=ROOT, start_new_session=True)

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        for i in range(self.n):
            port = free_port()
            log = self.workdir / f"replica{i}.log"
            argv = [sys.executable, "-m", "tinyloop.cli", "serve", "--model", str(self.artifact),
                    "--port", str(port), "--graceful-timeout", "5", *self.serve_args]
            self.replicas.append(Replica(port, self._spawn(argv, log, env), log))
        deadline = time.monotonic() + STARTUP_S
        for replica in self.replicas:
            wait_until(lambda r=replica: _answers(f"{r.url}/healthz", r.proc, r.log), deadline)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._router = self._spawn(self._router_argv(port), self.workdir / "router.log",
                                   {**os.environ, **self._router_env(port)})
        log = self.workdir / "router.log"
        wait_until(lambda: _answers(f"{self.url}/v1/models", self._router, log), time.monotonic() + 60)

    def _router_argv(self, port: int) -> list[str]:
        if self.router == "vllm-router":
            return ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                    "--policy", "cache_aware", "--worker-urls", *(r.url for r in self.replicas),
                    "--health-check-endpoint", "/healthz", "--health-check-interval-secs", "1",
                    "--worker-startup-check-interval", "1", "--log-level", "warning"]
        backends = self.workdir / "backends.cfg"
        servers = "".join(f"    server r{i} 127.0.0.1:{r.port}\n" for i, r in enumerate(self.replicas))
        balance = "    balance roundrobin\n" if self.router == "haproxy-rr" else ""
        backends.write_text(f"backend replicas\n{balance}{servers}")
        return [str(router_binary("haproxy")), "-db", "-f", str(ROUTER_DIR / "haproxy.cfg"), "-f", str(backends)]

    def _router_env(self, port: int) -> dict[str, str]:
        return {"TINYLOOP_ROUTER_BIND": f"127.0.0.1:{port}", "TINYLOOP_ROUTER_STATS_BIND": f"127.0.0.1:{free_port()}",
                "TINYLOOP_ROUTER_ERRORS": str(ROUTER_DIR / "errors")}

    def close(self) -> None:
        procs = [r.proc for r in self.replicas] + ([self._router] if self._router else [])
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=30)


def _answers(url: str, proc: subprocess.Popen[bytes] | None, log: Path) -> bool:
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def wait_until(ready: object, deadline: float) -> None:
    """Poll ``ready()`` every 0.1 s until it is true; TimeoutError past ``deadline`` (monotonic)."""
    assert callable(ready)
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("not ready in time")
        time.sleep(0.1)
