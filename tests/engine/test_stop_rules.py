"""``min_tokens`` and ``include_stop_str_in_output`` (vLLM's): before ``min_tokens`` output
tokens, EOS and stop tokens cannot be sampled (in every sampling path and mode) and a stop string
ends nothing; a matched stop string stays in the text when asked."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine.batch_sampling import sample_on_device, sample_rows
from tinyloop.engine.engine import Engine
from tinyloop.engine.sampling import greedy_token, make_generator, sample_token, target_probs
from tinyloop.errors import RequestError
from tinyloop.requests import GenerationChunk, SamplingParams

EOS, STOP = 2, 9
LOGITS = torch.zeros(16).index_fill(0, torch.tensor([0]), 20.0)  # [16] token 0 all but certain
EOS_FIRST = LOGITS.index_fill(0, torch.tensor([EOS]), 40.0)  # [16] unless EOS may come out
STOP_FIRST = LOGITS.index_fill(0, torch.tensor([STOP]), 40.0)


def pick(logits: torch.Tensor, params: SamplingParams, produced: int) -> int:
    return sample_token(logits, params, make_generator(0), prompt_tokens=(), output_tokens=[7] * produced,
                        eos_ids={EOS}).token_id


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_and_stop_tokens_cannot_be_sampled_before_min_tokens(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=(STOP,))
    assert [pick(EOS_FIRST, params, n) for n in range(3)] == [0, 0, EOS]
    assert [pick(STOP_FIRST, params, n) for n in range(3)] == [0, 0, STOP]
    assert pick(EOS_FIRST, SamplingParams(temperature=temperature, stop_token_ids=(STOP,)), 0) == EOS
    ignoring = SamplingParams(temperature=temperature, min_tokens=2, ignore_eos=True)  # EOS is no stop then
    assert pick(EOS_FIRST, ignoring, 0) == EOS


def test_the_helpers_keep_them_out_too() -> None:
    params = SamplingParams(temperature=0.5, min_tokens=1)
    assert greedy_token(EOS_FIRST, params, (), (), {EOS}) == 0
    assert float(target_probs(EOS_FIRST, params, (), (), {EOS})[EOS]) == 0.0
    assert float(target_probs(EOS_FIRST, params, (), [1], {EOS})[EOS]) > 0.9


def test_the_batched_tensor_path_masks_each_row_by_its_own_count() -> None:
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0, min_tokens=2),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=4, min_tokens=3),
              SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(STOP,))]
    logits = torch.stack([EOS_FIRST, EOS_FIRST, EOS_FIRST, EOS_FIRST, STOP_FIRST])
    outputs = [[], [1, 1], [], [1], []]
    want = [0, EOS, EOS, 0, 0]
    assert sample_rows(logits, params, [make_generator(4)] * 5, [[]] * 5, outputs, {EOS}).tolist() == want
    picked = sample_on_device(logits, params, [make_generator(4)] * 5, [[]] * 5, outputs, {EOS})
    assert [r[0] for r in picked if r is not None] == want


# -- the engine ----------------------------------------------------------------------------------

PROMPT = [5, 6, 7]  # greedy: " loop", " loop", " pack", "after", " pack", "after", " pack", " config"
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def eos_pulled(min_tokens: int, **kw: object) -> SamplingParams:
    """EOS biased to come out at every step: only ``min_tokens`` holds it back."""
    return SamplingParams(temperature=0, logit_bias=((EOS, 100.0),), min_tokens=min_tokens, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [{}, {"mode": "speculative"}, {"mode": "tree"}, {"mode": "beam", "num_beams": 3}])
def test_min_tokens_holds_eos_back_in_every_mode(engine: Engine, mode: dict[str, object]) -> None:
    assert engine.generate(req(PROMPT, max_tokens=10, sampling=eos_pulled(0), **mode)).tokens == [EOS]
    result = engine.generate(req(PROMPT, max_tokens=10, sampling=eos_pulled(3), **mode))
    assert result.tokens[-1] == EOS and len(result.tokens) == 4 and EOS not in result.tokens[:3]
    assert (result.finish_reason, result.stop_reason) == ("stop", "eos")


def test_min_tokens_in_a_batch_counts_each_requests_own_output(engine: Engine) -> None:
    reqs = [req(PROMPT, max_tokens=10, sampling=eos_pulled(n)) for n in (1, 4, 2)]
    assert [len(r.tokens) for r in engine.generate_many(reqs)] == [2, 5, 3]


def test_min_tokens_holds_a_stop_token_back(engine: Engine) -> None:
    plain = engine.generate(req(PROMPT, max_tokens=8, sampling=GREEDY)).tokens
    stop = SamplingParams(temperature=0, stop_token_ids=(plain[2],))
    assert engine.generate(req(PROMPT, max_tokens=8, sampling=stop)).tokens == plain[:3]
    held = engine.generate(req(PROMPT, max_tokens=8, sampling=SamplingParams(
        temperature=0, stop_token_ids=(plain[2],), min_tokens=5)))
    assert len(held.tokens) >= 5 and plain[2] not in held.tokens[:5]


def test_a_stop_string_ends_nothing_before_min_tokens(engine: Engine) -> None:
    full = engine.generate(req(PROMPT, max_tokens=8, sampling=GREEDY))
    assert full.text == " loop loop packafter packafter pack config"

    def run(stop: str, min_tokens: int) -> tuple[str, str]:
        r = engine.generate(req(PROMPT, max_tokens=8, sampling=SamplingParams(
            temperature=0, ignore_eos=True, stop=(stop,), min_tokens=min_tokens)))
        return r.text, r.stop_reason
    assert run(" pack", 0) == (" loop loop", "stop_string")
    assert run(" pack", 3) == (" loop loop", "stop_string")  # the 3rd token completes it: counted
    assert run(" pack", 4) == (" loop loop packafter", "stop_string")  # the 3rd is early, the 5th is not
    assert run("loop", 3) == (full.text, "length")  # both before min_tokens: plain text


def test_include_stop_str_in_output_keeps_the_stop_string(engine: Engine) -> None:
    def run(stop: str, include: bool, **kw: object) -> tuple[str, list[GenerationChunk]]:
        chunks: list[GenerationChunk] = []
        r = engine.generate_stream(req(PROMPT, max_tokens=8, sampling=SamplingParams(
            temperature=0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=include, **kw)),  # type: ignore[arg-type]
            chunks.append)
        assert "".join(c.text for c in chunks) == r.text and r.stop_reason == "stop_string"
        return r.text, chunks
    assert run(" pack", False)[0] == " loop loop"
    assert run(" pack", True)[0] == " loop loop pack"
    assert run("pa", True)[0] == " loop loop pa"  # the rest of the token after the stop string is cut
    assert run("ter", True, min_tokens=5)[0] == " loop loop packafter packafter"
    text, chunks = run("loop", True)
    assert text == " loop" and len(chunks) == 1


def test_min_tokens_above_max_tokens_is_refused(engine: Engine) -> None:
    engine.validate(req(PROMPT, max_tokens=4, sampling=SamplingParams(min_tokens=4)))
    with pytest.raises(RequestError, match="min_tokens") as info:
        engine.validate(req(PROMPT, max_tokens=3, sampling=SamplingParams(min_tokens=4)))
    assert info.value.param == "min_tokens"
