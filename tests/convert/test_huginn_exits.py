"""Huginn's exit criteria, KV policies for exited tokens and warm starts against the reference.

``reference_exits.safetensors`` (in ``huginn-tiny`` and ``huginn-tiny-core4``) holds what the
reference's ``generate_with_adaptive_compute`` (and ``generate_minimal`` with continuous compute)
produced greedily on the fixture's prompt: per case, the 8 tokens, the loops each decoded token
ran, and the logits it sampled from. The cases' settings are in the file's metadata. The
reference's ``full`` cache lookup leaves an exited token's missing loops out of attention
(``exited_kv="skip"``); ``latest-m4`` reads its latest entry of the same core layer
(``"copy_latest"``; it assumes 4 core layers, hence the 4-layer fixture).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.convert.checkpoints import CHECKPOINTS, converted_engine
from tinyloop.engine.engine import Engine
from tinyloop.requests import GenerationChunk, GenerationRequest, SamplingParams
from tinyloop.vocabulary import ExitRule

FIXTURES = ("huginn-tiny", "huginn-tiny-core4")
PROMPT = load_file(CHECKPOINTS / "huginn-tiny" / "reference_outputs.safetensors")["input_ids"][0].tolist()


def cases(fixture: str) -> dict[str, dict[str, Any]]:
    with safe_open(CHECKPOINTS / fixture / "reference_exits.safetensors", "pt") as f:
        meta = f.metadata()
    found: dict[str, dict[str, Any]] = json.loads(meta["cases"])
    return found


def reference(fixture: str) -> dict[str, torch.Tensor]:
    return load_file(CHECKPOINTS / fixture / "reference_exits.safetensors")


ALL = [(fixture, name) for fixture in FIXTURES for name in cases(fixture)]


@cache
def engine_for(fixture: str, tmp: Path) -> Engine:
    return converted_engine(CHECKPOINTS / fixture, tmp, state_init="zeros")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Engine]:
    tmp = tmp_path_factory.mktemp("exits")
    return {fixture: engine_for(fixture, tmp) for fixture in FIXTURES}


def request(case: dict[str, Any], **changes: Any) -> GenerationRequest:
    warm = case.get("warm", "off")
    rule = None
    if case["criterion"] != "none":
        rule = ExitRule.of(case["criterion"], case["threshold"], min_loops=case.get("min_steps", 0) + 1,
                           check_every=case.get("every", 1),
                           exited_kv="skip" if case["lookup"] == "full" else "copy_latest")
    fields: dict[str, Any] = dict(prompt_tokens=tuple(PROMPT), max_tokens=8, loops=case["steps"], exit=rule,
                                  warm_start=warm != "off", warm_start_from="raw" if warm == "off" else warm,
                                  sampling=SamplingParams(temperature=0.0, ignore_eos=True, logprobs=True))
    fields.update(changes)
    return GenerationRequest(**fields)


def run(engine: Engine, req: GenerationRequest) -> list[GenerationChunk]:
    chunks: list[GenerationChunk] = []
    engine.generate_stream(req, chunks.append)
    return chunks


@pytest.mark.parametrize(("fixture", "name"), ALL)
def test_exit_case_equals_the_reference(engines: dict[str, Engine], fixture: str, name: str) -> None:
    case, ref, engine = cases(fixture)[name], reference(fixture), engines[fixture]
    chunks = run(engine, request(case))
    assert [c.token_id for c in chunks] == ref[f"{name}_tokens"].tolist()
    if f"{name}_loops" in ref:  # loops of each decoded token (the first comes from the prefill)
        assert [c.loops_used for c in chunks[1:]] == ref[f"{name}_loops"].tolist()
    assert matches(engine, chunks, ref, name), "the logprob of each token under the logits it was sampled from"


def matches(engine: Engine, chunks: list[GenerationChunk], ref: dict[str, torch.Tensor], name: str) -> bool:
    """Whether ``chunks`` are the reference's tokens, loops and logprobs (within 1e-4)."""
    if [c.token_id for c in chunks] != ref[f"{name}_tokens"].tolist():
        return False
    if f"{name}_loops" in ref and [c.loops_used for c in chunks[1:]] != ref[f"{name}_loops"].tolist():
        return False
    if f"{name}_logits" not in ref:
        return True
    # over the tokenizer's ids: the engine masks the checkpoint's padding rows
    expected = ref[f"{name}_logits"][:, :engine.tokenizer.vocab_size].log_softmax(-1)
    return all(c.logprob is not None and abs(c.logprob.logprob - float(expected[i, c.token_id])) < 1e-4
               for i, c in enumerate(chunks))


@pytest.mark.parametrize(("fixture", "name", "other"), [
    ("huginn-tiny", "latent_diff_full", "copy_latest"),
    ("huginn-tiny-core4", "latent_diff_latest_m4", "skip"),
    ("huginn-tiny", "minimal_warm_normed", "raw"),
])
def test_the_other_policy_gives_other_outputs(engines: dict[str, Engine], fixture: str, name: str,
                                              other: str) -> None:
    """The KV policy for exited tokens and the warm start's source each change the outputs of
    the same case, so the parity above tells them apart."""
    case, ref, engine = cases(fixture)[name], reference(fixture), engines[fixture]
    req = request(case)
    if other == "raw":
        swapped = request(case, warm_start_from="raw")
    else:
        assert req.exit is not None
        swapped = request(case, exit=ExitRule.of(req.exit.kind, req.exit.threshold, exited_kv=other))
    assert matches(engine, run(engine, req), ref, name)
    assert not matches(engine, run(engine, swapped), ref, name)
