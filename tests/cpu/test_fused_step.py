"""A looped model's whole plain decode step as one C call (``cpu.step.FusedStep``): the tokens and
logprobs of the step through ``LoopedLM.forward``'s modules (its blocks stacked, ``FusedBlock``),
in every weight kind, KV pool and model layout it covers; the steps it does not cover (rows of
different loops, exit rules, warm starts, layouts it lacks) run the modules; stale weights are
noticed."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from tests.cpu.test_fused_block import GREEDY, assert_same, engine
from tests.engine.test_engine import req
from tinyloop.cpu import kernels
from tinyloop.cpu.backend import use_cpu_kernels
from tinyloop.engine.engine import Engine
from tinyloop.requests import GenerationResult, SamplingParams
from tinyloop.vocabulary import ExitRule

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels"),
              pytest.mark.usefixtures("one_torch_thread")]

SAME_LOOPS = [req([5, 6, 7], max_tokens=8, loops=3, sampling=GREEDY),
              req(list(range(10, 31)), max_tokens=6, loops=3,
                  sampling=SamplingParams(temperature=0.9, top_k=40, seed=123, ignore_eos=True, logprobs=True))]


def steps(eng: Engine) -> int:
    return eng.model.counters["fused_steps"]


def stepped_and_stacked(make: Callable[[], Engine], requests: list) -> tuple[list[GenerationResult], ...]:
    """The requests on an engine with the whole-step call, then on a twin with the blocks' stacks
    only (a twin, not the same engine: its prefix cache would change the second run's prefill)."""
    eng, twin = make(), make()
    assert eng.model.fused_step is not None
    stepped = eng.generate_many(requests)
    assert steps(eng) > 0
    twin.model.fused_step = None
    stacked = twin.generate_many(requests)
    assert steps(twin) == 0
    return stepped, stacked


LAYOUTS = {
    "default": {},  # concat_linear, randn initial state, final_only norm, a prelude and a coda
    "zeros": {"state_init": "zeros", "loop_norm": "every_loop"},
    "embed": {"state_init": "embed", "injection": "none", "loop_norm": "none"},
    "prelude_norm": {"prelude_norm": True, "embed_scale": 2.5},
    "no_coda": {"n_coda": 0},
    "no_prelude": {"n_prelude": 0, "injection": "none", "state_init": "embed"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("weights", ["float", "int8", "int4", "bf16"])
def test_the_whole_step_is_the_step_through_the_modules(layout: str, weights: str) -> None:
    stepped, stacked = stepped_and_stacked(lambda: engine("pre_ln", weights, **LAYOUTS[layout]), SAME_LOOPS)
    assert_same(stepped, stacked, "float")  # the same kernels in the same order: float32's tolerance


@pytest.mark.parametrize("style", ["sandwich", "peri_ln"])
@pytest.mark.parametrize("kv_mode", [None, "int4"])
def test_block_styles_and_a_4bit_pool(style: str, kv_mode: str | None) -> None:
    stepped, stacked = stepped_and_stacked(lambda: engine(style, "int8", kv_mode=kv_mode), SAME_LOOPS)
    assert_same(stepped, stacked, "float")


def test_a_kv_window_shorter_than_the_loops_reuses_its_slots() -> None:
    windowed = [req([5, 6, 7], max_tokens=8, loops=4, cache_window=2, sampling=GREEDY),
                req([8, 9], max_tokens=8, loops=4, cache_window=2, sampling=GREEDY)]
    stepped, stacked = stepped_and_stacked(lambda: engine("pre_ln", "int8"), windowed)
    assert_same(stepped, stacked, "float")


def test_the_whole_step_against_every_module_unfused() -> None:
    stepped = engine("sandwich", "float").generate_many(SAME_LOOPS)
    eng = engine("sandwich", "float")
    use_cpu_kernels(eng.model, True, fused=False)
    assert eng.model.fused_step is None
    assert_same(stepped, eng.generate_many(SAME_LOOPS), "float")


@pytest.mark.parametrize("requests", [
    [req([5, 6, 7], max_tokens=6, loops=1, sampling=GREEDY), req([8, 9], max_tokens=6, loops=3, sampling=GREEDY)],
    [req([5, 6, 7], max_tokens=6, loops=3, sampling=GREEDY, warm_start=True)],
    [req([5, 6, 7], max_tokens=6, loops=3, sampling=GREEDY, exit=ExitRule.of("kl", 1e-3))],
], ids=["different-loops", "warm-start", "exit-rule"])
def test_steps_it_does_not_cover_run_the_modules(requests: list) -> None:
    eng, twin = engine("pre_ln", "int8"), engine("pre_ln", "int8")
    out = eng.generate_many(requests)
    assert steps(eng) == 0
    use_cpu_kernels(twin.model, True, fused=False)
    assert_same(out, twin.generate_many(requests), "int8")


def test_layouts_it_does_not_cover_have_no_step() -> None:
    assert engine("pre_ln", "int8", injection="diagonal").model.fused_step is None
    assert engine("pre_ln", "int8", loop_output="linear").model.fused_step is None
    eng = engine("pre_ln", "int8", value_embeds=(1,))  # a block that needs the rows' tokens
    assert eng.model.fused_step is None
    eng.generate_many(SAME_LOOPS[:1])


def test_new_weights_make_the_step_stand_down() -> None:
    eng = engine("pre_ln", "int8")
    step = eng.model.fused_step
    assert step is not None and step.current()
    eng.model.packed_head.set_panels(False)  # type: ignore[union-attr]
    eng.model.packed_head.set_panels(True)  # type: ignore[union-attr]  # new panels: the struct is stale
    assert not step.current()
    first = steps(eng)
    out = eng.generate_many(SAME_LOOPS[:1])
    assert steps(eng) == first
    use_cpu_kernels(eng.model, True)
    assert eng.model.fused_step is not None and eng.model.fused_step.current()
    assert_same(out, eng.generate_many(SAME_LOOPS[:1]), "float")
    assert steps(eng) > first


def test_a_copied_model_runs_its_modules_until_given_its_own() -> None:
    eng = engine("pre_ln", "int8")
    twin = copy.deepcopy(eng.model)
    assert twin.fused_step is None
    use_cpu_kernels(twin, True)
    assert twin.fused_step is not None and twin.fused_step.model is twin


def test_a_token_past_the_embedding_is_refused() -> None:
    eng = engine("pre_ln", "int8")
    step = eng.model.fused_step
    assert step is not None
    state = torch.zeros(1, 1, eng.model.config.hidden)
    seq = eng.start(req([5, 6, 7], max_tokens=4, loops=2, sampling=GREEDY))
    eng.step([seq])
    seq.kv.reserve(seq.kv.length + 1)
    ctx = eng.context([seq.kv], [seq.kv.length], 1)
    with pytest.raises(IndexError, match="outside the embedding"):
        step.run(torch.tensor([[eng.model.config.vocab_size]]), ctx, 2, 2, state)
