"""Which router goes in front of TinyLoop replicas: measured, not assumed.

Three ``tinyloop serve`` replicas of a random ``tiny`` model on 127.0.0.1 (``tests/deploy/
cluster.py``) behind each candidate in turn, fresh replicas for each:

* ``haproxy``: the shipped ``deploy/router/haproxy.cfg``, consistent hashing on the first 512
  bytes of the prompt (bounded loads);
* ``haproxy-rr``: the same HAProxy with round robin, the baseline that ignores prefixes;
* ``vllm-router``: vllm-router's ``cache_aware`` policy (an approximate radix tree of the text it
  sent to each worker).

The workload: ``--conversations`` conversations run concurrently, each ``--turns`` turns; turn t's
prompt is a system prompt shared by all (``--system-chars``), the conversation's own opening
document, then every earlier question and answer: what a chat client sends. Measured from the
replicas' ``/metrics``: prefix-cache hit rate (hit tokens / looked-up tokens, all replicas),
requests per replica (balance: busiest over the mean), requests/s. Then the failure row: the
same load with longer answers (``--kill-tokens``), replica 0 killed (SIGKILL) after a third of the
requests; how many requests failed, whether each failure was a clean HTTP error (JSON error
object) or a dropped connection, and whether every request sent 2 s after the kill succeeded.

    python bench/router_choice.py                       # both system prompt sizes, every router
    python bench/router_choice.py --routers haproxy --system-chars 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.deploy.cluster import ROUTERS, Cluster, router_binary  # noqa: E402
from tinyloop.model.artifact import save_artifact  # noqa: E402
from tinyloop.model.presets import PRESETS, init_model  # noqa: E402
from tinyloop.tokenizer import default_tokenizer  # noqa: E402

WORDS = ("loop state token cache prefix replica router model kernel batch queue admit decode prefill "
         "window slot block tensor shard region scale drain probe metric").split()


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:chars]


class Load:
    """Conversations of growing prompts; counts outcomes. Thread-safe (one thread per conversation)."""

    def __init__(self, url: str, args: argparse.Namespace, seed: int) -> None:
        self.url, self.args, self.seed = url, args, seed
        rng = random.Random(seed)
        self.system = "System: " + text(rng, args.system_chars) + "\n"
        self.lock = threading.Lock()
        self.sent = self.ok = self.clean_errors = self.dropped = 0
        self.late_failures = 0
        self.killed_at: float | None = None
        self.kill_run = False

    def conversation(self, c: int) -> None:
        rng = random.Random(self.seed * 1000 + c)
        prompt = self.system + f"Document {c}: " + text(rng, self.args.opening_chars) + "\n"
        with httpx.Client(base_url=self.url, timeout=120) as client:
            for _ in range(self.args.turns):
                prompt += f"Q: {text(rng, 60)}\nA:"
                reply = self.ask(client, prompt)
                prompt += (reply or " (no answer)") + "\n"

    def ask(self, client: httpx.Client, prompt: str) -> str | None:
        tokens = self.args.kill_tokens if self.kill_run else self.args.max_tokens
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        with self.lock:
            self.sent += 1
        started = time.monotonic()
        try:
            resp = client.post("/v1/completions", json=body)
        except httpx.TransportError:
            self.count(started, clean=False)
            return None
        if resp.status_code == 200:
            with self.lock:
                self.ok += 1
            return str(resp.json()["choices"][0]["text"])
        clean = "error" in _json(resp)
        self.count(started, clean=clean)
        return None

    def count(self, started: float, *, clean: bool) -> None:
        with self.lock:
            if clean:
                self.clean_errors += 1
            else:
                self.dropped += 1
            if self.killed_at is not None and started > self.killed_at + 2:
                self.late_failures += 1

    def run(self, cluster: Cluster | None = None) -> float:
        """Run every conversation; with ``cluster``, kill replica 0 after a third of the requests."""
        total = self.args.conversations * self.args.turns
        self.kill_run = cluster is not None
        t0 = time.monotonic()
        with ThreadPoolExecutor(self.args.conversations) as pool:
            futures = [pool.submit(self.conversation, c) for c in range(self.args.conversations)]
            if cluster is not None:
                while self.ok + self.clean_errors + self.dropped < total // 3:
                    time.sleep(0.01)
                cluster.replicas[0].kill()
                self.killed_at = time.monotonic()
            for f in futures:
                f.result()
        return time.monotonic() - t0


def _json(resp: httpx.Response) -> dict[str, object]:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def measure(router: str, artifact: Path, args: argparse.Namespace, seed: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp, Cluster(artifact, Path(tmp), router=router) as cluster:
        before = [r.metrics() for r in cluster.replicas]
        load = Load(cluster.url, args, seed)
        wall = load.run()
        after = [r.metrics() for r in cluster.replicas]
        delta = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before)]
        hits = sum(d["tinyloop_prefix_cache_hit_tokens_total"] for d in delta)
        queried = sum(d["tinyloop_prefix_cache_queried_tokens_total"] for d in delta)
        per = [int(d["tinyloop_requests_completed_total"]) for d in delta]
        kill = Load(cluster.url, args, seed + 1)
        kill.run(cluster)
    return {"router": router, "hit": hits / max(queried, 1), "per": per,
            "balance": max(per) / max(statistics.mean(per), 1e-9), "rps": load.ok / wall, "errors": load.sent - load.ok,
            "failed": kill.clean_errors + kill.dropped, "clean": kill.clean_errors, "dropped": kill.dropped,
            "late": kill.late_failures, "sent": kill.sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-chars", default="200,2000", help="shared system prompt sizes (comma-separated)")
    ap.add_argument("--opening-chars", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kill-tokens", type=int, default=48, help="tokens per answer in the kill run (long: in flight)")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        artifact = Path(tmp) / "tiny.tinyloop"
        save_artifact(artifact, init_model(PRESETS["tiny"], seed=0), default_tokenizer())
        print(f"{args.conversations} conversations x {args.turns} turns, opening {args.opening_chars} chars, "
              f"{args.max_tokens} tokens per answer, 3 replicas; kill: replica 0 SIGKILLed after a third")
        print("| system prompt | router | prefix-cache hit rate | requests per replica | busiest / mean | "
              "requests/s | failed (kill run) | clean errors / dropped | failed >2 s after the kill |")
        print("|---|---|---|---|---|---|---|---|---|")
        for system in (int(s) for s in args.system_chars.split(",")):
            args.system_chars = system
            for rep in range(args.repeat):
                for router in args.routers.split(","):
                    if router_binary(router) is None:
                        print(f"| {system} | {router} | not installed | | | | | | |")
                        continue
                    r = measure(router, artifact, args, seed=system + 17 * rep)
                    print(f"| {system} | {r['router']} | {r['hit']:.1%} | {r['per']} | {r['balance']:.2f} | "
                          f"{r['rps']:.1f} | {r['failed']} of {r['sent']} | {r['clean']} / {r['dropped']} | "
                          f"{r['late']} |", flush=True)


if __name__ == "__main__":
    main()
