"""Embed the TinyLoop runtime in a plain Trio program.

    python examples/embed.py [MODEL.tinyloop]

Without a model path it writes a small random-weight artifact first. Three requests at
different loop counts run concurrently in one continuous batch; one of them streams.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

import tinyloop
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.tokenizer import default_tokenizer


def model_path() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    path = Path(tempfile.mkdtemp()) / "tiny.tinyloop"
    tinyloop.save_artifact(path, init_model(PRESETS["tiny"], seed=0), default_tokenizer())
    return path


async def main() -> None:
    engine = tinyloop.Engine.load(model_path(), max_seq_len=512)
    encode = engine.tokenizer.encode
    settings = tinyloop.Settings(max_batch_size=4)

    async with tinyloop.open_runtime(engine, settings) as rt:
        async def ask(prompt: str, loops: int) -> None:
            req = tinyloop.GenerationRequest(prompt_tokens=tuple(encode(prompt)), max_tokens=16,
                                             loops=loops)
            result = await rt.submit(req)
            print(f"loops={loops:2d} {result.completion_tokens} tokens: {result.text!r}")

        async def stream(prompt: str) -> None:
            req = tinyloop.GenerationRequest(prompt_tokens=tuple(encode(prompt)), max_tokens=16)
            async with rt.submit_stream(req) as chunks:
                async for chunk in chunks:
                    print(f"stream chunk {chunk.index}: {chunk.text!r}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "def fibonacci(n):", 1)
            nursery.start_soon(ask, "def fibonacci(n):", 8)
            nursery.start_soon(stream, "class Stack:")
        print(rt.statistics())


if __name__ == "__main__":
    trio.run(main)
