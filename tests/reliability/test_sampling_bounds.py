"""The sampling knobs cannot make the logits NaN or inf: what could is refused by name.

The probe poisoned a batch with ``repetition_penalty`` 1e-38 at temperature 1: a seen token's
logit divided by it overflowed float32 to inf, and softmax's ``inf - inf`` made every
probability NaN. Measured on float32 logits in [-100, 100] over the whole grid of extremes,
only a penalty below ~1e-36 (or above ~1e36) leaves float32's range; tiny temperatures (the
sampler shifts by the max and floors the temperature), top-p/top-k/min-p at their ends and
presence/frequency at +-2 stay finite. The bounds: ``repetition_penalty`` in [0.01, 10] (a logit
grows 100x at most), the rest as before; the same bounds guard the Python API.
"""

from __future__ import annotations

import itertools

import httpx
import pytest
import torch
import trio

from tests.http.conftest import running_server
from tests.http.test_errors import Case, problems_with
from tinyloop.engine.sampling import make_generator, sample_batch, target_probs
from tinyloop.errors import RequestError
from tinyloop.requests import MAX_STOP_CHARS, SamplingParams

CHAT, TEXT, NATIVE = "/v1/chat/completions", "/v1/completions", "/generate"
BODIES = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          TEXT: {"prompt": "hi", "max_tokens": 2}, NATIVE: {"prompt": "hi", "max_tokens": 2}}
REFUSED = [  # field, value
    ("repetition_penalty", 1e-38), ("repetition_penalty", 0.009), ("repetition_penalty", 0),
    ("repetition_penalty", -1), ("repetition_penalty", 10.5), ("repetition_penalty", 1e38),
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.5), ("presence_penalty", 2.5), ("presence_penalty", -2.5),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.5),
]
EXTREMES = {"repetition_penalty": (0.01, 10.0), "temperature": (1e-45, 1e-30, 1e-3, 2.0),
            "top_p": (1e-9, 1.0), "top_k": (0, 1), "min_p": (0.0, 1.0),
            "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def test_extreme_allowed_knobs_give_finite_probabilities() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 4096
    logits = torch.rand(vocab, generator=gen) * 200 - 100  # [V] in [-100, 100]
    logits[:2] = torch.tensor([100.0, -100.0])
    prompt, output = list(range(0, vocab, 3)), list(range(50)) * 40  # most tokens seen, often
    for values in itertools.product(*EXTREMES.values()):
        params = SamplingParams(**dict(zip(EXTREMES, values)))
        probs = target_probs(logits, params, prompt, output)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-3, params
    # and the batch sampler draws a token for each row of a batch made of the extremes
    rows = [SamplingParams(temperature=1.0, repetition_penalty=p, top_p=1e-9) for p in (0.01, 10.0)]
    drawn = sample_batch(torch.stack([logits, -logits]), rows, [make_generator(1), make_generator(2)],
                         [prompt, prompt], [output, output])
    assert all(0 <= r.token_id < vocab for r in drawn)


def test_the_old_poison_made_nan() -> None:
    """What the bound stops: the probe's penalty, had it been let through."""
    logits = torch.tensor([100.0, 50.0, -100.0])
    params = SamplingParams(temperature=1.0)
    object.__setattr__(params, "repetition_penalty", 1e-38)  # past validation, as before
    assert torch.isnan(target_probs(logits, params, [0, 1], [])).any()


@pytest.mark.parametrize(("field", "value"),  # the Python API takes temperatures up to 100
                         [(f, v) for f, v in REFUSED if f != "temperature" or v < 0] + [("temperature", 101)])
def test_sampling_params_refuse_what_could_overflow(field: str, value: float) -> None:
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field


def test_sampling_params_refuse_a_stop_string_past_the_limit() -> None:
    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    with pytest.raises(RequestError) as caught:
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),))
    assert caught.value.param == "stop"


async def test_every_route_refuses_the_unsafe_knobs_by_name() -> None:
    cases = [(Case(f"{field}={value} on {path}", path, 400, field), {**body, field: value})
             for path, body in BODIES.items() for field, value in REFUSED]
    long_stop = "x" * (MAX_STOP_CHARS + 1)
    cases += [(Case(f"long stop on {path}", path, 400, "stop.0" if path == NATIVE else "stop"),
               {**body, "stop": [long_stop]})
              for path, body in BODIES.items()]
    problems: list[str] = []
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for case, body in cases:
                problems += problems_with(case, await client.post(case.path, json=body))
            edges = [await client.post(path, json={**body, "temperature": 1.0, "repetition_penalty": p})
                     for path, body in BODIES.items() for p in (0.01, 10)]
    assert not problems, "\n".join(problems)
    assert [r.status_code for r in edges] == [200] * len(edges), [r.text[:200] for r in edges]
