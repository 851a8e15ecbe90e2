"""The training corpus: the Python standard library's sources mixed with written-out additions.

Everything is built by code from what every machine has, so a run is reproducible anywhere:

- text: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (PSF licence), sorted, test
  and site-packages folders skipped; each file's tokens followed by ``<|endoftext|>``. About 2%
  of the files, chosen by a hash of their relative path, are held out for validation.
- addition: ``417+386=803`` one problem per line, operands of 1 to ``max_digits`` (default 5)
  digits (the digit count uniform, then the value uniform), from a seeded RNG. A fixed set of held-out problems is drawn
  first; no training problem uses a held-out operand pair, in either order.

Tokenised once; the arrays are cached as ``.npy`` files in a cache folder keyed by a digest of
everything that determines them. Batches are a pure function of ``(seed, step)``, so a resumed
run draws exactly the batches it would have drawn.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinyloop.tokenizer import Tokenizer

__all__ = ["Corpus", "CorpusSpec", "build_corpus", "source_files", "split_files",
           "held_out_problems", "training_problems", "format_problems", "sample_batch",
           "val_windows", "validation_text"]

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
CORPUS_VERSION = 1
MAX_DIGITS = 9  # operands stay below 10**9, so an operand pair packs into one int64


@dataclass(frozen=True, slots=True)
class CorpusSpec:
    """What determines the corpus arrays (the cache key is a digest of these and the files)."""

    source_dir: str = ""  # "" = the running Python's stdlib
    val_fraction: float = 0.02  # share of files held out for text validation
    seed: int = 0  # seeds the addition problems
    n_held_out: int = 1000  # held-out addition problems
    n_train_problems: int = 1_000_000  # addition problems in the training stream
    max_digits: int = 5  # digits of the longest addition operand (at most MAX_DIGITS)

    def __post_init__(self) -> None:
        if not 1 <= self.max_digits <= MAX_DIGITS:
            raise ValueError(f"max_digits must be in 1..{MAX_DIGITS}, got {self.max_digits}")


@dataclass(frozen=True, slots=True)
class Corpus:
    text_train: np.ndarray  # [N] uint16 token stream, documents separated by EOS
    text_val: np.ndarray  # [M] uint16
    arith_train: np.ndarray  # [K] uint16, problems separated by "\n"
    held_out: np.ndarray  # [n_held_out, 2] int64 operand pairs (a, b)
    val_files: tuple[str, ...]  # relative paths of the held-out files

    def __repr__(self) -> str:
        return (f"Corpus(text_train={self.text_train.size}, text_val={self.text_val.size}, "
                f"arith_train={self.arith_train.size}, held_out={len(self.held_out)})")


# -- text ------------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Relative paths of the ``.py`` files under ``root``, sorted, skipping ``SKIP_DIRS``."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def _path_hash(rel: str) -> str:
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


def split_files(files: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val): the ``ceil(n * val_fraction)`` files with the lowest path hash are val.

    Hashing the path (not the position in the list) keeps a file's side stable when other files
    come and go between Python versions.
    """
    n_val = min(len(files) - 1, max(1, math.ceil(len(files) * val_fraction))) if files else 0
    val = set(sorted(files, key=_path_hash)[:n_val])
    return [f for f in files if f not in val], [f for f in files if f in val]


def _encode_files(root: Path, files: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    parts = []
    for rel in files:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        parts.append(np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


# -- addition --------------------------------------------------------------------------------


def _operands(rng: np.random.Generator, n: int, max_digits: int) -> np.ndarray:
    """``n`` operands: digit count uniform in 1..max_digits, then the value uniform among those."""
    digits = rng.integers(1, max_digits + 1, size=n)
    lo = np.where(digits == 1, 0, 10 ** (digits - 1))
    return lo + (rng.random(n) * (10 ** digits - lo)).astype(np.int64)


def _pair_key(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    key: np.ndarray = a.astype(np.int64) * 10 ** MAX_DIGITS + b.astype(np.int64)
    return key


def held_out_problems(seed: int, n: int, max_digits: int = 5) -> np.ndarray:
    """``[n, 2]`` distinct operand pairs (a, b) kept out of training."""
    rng = np.random.default_rng([seed, 1])
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < n:
        a, b = _operands(rng, n, max_digits), _operands(rng, n, max_digits)
        for x, y in zip(a.tolist(), b.tolist()):
            if len(pairs) < n:
                pairs.setdefault((x, y), None)
    return np.asarray(list(pairs), dtype=np.int64).reshape(n, 2)


def training_problems(seed: int, n: int, held_out: np.ndarray, max_digits: int = 5) -> np.ndarray:
    """``[n, 2]`` operand pairs, none equal to a held-out pair in either order."""
    rng = np.random.default_rng([seed, 2])
    banned = np.concatenate([_pair_key(held_out[:, 0], held_out[:, 1]),
                             _pair_key(held_out[:, 1], held_out[:, 0])])
    chunks, have = [], 0
    while have < n:
        a, b = _operands(rng, n, max_digits), _operands(rng, n, max_digits)
        keep = ~np.isin(_pair_key(a, b), banned)
        chunk = np.stack([a[keep], b[keep]], axis=1)
        chunks.append(chunk)
        have += len(chunk)
    return np.concatenate(chunks)[:n]


def format_problems(pairs: np.ndarray) -> str:
    """``"a+b=c\\n"`` per pair."""
    return "".join(f"{a}+{b}={a + b}\n" for a, b in pairs.tolist())


# -- build and cache -------------------------------------------------------------------------


def _cache_key(spec: CorpusSpec, root: Path, files: Sequence[str], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256()
    key: list[object] = [CORPUS_VERSION, spec.val_fraction, spec.seed, spec.n_held_out,
                         spec.n_train_problems, str(root)]
    if spec.max_digits != 5:  # the caches of 5-digit corpora keep their names
        key.append(spec.max_digits)
    h.update(json.dumps(key).encode())
    for rel in files:
        h.update(f"{rel}\0{(root / rel).stat().st_size}\0".encode())
    h.update(hashlib.sha256(tokenizer.to_json().encode()).digest())
    return h.hexdigest()[:16]


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


_ARRAYS = ("text_train", "text_val", "arith_train", "held_out")


def build_corpus(spec: CorpusSpec, tokenizer: Tokenizer, cache_dir: Path | None) -> Corpus:
    """Build (or load from ``cache_dir/corpus-<key>/``) the corpus arrays for ``spec``."""
    root = Path(spec.source_dir) if spec.source_dir else stdlib_dir()
    files = source_files(root)
    train_files, val_files = split_files(files, spec.val_fraction)
    folder = None
    if cache_dir is not None:
        folder = Path(cache_dir) / f"corpus-{_cache_key(spec, root, files, tokenizer)}"
        if all((folder / f"{name}.npy").exists() for name in _ARRAYS):
            arrays = {name: np.load(folder / f"{name}.npy") for name in _ARRAYS}
            return Corpus(**arrays, val_files=tuple(val_files))
    held = held_out_problems(spec.seed, spec.n_held_out, spec.max_digits)
    problems = training_problems(spec.seed, spec.n_train_problems, held, spec.max_digits)
    arrays = {
        "text_train": _encode_files(root, train_files, tokenizer),
        "text_val": _encode_files(root, val_files, tokenizer),
        "arith_train": np.asarray(tokenizer.encode(format_problems(problems)), dtype=np.uint16),
        "held_out": held,
    }
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            _save_atomic(folder / f"{name}.npy", array)
        (folder / "val_files.json").write_text(json.dumps(val_files, indent=0))
    return Corpus(**arrays, val_files=tuple(val_files))


def validation_text(spec: CorpusSpec, tokenizer: Tokenizer) -> np.ndarray:
    """The text validation split alone (``Corpus.text_val``), without tokenising the training files."""
    root = Path(spec.source_dir) if spec.source_dir else stdlib_dir()
    _, val_files = split_files(source_files(root), spec.val_fraction)
    return _encode_files(root, val_files, tokenizer)


# -- batches ---------------------------------------------------------------------------------


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return stream[starts[:, None] + np.arange(length)]


def sample_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int,
                 arith_fraction: float) -> torch.Tensor:
    """``[batch, seq_len + 1]`` token windows for ``step``: text rows first, then addition rows.

    A pure function of its arguments: resuming at step s draws the same batch as an unbroken
    run. The number of addition rows is ``round(batch * arith_fraction)`` every step.
    """
    rng = np.random.default_rng([seed, 3, step])
    n_arith = round(batch * arith_fraction)
    n_text = batch - n_arith
    length = seq_len + 1
    text = _windows(corpus.text_train,
                    rng.integers(0, corpus.text_train.size - length + 1, size=n_text), length)
    arith = _windows(corpus.arith_train,
                     rng.integers(0, corpus.arith_train.size - length + 1, size=n_arith), length)
    return torch.from_numpy(np.concatenate([text, arith]).astype(np.int64))


def val_windows(corpus: Corpus, n: int, seq_len: int) -> torch.Tensor:
    """``[n', seq_len + 1]`` evenly spaced, non-overlapping windows of the text validation split."""
    length = seq_len + 1
    n = min(n, corpus.text_val.size // length)
    stride = corpus.text_val.size // max(n, 1)
    starts = np.arange(n) * stride
    return torch.from_numpy(_windows(corpus.text_val, starts, length).astype(np.int64))
