"""Train TinyLoop's shipped byte-level BPE tokenizer and write ``tinyloop/data/tokenizer.json``.

The corpus is this Python's own standard library (``.py`` sources, test suites left out), so
the build needs no download and gives the same vocabulary for the same Python version. Digits
are split one per pre-token before the byte-level step, so ``417+386=803`` is one token per
digit: the arithmetic tasks looped models are trained on need that.

Usage::

    python3 scripts/build_tokenizer.py [--output PATH] [--vocab-size 4096] [--max-bytes N]
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 in this order
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "tinyloop" / "data" / "tokenizer.json"


def stdlib_sources(root: Path, max_bytes: int) -> list[Path]:
    """Return the stdlib's ``.py`` files in sorted order, tests skipped, up to ``max_bytes``.

    Sorting makes the corpus, and so the trained merges, the same on every run;
    ``site-packages`` lives under the stdlib directory and is skipped so installed
    packages do not change the vocabulary.
    """
    chosen: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def read_texts(paths: Sequence[Path]) -> Iterator[str]:
    """Yield each file's text, skipping the few stdlib files that are not valid UTF-8."""
    for path in paths:
        try:
            yield path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue


def new_tokenizer() -> Tokenizer:
    """Return an untrained byte-level BPE with individual-digit pre-tokenization."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train the tokenizer on ``texts``; every one of the 256 bytes is in the vocabulary."""
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def check(tokenizer: Tokenizer) -> None:
    """Fail loudly if the special tokens did not land on ids 0, 1, 2."""
    for expected, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected:
            raise SystemExit(f"{token} has id {tokenizer.token_to_id(token)}, expected {expected}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=20_000_000)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Build the tokenizer and write it as JSON."""
    args = parse_args(argv)
    paths = stdlib_sources(Path(sysconfig.get_paths()["stdlib"]), args.max_bytes)
    tokenizer = train(read_texts(paths), args.vocab_size)
    check(tokenizer)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(tokenizer.to_str(), encoding="utf-8")
    print(f"{len(paths)} files -> {tokenizer.get_vocab_size()} tokens -> {args.output}")


if __name__ == "__main__":
    main()
