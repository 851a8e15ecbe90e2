"""A converted Inkling-2 loop checkpoint served by the engine over its paged KV pool: the
reference's logits at every pass count (full forward, chunked prefill and cached decode, rows at
different pass counts in one batch), its greedy trace over ``/generate`` and the OpenAI routes at
two pass counts, prefix caching, weight-only modes, and what the family does not define refused
by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file

from tests.convert.checkpoints import (
    CHECKPOINTS,
    cached_decode_logits,
    converted_engine,
    full_logits,
    greedy_tokens,
    max_diff,
)
from tests.http.conftest import running_server
from tinyloop.convert import convert
from tinyloop.engine.engine import Engine
from tinyloop.errors import RequestError
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings
from tinyloop.vocabulary import ExitRule

FIXTURE = CHECKPOINTS / "inkling2-tiny"
TOL = 1e-5  # the fixture's float32 floor is ~6e-6 (tests/convert/test_inkling2.py)
PASSES = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


@pytest.fixture(scope="module")
def trace() -> dict[str, object]:
    data: dict[str, object] = json.loads((FIXTURE / "trace.json").read_text())
    return data


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return converted_engine(FIXTURE, tmp_path_factory.mktemp("inkling2"))


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("passes", PASSES)
def test_the_engine_computes_the_references_logits(engine: Engine, reference: dict[str, torch.Tensor],
                                                   passes: int) -> None:
    ids = reference["input_ids"][0].tolist()
    expected = reference[f"logits_passes{passes}"][0]
    assert max_diff(engine, full_logits(engine, ids, passes), expected) <= TOL
    assert max_diff(engine, cached_decode_logits(engine, ids, passes), expected[-1]) <= TOL


@pytest.mark.parametrize("passes", [1, 3])
def test_chunked_prefill_then_decode_is_the_full_forward(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                         passes: int) -> None:
    """Prefill in chunks of 5 (the short convolutions read their inputs back across chunks)."""
    out = tmp_path / "i.tinyloop"
    convert(FIXTURE, out)
    engine = Engine.load(out, kv_cache_mb=4, prefill_chunk=5)
    ids = reference["input_ids"][0].tolist()
    last = cached_decode_logits(engine, ids, passes)
    assert max_diff(engine, last, reference[f"logits_passes{passes}"][0, -1]) <= TOL


def test_the_greedy_trace_at_every_pass_count(engine: Engine, trace: dict[str, object]) -> None:
    prompt = list(trace["prompt_tokens"])  # type: ignore[call-overload]
    for passes, steps in trace["traces"].items():  # type: ignore[attr-defined]
        assert greedy_tokens(engine, prompt, len(steps), int(passes)) == [s["token"] for s in steps], passes


def test_rows_at_different_pass_counts_share_a_batch(engine: Engine, reference: dict[str, torch.Tensor]) -> None:
    """Pass p runs only the rows asking for more than p; the coda reads each row's last pass."""
    ids = reference["input_ids"][0].tolist()
    cases = [(14, 1), (9, 3), (12, 2), (14, 4)]
    reqs = [GenerationRequest(prompt_tokens=tuple(ids[:n]), loops=p, max_tokens=6, sampling=_greedy())
            for n, p in cases]
    together = [list(r.tokens) for r in engine.generate_many(reqs)]
    assert together == [greedy_tokens(engine, ids[:n], 6, p) for n, p in cases]
    assert len({tuple(t) for t in together}) > 1


def test_a_prefix_cache_hit_gives_the_cold_result(tmp_path: Path) -> None:
    """K, V and the convolutions' inputs live per token in the pool: a cached prefix serves all."""
    out = tmp_path / "i.tinyloop"
    convert(FIXTURE, out)
    engine = Engine.load(out, kv_cache_mb=8, prefix_caching=True, block_size=4)
    prompt = tuple(range(10, 50))
    req = GenerationRequest(prompt_tokens=prompt, loops=2, max_tokens=5, sampling=_greedy())
    cold = engine.generate(req)
    warm = engine.generate(req)
    assert warm.cached_tokens >= 32 and cold.cached_tokens == 0
    assert list(warm.tokens) == list(cold.tokens)
    fresh = Engine.load(out, kv_cache_mb=8, prefix_caching=False)
    assert list(fresh.generate(req).tokens) == list(cold.tokens)


@pytest.mark.parametrize("passes", [2, 3, 4])
def test_a_speculative_chain_drafted_at_one_pass_gives_plain_greedy(engine: Engine, passes: int) -> None:
    """Drafts run one pass inside the verifier's slots (their coda's K, V and convolution inputs
    are written again by the verify forward): the output is plain decoding's."""
    prompt = tuple(range(30, 50))
    plain = engine.generate(GenerationRequest(prompt_tokens=prompt, loops=passes, max_tokens=12, sampling=_greedy()))
    spec = engine.generate(GenerationRequest(prompt_tokens=prompt, loops=passes, max_tokens=12, mode="speculative",
                                             draft_loops=1, draft_ahead=3, sampling=_greedy()))
    assert list(spec.tokens) == list(plain.tokens)
    assert spec.accepted_draft_tokens > 0 and spec.rejected_draft_tokens > 0  # both paths of the verify ran


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_weight_only_modes_quantise_the_experts_too(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                    weights: str) -> None:
    from tinyloop.model.quant import QuantLinear

    out = tmp_path / "i.tinyloop"
    convert(FIXTURE, out)
    engine = Engine.load(out, kv_cache_mb=4, weights=weights)
    experts = [m for name, m in engine.model.named_modules() if ".moe.experts." in name and isinstance(m, QuantLinear)]
    assert len(experts) == 6 * 4 * 2  # every expert's gate_up and down, in every layer
    controllers = [m for name, m in engine.model.named_modules() if ".gates." in name and name.count(".") == 4]
    assert controllers and all(type(m) is torch.nn.Linear for m in controllers)  # rank-wide: kept float32
    ids = reference["input_ids"][0].tolist()
    logits = full_logits(engine, ids, 3)
    expected = reference["logits_passes3"][0]
    n = engine.tokenizer.vocab_size
    agree = (logits[:, :n].argmax(-1) == expected[:, :n].argmax(-1)).float().mean().item()
    assert agree >= (0.7 if weights == "int8" else 0.3)
    assert max_diff(engine, logits, expected) > 0  # quantised: not the float model


def test_bf16_weights_serve(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "i16.tinyloop"
    convert(FIXTURE, out, dtype="bfloat16")
    engine = Engine.load(out, kv_cache_mb=4)
    ids = reference["input_ids"][0].tolist()
    expected = reference["logits_passes3"][0]
    assert max_diff(engine, full_logits(engine, ids, 3), expected) <= 0.03 * expected.abs().max().item()


@pytest.mark.parametrize(("changes", "param"), [
    ({"exit": ExitRule.of("latent_diff")}, "exit"),
    ({"warm_start": True}, "warm_start"),
    ({"cache_window": 1}, "cache_window"),
    ({"mode": "tree"}, "mode"),
])
def test_what_the_family_does_not_define_is_refused_by_name(engine: Engine, changes: dict[str, object],
                                                            param: str) -> None:
    req = GenerationRequest(prompt_tokens=(1, 2, 3), loops=3, max_tokens=2, **changes)  # type: ignore[arg-type]
    with pytest.raises(RequestError) as caught:
        engine.validate(req)
    assert caught.value.param == param


@pytest.mark.parametrize("mode", ["int4", "h-mode"])
def test_kv_modes_other_than_full_are_refused(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "i.tinyloop"
    convert(FIXTURE, out)
    with pytest.raises(RequestError, match=f"kv_cache_mode {mode} is not available for an Inkling-2 model"):
        Engine.load(out, kv_cache_mb=4, kv_mode=mode)


async def test_served_over_http_with_the_pass_dial(engine: Engine, trace: dict[str, object]) -> None:
    """``loops`` is the pass count on every route: the reference's greedy tokens at 1 and 3 passes."""
    prompt = list(trace["prompt_tokens"])  # type: ignore[call-overload]
    steps = trace["traces"]  # type: ignore[index]
    chat = [{"role": "user", "content": "Hi"}]
    rendered = engine.tokenizer.encode(engine.tokenizer.render_chat(chat, template=engine.chat_template))
    with trio.fail_after(60):
        async with running_server(Settings(port=0), engine) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for passes in (1, 3):
                expected = [s["token"] for s in steps[str(passes)]]
                native = await client.post("/generate", json={"prompt_tokens": prompt, "max_tokens": len(expected),
                                                              "loops": passes, "ignore_eos": True})
                assert native.status_code == 200, native.text
                assert native.json()["tokens"] == expected
                body = {"prompt": prompt, "max_tokens": len(expected), "loops": passes, "temperature": 0}
                text = await client.post("/v1/completions", json={**body, "ignore_eos": True})
                assert text.json()["choices"][0]["text"] == engine.tokenizer.decode(expected)
                answer = await client.post("/v1/chat/completions", json={
                    "messages": chat, "max_tokens": 6, "loops": passes, "temperature": 0, "ignore_eos": True})
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(
                    greedy_tokens(engine, rendered, 6, passes))
            refused = await client.post("/generate", json={"prompt_tokens": prompt, "max_tokens": 2, "loops": 3,
                                                           "exit": {"kind": "kl"}})
            [card] = (await client.get("/v1/models")).json()["data"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "exit"
    assert card["family"] == "inkling2" and card["default_loops"] == 3 and card["max_loops"] == 64
