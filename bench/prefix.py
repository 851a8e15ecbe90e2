"""Time to first token with a shared 1k-token prefix: prefix pool and automatic prefix cache.

    python bench/prefix.py [--threads N] [--repeats 3] [--prefix 1024] [--suffix 32]

On the ``small`` preset (random init, max_seq_len 2048), through the runtime (``submit``, one
output token, so TTFT is the prefill of whatever the prompt's KV does not cover):

- no reuse:            prefix caching off, no registered prefix: the whole prompt is prefilled
- registered prefix:   caching off, the prefix registered with ``runtime.register_prefix``
- auto cache, cold:    caching on, a prefix the cache has never seen
- auto cache, warm:    caching on, the same prefix after one request with another suffix

Each row is the median over ``--repeats`` requests, each with a fresh suffix (and a fresh prefix
where the row needs a cold one). On a shared machine pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Awaitable, Callable

import torch
import trio

import tinyloop
from tinyloop.engine.engine import Engine
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer

MAX_SEQ_LEN = 2048


def make_engine(prefix_caching: bool) -> Engine:
    model = init_model(PRESETS["small"].replace(max_position=MAX_SEQ_LEN), seed=0)
    return Engine(model, default_tokenizer(), max_seq_len=MAX_SEQ_LEN, prefix_caching=prefix_caching)


class Tokens:
    """Random prompt pieces from one generator (fresh tokens every call)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(0)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(10, self.vocab, (n,), generator=self.gen).tolist()


def request(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=1,
                             sampling=SamplingParams(temperature=0, ignore_eos=True))


async def ttft(rt: tinyloop.Runtime, prompt: list[int]) -> float:
    result = await rt.submit(request(prompt))
    assert result.time_to_first_token_ms is not None
    return result.time_to_first_token_ms


async def measure(prefix_caching: bool, body: Callable[[tinyloop.Runtime], Awaitable[float]],
                  repeats: int) -> float:
    engine = make_engine(prefix_caching)
    async with tinyloop.open_runtime(engine) as rt:
        await ttft(rt, [1, 2, 3])  # warm up the kernels
        return statistics.median([await body(rt) for _ in range(repeats)])


async def main(args: argparse.Namespace) -> list[tuple[str, float]]:
    tok = Tokens(PRESETS["small"].vocab_size)
    n, m = args.prefix, args.suffix
    shared = tok(n)

    async def no_reuse(rt: tinyloop.Runtime) -> float:
        return await ttft(rt, tok(n) + tok(m))

    async def registered(rt: tinyloop.Runtime) -> float:
        if rt.statistics().prefix_pool_size == 0:
            await rt.register_prefix(shared)
        return await ttft(rt, shared + tok(m))

    async def cold(rt: tinyloop.Runtime) -> float:
        return await ttft(rt, tok(n) + tok(m))

    async def warm(rt: tinyloop.Runtime) -> float:
        prefix = tok(n)
        await ttft(rt, prefix + tok(m))
        return await ttft(rt, prefix + tok(m))

    return [
        ("no reuse", await measure(False, no_reuse, args.repeats)),
        (f"registered {n}-token prefix", await measure(False, registered, args.repeats)),
        ("auto cache, cold", await measure(True, cold, args.repeats)),
        ("auto cache, warm", await measure(True, warm, args.repeats)),
    ]


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=32)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = trio.run(main, args)
    base = rows[0][1]
    print(f"small preset, random init, max_seq_len {MAX_SEQ_LEN}, prompt = {args.prefix} shared + "
          f"{args.suffix} fresh tokens, median of {args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"{'scenario':<30} {'TTFT ms':>10} {'speed-up':>9}")
    for label, ms in rows:
        print(f"{label:<30} {ms:>10.1f} {base / ms:>8.1f}x")


if __name__ == "__main__":
    cli()
