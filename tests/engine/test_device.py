"""Every tensor the engine makes lands on the model's device.

The model and its KV pool sit on the CPU while ``torch.device("meta")`` is the default device:
a tensor created without an explicit device (``torch.tensor``, ``arange``, ``zeros``, ``full``)
then lands on ``meta`` and the first op mixing it with a CPU tensor fails. So a full generate in
every mode pins down each creation site that would leave a CUDA engine's index tensors on the
host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.engine.test_engine import req
from tinyloop.engine.engine import Engine
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import ExitRule

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, presence_penalty=0.3,
                         frequency_penalty=0.2, repetition_penalty=1.1, seed=7, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT = list(range(20, 33))

REQUESTS = [
    req(PROMPT, max_tokens=5, loops=3, sampling=GREEDY),
    req(PROMPT, max_tokens=5, loops=4, cache_window=2, sampling=SAMPLED),
    req(PROMPT, max_tokens=4, loops=2, warm_start=True, warm_start_from="normed", sampling=SAMPLED),
    req(PROMPT, max_tokens=6, mode="speculative", loops=3, draft_ahead=3, sampling=GREEDY),
    req(PROMPT, max_tokens=6, mode="speculative", loops=3, draft_ahead=2, sampling=SAMPLED),
    req(PROMPT, max_tokens=6, mode="tree", loops=3, draft_ahead=2, k_branches=2, sampling=GREEDY),
    req(PROMPT, max_tokens=4, mode="beam", num_beams=3, loops=2),
    req(PROMPT, max_tokens=4, loops=6, exit=ExitRule.of("kl", 1e9, min_loops=2, exited_kv="skip"),
        sampling=GREEDY),
    req(PROMPT, max_tokens=4, loops=6, exit=ExitRule.of("kl", 1e9, min_loops=2, exited_kv="copy_latest"),
        sampling=GREEDY),
    req(PROMPT, max_tokens=3, loops=4, exit=ExitRule.of("gate", 0.5), sampling=GREEDY),
    req(PROMPT, max_tokens=3, loops=4, exit=ExitRule.of("gate_select", 0.5), sampling=GREEDY),
]


class NoMetaResults(TorchFunctionMode):
    """Raise at the op that produced a tensor on ``meta``: the model lives on the CPU, so such a
    tensor was created without a device (some meta/CPU mixes compute garbage instead of raising)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, tuple | list) else (out,)
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in results):
            raise AssertionError(f"{getattr(func, '__name__', func)} made a tensor off the model's device")
        return out


@contextmanager
def default_device_meta() -> Iterator[None]:
    """``meta`` as the default device, and every op that lands on it an error."""
    with torch.device("meta"), NoMetaResults():
        yield


def make_engine(kv_mode: str) -> Engine:
    """The tiny preset with an exit gate (the gate rules run too), peaked random weights."""
    model = init_model(PRESETS["tiny"].replace(max_position=128, exit_gate=True), seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return Engine(model, default_tokenizer(), max_seq_len=128, block_size=8, kv_mode=kv_mode)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    out = {mode: make_engine(mode)
           for mode in ("full", "int4", "h-mode", "h-mode+int4")}
    yield out


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    return [r.tokens for r in engine.generate_many(requests)]


@pytest.mark.parametrize("mode", ["full", "int4", "h-mode", "h-mode+int4"])
def test_generate_creates_no_tensor_off_the_model_device(engines: dict[str, Engine], mode: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    engine = engines[mode]
    expected = run_all(engine, REQUESTS)
    with default_device_meta():
        got = run_all(engine, REQUESTS)
    assert got == expected
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no speculation fell back
    assert engine.kv_statistics().blocks_used == 0
