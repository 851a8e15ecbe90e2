"""``batch_sampling.sample_rows``: a batch sampled in tensor ops (what a GPU runs) picks, row by
row, what ``sampling.sample_token`` picks alone with the same generator, and leaves each
generator where ``sample_token`` leaves it."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tinyloop.engine.batch_sampling import sample_on_device, sample_rows
from tinyloop.engine.sampling import make_generator, sample_batch, sample_token
from tinyloop.requests import SamplingParams

VOCAB = 512


def random_params(rng: random.Random, seed: int) -> SamplingParams:
    greedy = rng.random() < 0.25
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40, VOCAB, VOCAB + 3]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.99]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        seed=seed)


def test_a_batch_picks_what_each_row_picks_alone() -> None:
    rng = random.Random(0)
    mismatches = 0
    for trial in range(40):
        batch = rng.randint(1, 9)
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(trial)) * rng.choice([1.0, 4.0])
        params = [random_params(rng, seed=1000 * trial + b) for b in range(batch)]
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] for _ in range(batch)]
        outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))] for _ in range(batch)]
        alone_gens = [make_generator(p.seed) for p in params]
        alone = [sample_token(logits[b], params[b], alone_gens[b], prompt_tokens=prompts[b],
                              output_tokens=outputs[b]).token_id for b in range(batch)]
        gens = [make_generator(p.seed) for p in params]
        together = sample_rows(logits, params, gens, prompts, outputs).tolist()
        mismatches += sum(a != t for a, t in zip(alone, together))
        for g, h in zip(gens, alone_gens):  # every generator advanced as sample_token advanced it
            assert torch.equal(g.get_state(), h.get_state())
    assert mismatches == 0


def test_a_batch_with_biases_and_min_tokens_picks_what_each_row_picks_alone() -> None:
    """``logit_bias`` and ``min_tokens`` as one scatter each over the rows that have them: every
    row picks what ``sample_token`` picks (rows without them untouched by the scatters)."""
    rng = random.Random(1)
    eos = {0, 7}
    for trial in range(30):
        batch = rng.randint(1, 8)
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        logits[:, 7] += 6.0  # EOS likely: min_tokens decides
        params = []
        for b in range(batch):
            base = random_params(rng, seed=100 * trial + b)
            bias = tuple((rng.randrange(VOCAB), rng.choice([-100.0, -3.0, 2.5, 100.0]))
                         for _ in range(rng.choice([0, 0, 1, 5])))
            params.append(dataclasses.replace(base, logit_bias=bias, min_tokens=rng.choice([0, 0, 2, 5]),
                                              stop_token_ids=tuple(rng.sample(range(VOCAB), rng.choice([0, 2]))),
                                              ignore_eos=rng.random() < 0.2))
        outputs = [[rng.randrange(1, 7) for _ in range(rng.randint(0, 6))] for _ in range(batch)]
        alone = [sample_token(logits[b], params[b], make_generator(params[b].seed), prompt_tokens=[],
                              output_tokens=outputs[b], eos_ids=eos).token_id for b in range(batch)]
        gens = [make_generator(p.seed) for p in params]
        assert sample_rows(logits, params, gens, [[]] * batch, outputs, eos).tolist() == alone
        picked = sample_batch(logits, params, [make_generator(p.seed) for p in params], [[]] * batch, outputs, eos)
        assert [r.token_id for r in picked if r is not None] == alone


def test_sampled_rows_follow_their_distribution() -> None:
    """Many draws of one filtered row land on the kept tokens in their proportions."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).expand(4000, 5)
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(4000)]
    tokens = sample_rows(logits, params, [make_generator(p.seed) for p in params], [[]] * 4000, [[]] * 4000)
    counts = torch.bincount(tokens, minlength=5).float() / 4000
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), dim=0)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], want, atol=0.03)


def test_sample_batch_on_a_device_samples_every_row_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU, ``sample_batch`` hands every row to ``sample_rows`` and brings ids, logprobs
    and the check of the logits back in one transfer: the same picks and logprobs as the host
    path, None for the row with a NaN (and for the row with nothing finite)."""
    import tinyloop.engine.sampling as sampling

    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.9, seed=4),
              SamplingParams(temperature=0, presence_penalty=0.5),
              SamplingParams(temperature=0.7, logprobs=True, seed=5),
              SamplingParams(temperature=1.2, min_p=0.1, seed=6),
              SamplingParams(temperature=0, top_logprobs=3),
              SamplingParams(temperature=0.8, seed=7, top_logprobs=2),
              SamplingParams(temperature=0)]
    logits = torch.cat([logits, logits[:1], logits[1:2], torch.full((1, VOCAB), float("-inf"))])  # [8, V]
    logits[6, 17] = float("nan")
    history = ([[1, 2]] * 8, [[3, 4]] * 8)
    want = sample_batch(logits, params, [make_generator(p.seed) for p in params], *history)
    assert want[6] is None and want[7] is None  # the host path: no usable logits
    batched: list[int] = []

    def spy(*args: object) -> torch.Tensor:
        batched.append(len(args[1]))  # type: ignore[arg-type]
        return sample_rows(*args)  # type: ignore[arg-type]
    monkeypatch.setattr(sampling, "_on_device", lambda t: True)
    monkeypatch.setattr("tinyloop.engine.batch_sampling.sample_rows", spy)
    with Transfers() as transfers:
        got = sample_batch(logits, params, [make_generator(p.seed) for p in params], *history)
    assert got == want and got[3].logprob is not None and len(got[5].logprob.top) == 3  # type: ignore[union-attr]
    assert batched == [8] and transfers.count == 1


class Transfers(TorchFunctionMode):
    """Counts ``Tensor.tolist`` calls: each is a wait for the device and a copy to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_device_logprobs_are_sample_tokens_with_ties_to_the_lower_id() -> None:
    """The chosen token's logprob and the best alternatives, best first, equal values in id
    order, for each row that asks (``top_logprobs`` 0 to past the vocabulary)."""
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(2)).round()  # many equal values
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0),
              SamplingParams(temperature=0, top_logprobs=5), SamplingParams(temperature=0, top_logprobs=20),
              SamplingParams(temperature=0.9, top_logprobs=3, logprobs=True, seed=1)]
    history: list[list[int]] = [[]] * 5
    got = sample_on_device(logits, params, [make_generator(p.seed) for p in params], history, history)
    assert got[1] is not None and got[1][1] is None
    for b in (0, 2, 3, 4):
        want = sample_token(logits[b], params[b], make_generator(params[b].seed), prompt_tokens=[], output_tokens=[])
        row = got[b]
        assert row is not None and want.logprob is not None
        token, lp = row
        assert token == want.token_id and lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(want.logprob.logprob, abs=1e-6)
        assert [i for i, _ in lp.top] == [i for i, _ in want.logprob.top]  # the same ids in the same order
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in want.logprob.top], abs=1e-6)
    assert len(got[3][1].top) == 12 and len(got[4][1].top) == 3  # type: ignore[index,union-attr]  # 20: all 12
