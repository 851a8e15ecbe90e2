"""Request validation: every bad field is a RequestError naming it."""

from __future__ import annotations

import math

import pytest

from tinyloop.errors import RequestError
from tinyloop.requests import GenerationRequest, SamplingParams


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": True}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": 2**70}, "seed"),
    ({"stop": "abc"}, "stop"),
    ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt_tokens": ()}, "prompt"),
    ({"prompt_tokens": (1, -2)}, "prompt"),
    ({"prompt_tokens": (1,), "max_tokens": -1}, "max_tokens"),
    ({"prompt_tokens": (1,), "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_tokens": (1,), "max_tokens": False}, "max_tokens"),
    ({"prompt_tokens": (1,), "loops": 0}, "loops"),
    ({"prompt_tokens": (1,), "cache_window": 0}, "cache_window"),
    ({"prompt_tokens": (1,), "mode": "magic"}, "mode"),
])
def test_bad_requests_name_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(RequestError) as info:
        GenerationRequest(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_lists_become_tuples_so_params_stay_frozen_and_hashable() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3])  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,)
    hash(params)
    assert GenerationRequest(prompt_tokens=[1, 2]).prompt_tokens == (1, 2)  # type: ignore[arg-type]


def test_a_result_retimed_keeps_every_other_field() -> None:
    """``GenerationResult.timed`` lists the fields by hand (it is on the hot path): a field added
    to the class and not to it fails here."""
    import dataclasses

    from tinyloop.requests import GenerationResult

    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(GenerationResult)):
        values[f.name] = {"tokens": [i], "text": f"t{i}", "finish_reason": "stop", "stop_reason": "eos",
                          "logprobs": []}.get(f.name, 1000 + i)
    result = GenerationResult(**values)  # type: ignore[arg-type]
    assert result.timed(5.5, 1.5) == dataclasses.replace(result, wall_ms=5.5, time_to_first_token_ms=1.5)
