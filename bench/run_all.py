"""Run every benchmark and rewrite RESULTS.md: one table per benchmark, with the run's date, commit and machine.

    python bench/run_all.py [--quick] [--only overhead batching ...] [--peers] [--threads N]
                            [--output bench/RESULTS.md] [--timeout 1800]

Runs ``overhead``, ``engine_vs_hf``, ``inkling2_vs_hf``, ``batching``, ``kv_modes``, ``speculative``, ``prefix``,
``demo_model``, ``multi_engine``, ``decode_attention``, ``panel_matmul``, ``fused_block``,
``quant_matmul``, ``sampling`` and ``structured`` one after another (each in its own process, with
this interpreter) and echoes their output. Then it rewrites ``--output``: a header with the date,
commit, machine (nproc, CPU model, RAM, torch version and threads, Python, transformers) and this
command, then one section per benchmark with its command, wall time, exit status and the table
part of its output (``PROGRESS`` names the progress lines a bench prints between its tables,
left out). Each section keeps the date, commit and machine of the run that produced it: a run of
some benchmarks (``--only``) replaces their sections and keeps the others' from the file as it
was (``results.py`` parses them by their markers). Writing ``bench/RESULTS.md`` redraws
``docs/img/headlines.svg`` (``plot_headlines.py``), and a full run (no ``--only``) adds a short
dated entry (its benches and wall times) to ``bench/LOG.md``, where the narrative of how each
figure was reached lives.

``--peers`` adds the peer benchmarks (``PEERS``), opt-in because they need what the core ones do
not: ``vs_llamacpp`` needs ``pip install -e ".[bench-peers]"`` and builds llama.cpp into its cache
the first time (12-20 minutes on 2 cores), then runs about 7 minutes. ``--only vs_llamacpp`` runs
it alone. A run without it keeps its section from the last run that had it.

``--quick`` runs the smoke sizes (seconds each) to prove every script works. A smoke run
writes nothing unless ``--output`` is given explicitly, so RESULTS.md only ever holds full runs;
a file written from a smoke run is headed "SMOKE RUN (--quick): not results".
``--threads`` is passed to every benchmark that takes it (all but ``overhead``, which runs no
model).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plot_headlines import write_headlines
from results import merge, parse_sections, render_file, render_section, table_part

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
LOG = HERE / "LOG.md"
HEADLINES = ROOT / "docs" / "img" / "headlines.svg"
INTRO = ("The current table of every benchmark, rewritten by `python bench/run_all.py` (the narrative of how "
         "each figure was reached: `bench/LOG.md`; the headline ratios drawn: `docs/img/headlines.svg`). Each "
         "section names the run that produced it, its date, commit and machine: a run of some benchmarks "
         "(`--only`) keeps the others' sections from earlier runs. Compare ratios within a section; absolute "
         "figures only between runs on the same machine.")

# name -> (smoke arguments, full arguments, takes --threads)
BENCHES: dict[str, tuple[list[str], list[str], bool]] = {
    "overhead": (["--quick"], [], False),
    "engine_vs_hf": (["--quick"], [], True),
    "inkling2_vs_hf": (["--quick", "--batches", "1"], [], True),
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
# opt-in (--peers): vs_llamacpp needs the bench-peers extra and builds llama.cpp once (12-20 min)
PEERS: dict[str, tuple[list[str], list[str], bool]] = {
    "vs_llamacpp": (["--quick"], [], True),
}
# lines a bench prints while it works, left out of RESULTS.md (matched from the line's start)
PROGRESS: dict[str, re.Pattern[str]] = {
    "demo_model": re.compile(r"  loops \d+: [\d.]+s$|weights \w+: \d+ weights quantized$"),
    "vs_llamacpp": re.compile(r"waiting for the llama\.cpp build |llama\.cpp: /|downloading the llama-cpp-python |"
                              r"building llama\.cpp into |llama\.cpp built in |  wrote |  quantised "),
    "structured": re.compile(r"\(trained a \d+-token BPE in "),
}


def _sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> tuple[str, list[str]]:
    """The CPU in a few words (each section names it), and the header's lines about the machine."""
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
    return f"{cpu} (nproc {os.cpu_count()})", [
        f"- CPU: {cpu}; nproc {os.cpu_count()} (usable {len(os.sched_getaffinity(0))}); RAM {ram}",
        f"- torch {torch_v} ({threads} threads by default); Python {platform.python_version()}; "
        f"transformers {tf}; {platform.platform()}",
        f"- load average at start: {load}"]


@dataclass(frozen=True, slots=True)
class Run:
    """What the sections of one run share."""

    started: dt.datetime
    commit: str  # short hash, "(uncommitted changes)" after it when the tree was dirty
    cpu: str  # the CPU in a few words, for each section
    machine: list[str]  # the header's lines
    command: str  # this run's command line

    @classmethod
    def now(cls) -> Run:
        commit = _sh("git", "rev-parse", "--short", "HEAD") or "unknown"
        dirty = " (uncommitted changes)" if _sh("git", "status", "--porcelain") else ""
        cpu, lines = machine()
        return cls(dt.datetime.now(dt.UTC), commit + dirty, cpu, lines,
                   shlex.join(["python", "bench/run_all.py", *sys.argv[1:]]))

    def stamp(self) -> str:
        return f"{self.started:%Y-%m-%d %H:%M} UTC, commit {self.commit}"

    def header(self, quick: bool) -> str:
        title = "# Benchmark results" + (": SMOKE RUN (--quick), not results" if quick else "")
        return (f"{title}\n\n{INTRO}\n\nLast written {self.stamp()}: `{self.command}`\n\n"
                + "\n".join(self.machine))

    def log_entry(self, walls: dict[str, tuple[float, int]]) -> str:
        """bench/LOG.md's dated entry for a full run: which benches, their wall times and exits."""
        rows = "\n".join(f"| {name} | {wall:.0f} | {rc} |" for name, (wall, rc) in walls.items())
        total = sum(wall for wall, _ in walls.values())
        return (f"\n## {self.stamp()}, `{self.command}`\n\nThe tables: `bench/RESULTS.md` as this run wrote it; "
                f"{total / 60:.0f} min in all.\n\n" + "\n".join(self.machine)
                + f"\n\n| bench | wall s | exit |\n|---|---:|---:|\n{rows}\n")


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


def write_results(path: Path, header: str, sections: dict[str, str]) -> None:
    """Rewrite ``path``: ``header``, then this run's sections, and the earlier sections of the
    benches this run did not run, in the order of BENCHES and PEERS."""
    old = parse_sections(path.read_text(encoding="utf-8")) if path.exists() else {}
    path.write_text(render_file(header, merge(old, sections, [*BENCHES, *PEERS])), encoding="utf-8")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke sizes; writes nothing unless --output")
    ap.add_argument("--only", nargs="+", choices=[*BENCHES, *PEERS], help="run these benchmarks only")
    ap.add_argument("--peers", action="store_true", help=f"add {', '.join(PEERS)} (opt-in: see the docstring)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every benchmark")
    ap.add_argument("--output", type=Path, default=None,
                    help="file to rewrite (default: bench/RESULTS.md for a full run, none for --quick)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    output = args.output or (None if args.quick else RESULTS)
    every = {**BENCHES, **PEERS}
    run = Run.now()
    print("\n".join(run.machine))
    sections: dict[str, str] = {}
    walls: dict[str, tuple[float, int]] = {}
    for name in args.only or [*BENCHES, *(PEERS if args.peers else {})]:
        smoke, full, threads = every[name]
        bench_args = list(smoke if args.quick else full)
        if threads and args.threads:
            bench_args += ["--threads", str(args.threads)]
        shown, rc, wall, out = run_bench(name, bench_args, args.timeout)
        walls[name] = wall, rc
        sections[name] = render_section(name, shown, f"{wall:.0f} s, exit {rc}; {run.stamp()}, {run.cpu}",
                                        table_part(out, PROGRESS.get(name)))
    if output is None:
        print("\n(smoke run: nothing written; pass --output FILE to keep it)")
    else:
        write_results(output, run.header(args.quick), sections)
        print(f"\nwrote {output}")
        if output.resolve() == RESULTS and not args.quick:
            print(f"drew {write_headlines(RESULTS, HEADLINES)} ratios into {HEADLINES}")
            if not args.only:
                with open(LOG, "a", encoding="utf-8") as f:
                    f.write(run.log_entry(walls))
                print(f"appended this run's entry to {LOG}")
    if failed := [name for name, (_, rc) in walls.items() if rc != 0]:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
