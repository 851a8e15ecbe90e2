"""Structured outputs: constrained vs free decoding on the demo model, and the grammar engines.

    python bench/structured.py [--quick] [--streams 16] [--tokens 128] [--rounds 5] [--threads N]
                               [--vocab 65536] [--model FILE.tinyloop]

Part 1, the engine: ``--streams`` concurrent requests through one ``Engine`` (the bundled demo
model by default), sampled at temperature 1 with a seed each, ``--tokens`` tokens each, EOS
ignored; once all free, once all constrained by a JSON schema (nested objects, arrays, enums,
numbers, optional fields) whose array asks for more items than ``--tokens`` can hold, so every
stream, constrained or free, runs to ``--tokens``: the same tokens decoded in both runs, only the
grammar's masks differ. A round runs free, constrained, constrained, free (a load that drifts
during the round weighs on both alike); tokens/s columns are medians over the runs, ``ratio`` the
median round's constrained tokens/s over its free tokens/s (the target: >= 0.90), beside the
lowest and highest round's (a shared machine's load comes and goes); ``mask ms/step`` is
the time the constrained run spent filling and applying masks per engine step (from a probe
around ``constrain_rows``).

Part 2, the grammar engines on a ``--vocab``-token byte-level BPE (trained here by ``tokenizers``
on generated text, cached in the temp folder; ``--vocab 0`` takes the demo's 4096 tokens):
building each library's tokenizer info, compiling a realistic schema (cold: a new schema each
time), and the mask of every token of a realistic 480-character document (mean, p50, p99, max),
with each library's installed size. llguidance is TinyLoop's (``tinyloop/grammar``); xgrammar is
measured when importable (``pip install xgrammar`` in a separate venv: it requires transformers
and triton, which TinyLoop may not depend on).

``--quick`` is the smoke size (seconds): 2 streams, 8 tokens, 1 round, the 4096-token vocabulary.
Why TinyLoop took llguidance from these figures: ``tinyloop/grammar/__init__.py``; the run behind
the choice: ``bench/LOG.md`` (2026-12-01 23:34 UTC); the current table: ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinyloop import grammar
from tinyloop.cpu import kernels
from tinyloop.engine import plain as plain_module
from tinyloop.engine.engine import Engine
from tinyloop.requests import Constraint, GenerationRequest, SamplingParams
from tinyloop.tokenizer import Tokenizer, default_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tinyloop" / "data" / "demo.tinyloop"
PROMPT = "import json\n\nCUSTOMER = json.loads('"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"], "additionalProperties": False},
    "email": {"type": "string", "maxLength": 32},
}, "required": ["name", "age", "role", "address"], "additionalProperties": False}
# at least 64 people: no stream can complete it within --tokens (<= 256), so all run to the end
ENGINE_SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 64}},
                 "required": ["people"], "additionalProperties": False}

SCHEMA = {  # part 2: a realistic response schema
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 64},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "status": {"enum": ["active", "suspended", "deleted"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["street", "city"], "additionalProperties": False},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}, "kind": {"enum": ["book", "tool", "food"]}},
            "required": ["sku", "qty", "kind"], "additionalProperties": False}},
        "verified": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "name", "status", "tags", "address", "orders"],
    "additionalProperties": False,
}
DOCUMENT = {"id": 48213, "name": "Kimo Vathelu", "email": "kimo.vathelu@example.com", "status": "active",
            "score": 87.25, "tags": ["premium", "early adopter", "north"],
            "address": {"street": "12 Ringo Lane", "city": "Pejodu", "zip": "40211",
                        "geo": {"lat": 51.5072, "lon": -0.1276}},
            "orders": [{"sku": "BK-1029", "qty": 2, "price": 19.99, "kind": "book"},
                       {"sku": "TL-77", "qty": 1, "price": 5.5, "kind": "tool"},
                       {"sku": "FD-3", "qty": 12, "kind": "food"}],
            "verified": True, "note": None}


# -- part 1: the engine ------------------------------------------------------------------------
class MaskProbe:
    """Wall time spent in ``constrain_rows`` (plain decoding's grammar masks), per engine step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.original: Callable[..., list[int]] = vars(plain_module)["constrain_rows"]

    def __enter__(self) -> MaskProbe:
        def timed(*args: Any) -> list[int]:
            t0 = time.perf_counter()
            try:
                return self.original(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        vars(plain_module)["constrain_rows"] = timed
        return self

    def __exit__(self, *exc: object) -> None:
        vars(plain_module)["constrain_rows"] = self.original


def run_streams(engine: Engine, streams: int, tokens: int, constraint: Constraint | None) -> tuple[float, int, float]:
    """(tokens/s, steps, mask seconds) for ``streams`` requests decoded together."""
    prompt = tuple(engine.tokenizer.encode(PROMPT))
    reqs = [GenerationRequest(prompt_tokens=prompt, max_tokens=tokens, constraint=constraint,
                              sampling=SamplingParams(temperature=1.0, seed=i, ignore_eos=True))
            for i in range(streams)]
    with MaskProbe() as probe:
        seqs = [engine.start(r) for r in reqs]
        steps = 0
        t0 = time.perf_counter()
        try:
            while not all(s.finished for s in seqs):
                engine.step([s for s in seqs if not s.finished])
                steps += 1
            wall = time.perf_counter() - t0
        finally:
            for s in seqs:
                engine.free(s)
    for s in seqs:
        if s.error is not None:
            raise s.error
        if constraint is not None and s.finish_reason != "length":
            raise RuntimeError(f"a constrained stream ended early ({s.finish_reason}): {s.result().text!r}")
    return sum(len(s.output) for s in seqs) / wall, steps, probe.seconds


def engine_table(args: argparse.Namespace) -> dict[str, float]:
    engine = Engine.load(args.model, kv_cache_mb=256)  # room for every stream at once
    constraint = Constraint("json_schema", json.dumps(ENGINE_SCHEMA))
    grammar.validate(constraint, engine.tokenizer)  # compiled once, as the HTTP layer does before admission
    run_streams(engine, 1, 2, constraint)  # warm-up
    free, constrained, mask_ms, ratios = [], [], [], []
    for _ in range(args.rounds):  # free, constrained, constrained, free: a drifting load hits both alike
        f1 = run_streams(engine, args.streams, args.tokens, None)[0]
        both = [run_streams(engine, args.streams, args.tokens, constraint) for _ in range(2)]
        f2 = run_streams(engine, args.streams, args.tokens, None)[0]
        free += [f1, f2]
        constrained += [tps for tps, _, _ in both]
        mask_ms += [mask_s * 1000 / steps for _, steps, mask_s in both]
        ratios.append(sum(tps for tps, _, _ in both) / (f1 + f2))
    row = {"free": statistics.median(free), "constrained": statistics.median(constrained),
           "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
           "mask": statistics.median(mask_ms)}
    print(f"\n## Engine: {args.streams} streams x {args.tokens} tokens, {Path(args.model).name} "
          f"(vocab {engine.config.vocab_size}), temperature 1, median of {args.rounds} rounds\n")
    print("| free tok/s | JSON-schema tok/s | ratio | rounds' ratios | mask ms/step |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {row['free']:.1f} | {row['constrained']:.1f} | {row['ratio']:.3f} | {row['low']:.3f}-{row['high']:.3f} "
          f"| {row['mask']:.3f} |")
    return row


# -- part 2: the grammar engines on a large vocabulary -------------------------------------------
def corpus(seed: int, lines: int) -> list[str]:
    """Generated text with a Zipfian lexicon: prose, JSON documents, code, some non-ASCII."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + ["th", "sh", "ch", "ing", "er", "tion"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
               for _ in range(120_000)]
    weights = list(itertools.accumulate(1 / (i + 1) ** 0.9 for i in range(len(lexicon))))
    accents = ["é", "ü", "ñ", "ø", "ç", "ß", "日本", "中文", "😀", "–", "“", "”"]

    def words(n: int) -> list[str]:
        return rng.choices(lexicon, cum_weights=weights, k=n)

    out = []
    for _ in range(lines):
        r = rng.random()
        if r < 0.45:
            out.append(" ".join(words(rng.randint(5, 20))) + rng.choice([".", ",", "?", "!", ":", ";", ""]))
        elif r < 0.75:
            obj = {w: rng.choice([rng.randint(-10**6, 10**6), round(rng.uniform(-1e3, 1e3), rng.randint(1, 6)),
                                  " ".join(words(rng.randint(1, 4))), rng.random() < 0.5, None,
                                  [rng.randint(0, 999) for _ in range(rng.randint(0, 4))]])
                   for w in words(rng.randint(1, 6))}
            out.append(json.dumps(obj, indent=rng.choice([None, None, 2])))
        elif r < 0.92:
            ws = words(rng.randint(2, 6))
            out.append(f"def {'_'.join(ws[:2])}({', '.join(ws[2:])}):\n    return {ws[0]}[{rng.randint(0, 99)}] + "
                       f"{{'{ws[-1]}': ({rng.randint(0, 9999)},)}}")
        else:
            out.append(" ".join(w + rng.choice(accents) for w in words(rng.randint(3, 10))))
    return out


def bpe_tokenizer(vocab: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of ``vocab`` tokens trained on ``corpus`` (cached in the temp folder)."""
    if vocab == 0:
        return default_tokenizer()
    path = Path(tempfile.gettempdir()) / f"tinyloop-bench-bpe{vocab}-seed{seed}.json"
    if not path.exists():
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        t0 = time.perf_counter()
        inner = HFTokenizer(models.BPE())
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        inner.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        inner.train_from_iterator(corpus(seed, 200_000), trainer)
        path.write_text(inner.to_str(), encoding="utf-8")
        print(f"(trained a {inner.get_vocab_size()}-token BPE in {time.perf_counter() - t0:.0f} s: {path})")
    return Tokenizer.from_file(path)


def _schemas(n: int) -> list[str]:
    return [json.dumps({**SCHEMA, "description": f"variant {i} {time.time_ns()}"}) for i in range(n)]


def _summary(name: str, info_s: float, compiles: list[float], masks: list[float], size_mb: float) -> dict[str, Any]:
    ms = sorted(m * 1000 for m in masks)
    return {"library": name, "info_ms": info_s * 1000, "compile_ms": statistics.median(compiles) * 1000,
            "mean": statistics.mean(ms), "p50": ms[len(ms) // 2], "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "max": ms[-1], "size_mb": size_mb}


def installed_mb(*dists: str) -> float:
    """What ``dists`` occupy on disk (their RECORD sizes), MB; 0 for one not installed."""
    total = 0
    for name in dists:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        total += sum(f.size or 0 for f in files)
    return total / 1e6


def measure_llguidance(tok: Tokenizer, tokens: list[int]) -> dict[str, Any]:
    import llguidance

    from tinyloop.grammar.compile import JSON_FORMAT, LIMITS
    from tinyloop.grammar.vocab import _Wrapper

    t0 = time.perf_counter()
    info = llguidance.LLTokenizer(_Wrapper(tok), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_ids))
    info_s = time.perf_counter() - t0
    compiles = []
    for schema in _schemas(5):
        t0 = time.perf_counter()
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
        matcher = llguidance.LLMatcher(info, text, log_level=0, limits=LIMITS)
        compiles.append(time.perf_counter() - t0)
    words = torch.zeros(grammar.words_per_row(tok.vocab_size), dtype=torch.int32)
    masks = []
    for token in tokens:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        masks.append(time.perf_counter() - t0)
        if not (int(words[token // 32]) >> (token % 32)) & 1 or not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
    return _summary("llguidance", info_s, compiles, masks, installed_mb("llguidance"))


def measure_xgrammar(tok: Tokenizer, tokens: list[int]) -> dict[str, Any] | None:
    try:
        import xgrammar  # type: ignore[import-not-found]
    except ImportError:
        return None
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo([tok.token_bytes(i) for i in range(tok.vocab_size)], xgrammar.VocabType.RAW,
                                  vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_ids))
    info_s = time.perf_counter() - t0  # (specials as b"": xgrammar's mark of a special token)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    compiles = []
    for schema in _schemas(5):
        t0 = time.perf_counter()
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False,
                                                                       separators=(", ", ": ")))
        compiles.append(time.perf_counter() - t0)
    words = xgrammar.allocate_token_bitmask(1, tok.vocab_size)
    masks = []
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(words, 0)
        masks.append(time.perf_counter() - t0)
        if not (int(words[0, token // 32]) >> (token % 32)) & 1 or not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")
    size = installed_mb("xgrammar", "apache-tvm-ffi", "transformers", "triton")  # its own requirements
    return _summary("xgrammar", info_s, compiles, masks, size)


def grammar_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    tok = bpe_tokenizer(args.vocab)
    text = json.dumps(DOCUMENT)
    tokens = tok.encode(text)
    rows = [measure_llguidance(tok, tokens)]
    xgr = measure_xgrammar(tok, tokens)
    print(f"\n## Grammar engines: vocab {tok.vocab_size}, a {len(text)}-character document ({len(tokens)} tokens)\n")
    print("| library | tokenizer info ms | compile ms | mask mean ms | p50 | p99 | max | installed MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows + ([xgr] if xgr else []):
        print(f"| {r['library']} | {r['info_ms']:.0f} | {r['compile_ms']:.1f} | {r['mean']:.3f} | {r['p50']:.3f} "
              f"| {r['p99']:.3f} | {r['max']:.3f} | {r['size_mb']:.1f} |")
    if xgr is None:
        print("\n(xgrammar not installed: measure it in a separate venv, see the module docstring)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke sizes (seconds)")
    ap.add_argument("--model", default=str(DEMO), help="a .tinyloop artifact (default: the demo model)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=65536, help="BPE size for part 2 (0: the demo's 4096)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.quick:
        args.streams, args.tokens, args.rounds, args.vocab = 2, 8, 1, 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.available():
        kernels.set_threads(torch.get_num_threads())
    print(f"# Structured outputs ({'SMOKE: not results' if args.quick else 'full'}); torch threads "
          f"{torch.get_num_threads()}")
    engine_table(args)
    grammar_table(args)


if __name__ == "__main__":
    main()
