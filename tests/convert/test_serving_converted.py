"""A converted reference checkpoint served over HTTP: ``/v1/completions`` greedy returns the
reference's greedy continuation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
import trio
from safetensors.torch import load_file

from tests.convert.checkpoints import CHECKPOINTS, converted_engine
from tests.http.conftest import running_server
from tinyloop.requests import GenerationRequest
from tinyloop.settings import Settings

HUGINN = CHECKPOINTS / "huginn-tiny"


@pytest.mark.parametrize(("name", "family", "rotation"), [
    ("huginn-tiny", "huginn", "float32"), ("retrofit-llama-tiny", "retrofit", "input"),
    ("retrofit-olmo-tiny", "retrofit", "float32")])
async def test_v1_completions_greedy_on_a_converted_checkpoint_is_the_references(
        tmp_path: Path, name: str, family: str, rotation: str) -> None:
    fixture = CHECKPOINTS / name
    reference = load_file(str(fixture / "reference_outputs.safetensors"))
    prompt = reference["input_ids"][0].tolist()
    expected = reference["greedy_loops4"].tolist()
    engine = converted_engine(fixture, tmp_path, state_init="zeros")  # the references ran with init_scale=0
    c = engine.config  # the reference's numerics: float32 tables, its rotation dtype, cast then weight
    assert (c.rope_tables, c.rope_compute, c.norm_order) == ("float32", rotation, "cast_then_weight")
    body = {"prompt": prompt, "max_tokens": len(expected), "temperature": 0, "loops": 4, "ignore_eos": True}
    with trio.fail_after(60):
        async with running_server(Settings(port=0), engine) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            resp = await client.post("/v1/completions", json=body)
            native = await client.post("/generate", json={"prompt_tokens": prompt, "max_tokens": len(expected),
                                                          "loops": 4, "ignore_eos": True})
            [card] = (await client.get("/v1/models")).json()["data"]
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == engine.tokenizer.decode(expected)
    assert native.json()["tokens"] == expected
    params = sum(p.numel() for p in engine.model.parameters())
    assert card["family"] == family and card["parameters"] == params and card["quantization"] == "float32"
    assert (card["default_loops"], card["max_loops"], card["max_model_len"]) == (
        engine.config.default_loops, engine.config.max_loops, engine.max_seq_len)
    assert card["exit"]["kind"] == engine.config.exit.kind


async def test_a_converted_parcae_folder_serves_its_loop_dial(tmp_path: Path) -> None:
    """Parcae over ``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` at 1 and 8 loops:
    the served greedy tokens (KV-cached decode) are the reference-exact full forward's, step by
    step over the tokenizer's ids (tests/convert/test_parcae.py checks that forward against the
    reference's logits and trace), the first one the reference's own best; the dial changes them."""
    from tests.convert.test_parcae import FIXTURE, _model_logits

    reference = load_file(str(FIXTURE / "reference_outputs.safetensors"))
    prompt = reference["input_ids"][0].tolist()
    engine = converted_engine(FIXTURE, tmp_path, state_init="zeros")
    n = engine.tokenizer.vocab_size

    def greedy(ids: list[int], loops: int, count: int = 6) -> list[int]:
        ids = list(ids)
        for _ in range(count):
            ids.append(int(_model_logits(engine, ids, loops, last_only=True)[-1, :n].argmax()))
        return ids[-count:]

    chat = [{"role": "user", "content": "Say hi."}]
    chat_prompt = engine.tokenizer.encode(engine.tokenizer.render_chat(chat, template=engine.chat_template,
                                                                       add_generation_prompt=True))
    served: dict[int, list[int]] = {}  # loops -> the tokens /generate returned
    with trio.fail_after(60):
        async with running_server(Settings(port=0), engine) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for loops in (1, 8):
                native = await client.post("/generate", json={"prompt_tokens": prompt, "max_tokens": 6,
                                                              "loops": loops, "ignore_eos": True})
                text = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "loops": loops,
                                                                  "temperature": 0, "ignore_eos": True})
                answer = await client.post("/v1/chat/completions", json={
                    "messages": chat, "max_tokens": 6, "loops": loops, "temperature": 0, "ignore_eos": True})
                for resp in (native, text, answer):
                    assert resp.status_code == 200, resp.text
                served[loops] = native.json()["tokens"]
                assert text.json()["choices"][0]["text"] == engine.tokenizer.decode(native.json()["tokens"])
                assert answer.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(
                    greedy(chat_prompt, loops))
            [card] = (await client.get("/v1/models")).json()["data"]
    for loops in (1, 8):
        assert served[loops] == greedy(prompt, loops)
        assert served[loops][0] == int(reference[f"logits_loops{loops}"][0, -1, :n].argmax())
    assert served[1] != served[8]
    assert card["family"] == "parcae" and card["default_loops"] == 8


@pytest.mark.parametrize("name", ["huginn-tiny", "parcae-tiny", "inkling2-tiny"])
def test_serve_loads_a_model_directory_converting_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          name: str) -> None:
    from tinyloop.convert import cache
    from tinyloop.server import load_engine

    settings = Settings(model_path=str(CHECKPOINTS / name), cache_dir=str(tmp_path / "cache"), max_seq_len=64)
    engine = load_engine(settings)
    assert engine.name == name and engine.config.n_core == 2
    [artifact] = (tmp_path / "cache").glob("*.tinyloop")

    def no_second_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached artifact was converted again")
    monkeypatch.setattr(cache, "convert", no_second_conversion)
    again = load_engine(settings)
    assert again.name == name and list((tmp_path / "cache").glob("*.tinyloop")) == [artifact]


async def test_ouro_exit_selection_over_http_is_the_references(tmp_path: Path) -> None:
    """``exit: {"kind": "gate_select"}`` on ``/generate``: the first token's logprob is the one the
    reference's exit selection gives at threshold 0.5, and differs from the last-step one."""
    ouro = HUGINN.parent / "ouro-tiny"
    reference = load_file(str(ouro / "reference_outputs.safetensors"))
    prompt = reference["input_ids"][0].tolist()
    engine = converted_engine(ouro, tmp_path)
    c = engine.config  # Ouro's reference numerics: float32 tables, rotation in the model dtype, cast then weight
    assert (c.rope_tables, c.rope_compute, c.norm_order) == ("float32", "input", "cast_then_weight")
    got = {}
    with trio.fail_after(60):
        async with running_server(Settings(port=0), engine) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for name, exit_rule in (("select", {"kind": "gate_select", "threshold": 0.5}), ("last", None)):
                body = {"prompt_tokens": prompt, "max_tokens": 1, "loops": 4, "logprobs": True, "exit": exit_rule}
                resp = await client.post("/generate", json=body)
                assert resp.status_code == 200, resp.text
                got[name] = resp.json()["logprobs"][0]
    for name, key in (("select", "logits_threshold0.5_loops4"), ("last", "logits_last_step_loops4")):
        expected = torch.log_softmax(reference[key][0, -1, :engine.tokenizer.vocab_size], -1)
        token = got[name]["token_id"]
        assert token == int(expected.argmax())
        assert abs(got[name]["logprob"] - float(expected[token])) <= 1e-4
    assert got["select"]["logprob"] != pytest.approx(got["last"]["logprob"], abs=1e-3)



async def test_huginn_exit_criteria_and_warm_starts_over_http_are_the_references(tmp_path: Path) -> None:
    """``/generate`` and ``/v1/completions`` with the reference's exit criteria (its names, its KV
    lookup as ``exited_kv: skip``, ``min_steps``) and the normed warm start: the reference's
    tokens and loops per token (``reference_exits.safetensors``, see test_huginn_exits.py)."""
    from tests.convert.test_huginn_exits import PROMPT, cases, reference

    engine = converted_engine(HUGINN, tmp_path, state_init="zeros")
    ref, meta = reference("huginn-tiny"), cases("huginn-tiny")
    sched = meta["kl_sched_full"]
    bodies = {
        "minp_kl_full": {"exit": {"kind": "minp-kl", "threshold": meta["minp_kl_full"]["threshold"],
                                  "exited_kv": "skip"}, "loops": 8},
        "kl_sched_full": {"exit": {"kind": "kl", "threshold": sched["threshold"], "min_steps": 1, "check_every": 2,
                                   "exited_kv": "skip"}, "loops": 8},
        "minimal_warm_normed": {"warm_start": "normed", "loops": 4},
    }
    with trio.fail_after(60):
        async with running_server(Settings(port=0), engine) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for name, knobs in bodies.items():
                resp = await client.post("/generate", json={"prompt_tokens": PROMPT, "max_tokens": 8,
                                                            "ignore_eos": True, **knobs})
                assert resp.status_code == 200, resp.text
                assert resp.json()["tokens"] == ref[f"{name}_tokens"].tolist(), name
                if f"{name}_loops" in ref:
                    expected = [8, *ref[f"{name}_loops"].tolist()]
                    assert resp.json()["mean_loops"] == pytest.approx(sum(expected) / len(expected)), name
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                              "ignore_eos": True, **bodies["minp_kl_full"]})
            assert resp.json()["choices"][0]["text"] == engine.tokenizer.decode(ref["minp_kl_full_tokens"].tolist())


def test_the_context_follows_the_model_down_to_what_the_kv_cache_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With ``TINYLOOP_MAX_SEQ_LEN`` unset, a model built for a long context (Huginn-0125's 4096,
    Ouro's 65536) is served at it, unless one sequence at the default loops would not fit the KV
    cache; a model built for less than 2048 gets the seeds' 2048."""
    from tinyloop.convert import convert
    from tinyloop.engine import kv_budget
    from tinyloop.server import load_engine

    out = tmp_path / "long.tinyloop"
    convert(HUGINN, out, max_position=4096)
    assert load_engine(Settings(model_path=str(out))).max_seq_len == 4096
    assert load_engine(Settings(model_path=str(out), max_seq_len=1000)).max_seq_len == 1000
    assert load_engine(Settings()).max_seq_len == 2048  # the bundled demo model, built for 256
    monkeypatch.setattr(kv_budget, "DEFAULT_KV_BUDGET_MB", 1)
    with caplog.at_level("WARNING", logger="tinyloop"):
        capped = load_engine(Settings(model_path=str(out)))
    assert capped.context_capped_by_kv and 0 < capped.max_seq_len < 4096
    assert "TINYLOOP_KV_CACHE_MB" in caplog.text
    req = GenerationRequest(prompt_tokens=(1, 2, 3), max_tokens=capped.max_seq_len - 3)
    assert capped.kv_blocks_needed(req) <= capped.pool.num_blocks  # a full-context request fits


def test_a_kv_cache_that_holds_no_sequence_at_the_default_loops_refuses_the_model() -> None:
    """Not a server that answers healthy and refuses every request naming max_tokens: the load
    fails, naming the default loops and the KV cache size."""
    from tinyloop.engine.engine import Engine
    from tinyloop.errors import ConfigError
    from tinyloop.model.presets import PRESETS, init_model
    from tinyloop.tokenizer import default_tokenizer

    model = init_model(PRESETS["tiny"].replace(default_loops=16), seed=0)
    with pytest.raises(ConfigError, match=r"default_loops 16 .*kv_cache_mb"):
        Engine(model, default_tokenizer(), kv_cache_mb=0.01)
    assert Engine(model, default_tokenizer(), kv_cache_mb=1).max_seq_len > 0
