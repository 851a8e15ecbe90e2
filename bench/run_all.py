"""Run every benchmark and append a dated section with the machine's description to RESULTS.md.

    python bench/run_all.py [--quick] [--only overhead batching ...] [--threads N]
                            [--output bench/RESULTS.md] [--timeout 1800]

Runs ``overhead``, ``engine_vs_hf``, ``batching``, ``kv_modes``, ``speculative``, ``prefix``,
``demo_model``, ``multi_engine``, ``decode_attention`` and ``panel_matmul`` one after another (each in its own
process, with this interpreter), echoes their output, and appends one section to ``--output``:
date, commit, machine (nproc, CPU model, RAM, torch version and threads, Python, transformers)
and each benchmark's command, wall time, exit status and output.

``--quick`` runs the smoke sizes (seconds each) to prove every script works. A smoke run
writes nothing unless ``--output`` is given explicitly, so RESULTS.md only ever holds full runs;
a section written from a smoke run is headed "SMOKE RUN (--quick): not results".
``--threads`` is passed to every benchmark that takes it (all but ``overhead``, which runs no
model).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> (smoke arguments, full arguments, takes --threads)
BENCHES: dict[str, tuple[list[str], list[str], bool]] = {
    "overhead": (["--quick"], [], False),
    "engine_vs_hf": (["--quick"], [], True),
    "batching": (["--quick"], [], True),
    "kv_modes": (["--tokens", "8", "--tps-tokens", "4", "--large", "small"], [], True),
    # the trained demo model: a random one's drafts almost never agree (acceptance ~1%)
    "speculative": (["--tokens", "8", "--repeat", "1"],
                    ["--model", "tinyloop/data/demo.tinyloop", "--prompt", "def fibonacci(n):"], True),
    "prefix": (["--repeats", "1", "--prefix", "64", "--suffix", "8"], [], True),
    "demo_model": (["--loops", "1,4", "--windows", "4", "--problems", "20", "--sample-tokens", "8",
                    "--spec-tokens", "8"], [], True),
    # its own --threads is the one-engine configuration's; the engines get one each
    "multi_engine": (["--quick", "--repeat", "1"], ["--repeat", "3"], False),
    "decode_attention": (["--rows", "2", "--keys", "16", "--repeat", "3"], [], False),  # one thread itself
    "panel_matmul": (["--rows", "1", "16", "--repeat", "3", "--cold-mb", "4"], [], True),
    "fused_block": (["--preset", "small", "--tokens", "8", "--rounds", "1", "--loops", "1", "--weights", "float",
                     "int8", "--kv", "full"], [], True),
    "quant_matmul": (["--preset", "small", "--rounds", "1", "--rows", "1", "3", "--threads", "1"], [], False),
    "sampling": (["--vocab", "4096", "--batches", "1", "4", "--repeat", "20"], [], True),
    "structured": (["--quick"], [], True),
}


def _sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    probe = ("import torch\ntry:\n import transformers; tf = transformers.__version__\n"
             "except ImportError:\n tf = 'not installed'\n"
             "print(torch.__version__, torch.get_num_threads(), tf)")
    torch_v, threads, tf = (_sh(sys.executable, "-c", probe).split() + ["?"] * 3)[:3]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [f"- CPU: {cpu}; nproc {os.cpu_count()} (usable {len(os.sched_getaffinity(0))}); RAM {ram}",
            f"- torch {torch_v} ({threads} threads by default); Python {platform.python_version()}; "
            f"transformers {tf}; {platform.platform()}",
            f"- load average at start: {load}"]


def run_bench(name: str, args: list[str], timeout: float) -> tuple[str, int, float, str]:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args]
    shown = shlex.join(["python", f"bench/{name}.py", *args])
    print(f"\n=== {shown}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        out, rc = proc.stdout, proc.returncode
        if rc != 0:
            out += "\n--- stderr (tail) ---\n" + "\n".join(proc.stderr.splitlines()[-30:])
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
        out += f"\n--- timed out after {timeout:.0f} s ---"
        rc = -1
    wall = time.perf_counter() - t0
    print(out.rstrip(), flush=True)
    print(f"=== {name}: exit {rc}, {wall:.0f} s", flush=True)
    return shown, rc, wall, out.rstrip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke sizes; writes nothing unless --output")
    ap.add_argument("--only", nargs="+", choices=list(BENCHES), help="run these benchmarks only")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every benchmark")
    ap.add_argument("--output", type=Path, default=None,
                    help="file to append to (default: bench/RESULTS.md for a full run, none for --quick)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    args = ap.parse_args()
    output = args.output or (None if args.quick else HERE / "RESULTS.md")
    started = dt.datetime.now(dt.UTC)
    commit = _sh("git", "rev-parse", "--short", "HEAD") or "unknown"
    dirty = " (uncommitted changes)" if _sh("git", "status", "--porcelain") else ""
    desc = machine()
    print("\n".join(desc))
    sections = []
    failed = []
    for name in args.only or list(BENCHES):
        smoke, full, threads = BENCHES[name]
        bench_args = list(smoke if args.quick else full)
        if threads and args.threads:
            bench_args += ["--threads", str(args.threads)]
        shown, rc, wall, out = run_bench(name, bench_args, args.timeout)
        if rc != 0:
            failed.append(name)
        # "~~~" fences: an output may hold ``` blocks of its own (demo_model's samples)
        sections.append(f"### {name}\n\n`{shown}`: {wall:.0f} s, exit {rc}\n\n~~~\n{out}\n~~~\n")
    if output is not None:
        kind = "SMOKE RUN (--quick): not results" if args.quick else "full run"
        head = (f"\n## {started:%Y-%m-%d %H:%M} UTC, {kind}, commit {commit}{dirty}"
                + (f", --threads {args.threads}" if args.threads else "") + "\n\n")
        preamble = "" if output.exists() else (
            "# Benchmark results\n\nOne section per run of `python bench/run_all.py`, newest last, "
            "each with its date, commit and machine. Compare ratios within a section; absolute "
            "figures only between sections from the same machine.\n")
        with open(output, "a", encoding="utf-8") as f:
            f.write(preamble + head + "\n".join(desc) + "\n\n" + "\n".join(sections))
        print(f"\nappended to {output}")
    else:
        print("\n(smoke run: nothing written; pass --output FILE to keep it)")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
