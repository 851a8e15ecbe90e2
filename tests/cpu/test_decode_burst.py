"""A lone greedy sequence's burst (``plain.py``, ``FusedStep.burst``, ``tl_decode_burst``): several
tokens per engine step in one C call, each step fed the argmax of the step before. Its tokens,
text, finish reasons and KV are those of one token a step (a twin engine with ``decode_burst=1``),
in every weight kind and layout the whole step covers, through stop tokens, EOS, stop strings and
``max_tokens`` that end it part way, and a prefix cache that reuses what it wrote; rows it does
not cover decode one token a step; a step whose logits cannot be sampled fails the request as
sampling does."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.cpu.test_fused_block import engine
from tests.cpu.test_fused_step import LAYOUTS
from tests.engine.test_engine import req
from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.engine.plain import DEFAULT_DECODE_BURST, MAX_DECODE_BURST
from tinyloop.errors import ConfigError, EngineError, KVCacheExhausted, RequestError
from tinyloop.model.artifact import save_artifact
from tinyloop.model.kvcache import SeqKV
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import Constraint, GenerationRequest, GenerationResult, SamplingParams
from tinyloop.server import load_engines
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import ExitRule

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels"),
              pytest.mark.usefixtures("one_torch_thread")]

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def bursts(eng: Engine) -> int:
    return eng.model.counters["bursts"]


def twins(make: Callable[..., Engine], **changes: object) -> tuple[Engine, Engine]:
    """An engine that bursts (the default) and one that decodes one token a step."""
    burst, single = make(**changes), make(**changes)
    single.decode_burst = 1
    assert burst.decode_burst == DEFAULT_DECODE_BURST > 1
    return burst, single


def one_by_one(eng: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return [eng.generate(r) for r in requests]  # each alone: a lone sequence


def assert_same_results(got: list[GenerationResult], want: list[GenerationResult]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens
        assert a.text == b.text
        assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
        assert (a.loops_used, a.mean_loops) == (b.loops_used, b.mean_loops)


LONE = [req([5, 6, 7], max_tokens=21, loops=1, sampling=GREEDY),  # 20 after the prefill's: 8, 8, 4
        req(list(range(10, 31)), max_tokens=13, loops=3, sampling=GREEDY),
        req([40, 41], max_tokens=9, loops=4, cache_window=2, sampling=GREEDY)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("weights", ["float", "int8", "int4", "bf16"])
def test_a_burst_picks_what_one_token_a_step_picks(layout: str, weights: str) -> None:
    burst, single = twins(lambda: engine("pre_ln", weights, **LAYOUTS[layout]))
    got = one_by_one(burst, LONE)
    assert bursts(burst) == 3 + 2 + 1 and bursts(single) == 0
    assert_same_results(got, one_by_one(single, LONE))
    assert burst.model.counters["fused_steps"] == single.model.counters["fused_steps"]  # one step a token


@pytest.mark.parametrize("style", ["sandwich", "peri_ln"])
@pytest.mark.parametrize("kv_mode", [None, "int4"])
def test_block_styles_and_a_4bit_pool(style: str, kv_mode: str | None) -> None:
    burst, single = twins(lambda: engine(style, "int8", kv_mode=kv_mode))
    assert_same_results(one_by_one(burst, LONE), one_by_one(single, LONE))
    assert bursts(burst) > 0


def greedy_run(prompt: list[int], n: int = 30, loops: int = 2) -> tuple[list[int], str]:
    out = engine("sandwich", "int4").generate(req(prompt, max_tokens=n, loops=loops, sampling=GREEDY))
    return list(out.tokens), out.text


PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize("at", [1, 4, 8, 13])  # inside the first burst, at its end, in the second
def test_a_stop_token_part_way_ends_the_burst_there(at: int) -> None:
    tokens, _ = greedy_run(PROMPT)
    stop = tokens[at]
    first = tokens.index(stop)  # (an earlier repeat of it stops first, in both)
    r = req(PROMPT, max_tokens=30, loops=2, sampling=SamplingParams(temperature=0, stop_token_ids=(stop,)))
    burst, single = twins(lambda: engine("sandwich", "int4"))
    got, want = burst.generate(r), single.generate(r)
    assert_same_results([got], [want])
    assert list(got.tokens) == tokens[:first + 1] and got.stop_reason == "stop_token"
    steps = [eng.model.counters["fused_steps"] for eng in (burst, single)]
    assert steps[0] == steps[1]  # the burst ran no step past the stop


def test_eos_part_way_ends_the_burst_and_ignore_eos_runs_through() -> None:
    tokens, _ = greedy_run(PROMPT)
    burst, single = twins(lambda: engine("sandwich", "int4"))
    for eng in (burst, single):  # a token of the continuation made EOS (the engine's copy of its tokenizer)
        eng.tokenizer = copy.copy(eng.tokenizer)
        eng.tokenizer.eos_ids = eng.eos_ids = frozenset({tokens[6]})
    stopping = req(PROMPT, max_tokens=30, loops=2, sampling=SamplingParams(temperature=0))
    got = burst.generate(stopping)
    assert_same_results([got], [single.generate(stopping)])
    assert got.stop_reason == "eos" and list(got.tokens) == tokens[:tokens.index(tokens[6]) + 1]
    through = burst.generate(req(PROMPT, max_tokens=30, loops=2, sampling=GREEDY))
    assert list(through.tokens) == tokens


def test_a_stop_string_part_way_drops_the_rest() -> None:
    tokens, text = greedy_run(PROMPT)
    mid = len(text) // 3
    stop = text[mid:mid + 3]
    assert stop and stop.strip()
    r = req(PROMPT, max_tokens=30, loops=2, sampling=SamplingParams(temperature=0, stop=(stop,)))
    burst, single = twins(lambda: engine("sandwich", "int4"))
    got = burst.generate(r)
    assert_same_results([got], [single.generate(r)])
    assert got.stop_reason == "stop_string" and len(got.tokens) < len(tokens)


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.7])
def test_the_prefix_cache_keeps_only_what_the_burst_kept(cut: float) -> None:
    """A request whose stop string ends it part way through a burst (the C call ran on past it)
    leaves full KV blocks of its own tokens only: a later prompt that extends it reuses them and
    continues as on an engine without bursts, and as with nothing cached."""
    tokens, text = greedy_run(PROMPT, n=40)
    at = int(len(text) * cut)
    stop = next(text[at:at + n] for n in range(3, 12) if text.find(text[at:at + n]) == at)  # first seen there
    burst, single = twins(lambda: engine("sandwich", "int4"))
    stopping = req(PROMPT, max_tokens=40, loops=2, sampling=SamplingParams(temperature=0, stop=(stop,)))
    seq = burst.start(stopping)
    while not seq.finished:
        burst.step([seq])
    assert seq.stop_reason == "stop_string" and len(seq.output) < len(tokens)
    assert seq.kv.length == len(seq.prompt) + len(seq.output) - 1  # the last token's KV is not kept
    burst.free(seq)
    first = burst.generate(stopping)
    longer = req(PROMPT + list(first.tokens) + [11, 12], max_tokens=12, loops=2, sampling=GREEDY)
    results = [single.generate(stopping), single.generate(longer)]
    again = burst.generate(longer)
    assert again.cached_tokens >= 8  # the stopped request's full blocks (8 positions each) served
    assert_same_results([first, again], results)
    cold = engine("sandwich", "int4")  # (a new engine: nothing cached)
    assert cold.generate(longer).tokens == again.tokens


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(temperature=0, logprobs=True, ignore_eos=True),
    SamplingParams(temperature=0, logit_bias={9: 2.0}, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(temperature=0, min_tokens=4),
], ids=["sampled", "logprobs", "bias", "penalty", "min-tokens"])
def test_rows_that_are_not_plain_greedy_decode_a_token_a_step(sampling: SamplingParams) -> None:
    burst, single = twins(lambda: engine("sandwich", "int8"))
    r = req(PROMPT, max_tokens=12, loops=2, sampling=sampling)
    got = burst.generate(r)
    assert bursts(burst) == 0
    assert_same_results([got], [single.generate(r)])


@pytest.mark.parametrize("request_", [
    req(PROMPT, max_tokens=10, loops=2, sampling=GREEDY, warm_start=True),
    req(PROMPT, max_tokens=10, loops=3, sampling=GREEDY, exit=ExitRule.of("kl", 1e-3)),
    req(PROMPT, max_tokens=10, loops=2, sampling=GREEDY, constraint=Constraint("regex", "[a-z ]{1,40}")),
], ids=["warm-start", "exit-rule", "grammar"])
def test_requests_it_does_not_cover_decode_a_token_a_step(request_: GenerationRequest) -> None:
    burst, single = twins(lambda: engine("sandwich", "int8"))
    got = burst.generate(request_)
    assert bursts(burst) == 0
    assert_same_results([got], [single.generate(request_)])


def test_two_sequences_decode_together_not_in_bursts() -> None:
    burst, single = twins(lambda: engine("sandwich", "int8"))
    both = [req(PROMPT, max_tokens=10, loops=2, sampling=GREEDY), req([9, 8, 7], max_tokens=14, loops=2,
                                                                      sampling=GREEDY)]
    got = burst.generate_many(both)
    # the longer one is alone for its last 4 tokens: one burst of them
    assert bursts(burst) == 1
    assert_same_results(got, single.generate_many(both))


def test_no_room_for_a_burst_decodes_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    burst, single = twins(lambda: engine("sandwich", "int8"))
    reserve = SeqKV.reserve

    def one_at_most(self: SeqKV, new_length: int) -> None:
        if self.length and new_length > self.length + 1:  # (the prompt's reservation goes through)
            raise KVCacheExhausted("no room for a burst")
        reserve(self, new_length)

    monkeypatch.setattr(SeqKV, "reserve", one_at_most)
    got = burst.generate(LONE[0])
    assert bursts(burst) == 0
    monkeypatch.undo()
    assert_same_results([got], [single.generate(LONE[0])])


def test_unusable_logits_part_way_fail_the_request_as_sampling_does() -> None:
    tokens, _ = greedy_run(PROMPT)
    bad = tokens[5]
    first = tokens.index(bad)
    burst, single = twins(lambda: engine("sandwich", "int4"))
    errors, streamed = [], []
    for eng in (burst, single):
        with torch.no_grad():
            eng.model.embed.weight[bad] = float("nan")  # the step fed this token has NaN logits
        seen: list[int] = []
        with pytest.raises(EngineError, match="non-finite logits") as info:
            eng.generate_stream(req(PROMPT, max_tokens=30, loops=2, sampling=GREEDY),
                                lambda chunk, seen=seen: seen.append(chunk.token_id))  # type: ignore[misc]
        errors.append(str(info.value))
        streamed.append(seen)
    assert bursts(burst) > 0
    assert errors[0] == errors[1]
    assert streamed[0] == streamed[1] == tokens[:first + 1]  # what came before, then the failure


def test_the_burst_length_is_checked() -> None:
    made = engine("sandwich", "int8")
    for bad in (0, MAX_DECODE_BURST + 1, True, 2.5, "8"):
        with pytest.raises(RequestError, match="decode_burst"):
            Engine(made.model, made.tokenizer, max_seq_len=64, decode_burst=bad)  # type: ignore[arg-type]
    assert Settings().decode_burst == DEFAULT_DECODE_BURST
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="decode_burst"):
            Settings.from_env({"TINYLOOP_DECODE_BURST": bad})


def test_the_server_takes_its_setting(tmp_path: Path) -> None:
    path = tmp_path / "tiny.tinyloop"
    save_artifact(path, init_model(PRESETS["tiny"], seed=0), default_tokenizer())
    (engine,) = load_engines(Settings.from_env({"TINYLOOP_MODEL_PATH": str(path), "TINYLOOP_DECODE_BURST": "3"}))
    assert engine.decode_burst == 3
