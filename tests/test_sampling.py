"""Sampling is a pure function of logits, params, history and the request's generator."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tinyloop.engine.sampling import (
    SampleResult,
    StopMatcher,
    apply_penalties,
    make_generator,
    sample_batch,
    sample_token,
)
from tinyloop.requests import SamplingParams, TokenLogprob

# Probabilities 0.5, 0.25, 0.15, 0.07, 0.03 at temperature 1.
PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]
LOGITS = torch.tensor([math.log(p) for p in PROBS])  # [5]


def _draw(params: SamplingParams, n: int = 500, seed: int = 0, logits: torch.Tensor = LOGITS) -> list[int]:
    generator = make_generator(seed)
    return [sample_token(logits, params, generator, prompt_tokens=(), output_tokens=()).token_id
            for _ in range(n)]


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])  # [4]
    result = sample_token(logits, SamplingParams(temperature=0), make_generator(0),
                          prompt_tokens=(), output_tokens=())
    assert result == SampleResult(token_id=1, logprob=None)


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = torch.tensor([1.0, 3.0, 0.0, 3.0, 3.0])  # [5]
    result = sample_token(logits, SamplingParams(temperature=0), make_generator(0),
                          prompt_tokens=(), output_tokens=())
    assert result.token_id == 1


def test_greedy_does_not_consume_the_generator() -> None:
    generator = make_generator(7)
    before = generator.get_state()
    sample_token(LOGITS, SamplingParams(temperature=0), generator, prompt_tokens=(), output_tokens=())
    assert torch.equal(generator.get_state(), before)


def test_greedy_applies_penalties() -> None:
    logits = torch.tensor([1.0, 0.9])  # [2]
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    result = sample_token(logits, params, make_generator(0), prompt_tokens=(), output_tokens=(0,))
    assert result.token_id == 1


def test_bfloat16_logits_are_accepted() -> None:
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0], dtype=torch.bfloat16)  # [4]
    result = sample_token(logits, SamplingParams(temperature=0), make_generator(0),
                          prompt_tokens=(), output_tokens=())
    assert result.token_id == 2


# --- filters restrict the support ---------------------------------------------------------------


def test_unfiltered_sampling_reaches_every_token_in_proportion() -> None:
    draws = _draw(SamplingParams(), n=4000)
    counts = Counter(draws)
    assert set(counts) == {0, 1, 2, 3, 4}
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_tiny_temperature_is_one_hot_and_finite() -> None:
    assert set(_draw(SamplingParams(temperature=1e-30), n=300)) == {0}


def test_low_temperature_sharpens() -> None:
    # At T=0.1 token 1 is 2**-10 as likely as token 0 relative to T=1 odds of 1/2.
    counts = Counter(_draw(SamplingParams(temperature=0.1), n=2000))
    assert counts[0] > 1990
    assert set(counts) <= {0, 1}


def test_top_k_restricts_support() -> None:
    assert set(_draw(SamplingParams(top_k=2))) == {0, 1}
    assert set(_draw(SamplingParams(top_k=1))) == {0}


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    assert set(_draw(SamplingParams(top_p=0.7))) == {0, 1}  # 0.5 < 0.7 <= 0.75
    assert set(_draw(SamplingParams(top_p=0.8))) == {0, 1, 2}  # 0.75 < 0.8 <= 0.9
    assert set(_draw(SamplingParams(top_p=0.01))) == {0}  # always at least one token


def test_top_p_stops_as_soon_as_mass_reaches_it() -> None:
    # top_p set to exactly the float32 mass of the two best tokens: the third is not needed.
    values = torch.softmax(LOGITS, dim=-1)  # [5] already in descending order
    two = float((torch.cumsum(values, dim=-1) - values)[2])
    assert set(_draw(SamplingParams(top_p=two))) == {0, 1}


def test_top_p_measures_mass_after_top_k() -> None:
    # Within top_k=3 the mass is 0.5/0.9, 0.25/0.9, ...: 0.556 + 0.278 = 0.833 >= 0.8.
    assert set(_draw(SamplingParams(top_k=3, top_p=0.8))) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    assert set(_draw(SamplingParams(min_p=0.2))) == {0, 1, 2}  # threshold 0.1
    assert set(_draw(SamplingParams(min_p=0.4))) == {0, 1}  # threshold 0.2
    assert set(_draw(SamplingParams(min_p=1.0))) == {0}


def test_filters_after_temperature() -> None:
    # T=2 flattens the ratios to the max to sqrt(p_i / p_0) = 1, .71, .55, .37, .24.
    assert set(_draw(SamplingParams(min_p=0.6))) == {0}
    assert set(_draw(SamplingParams(temperature=2.0, min_p=0.6))) == {0, 1}
    assert set(_draw(SamplingParams(temperature=2.0, min_p=0.3))) == {0, 1, 2, 3}


def test_filters_renormalise() -> None:
    counts = Counter(_draw(SamplingParams(top_k=2), n=4000))
    assert abs(counts[0] / 4000 - 2 / 3) < 0.03


# --- seeds --------------------------------------------------------------------------------------


def test_same_seed_same_draws() -> None:
    params = SamplingParams(temperature=1.3, top_p=0.95)
    assert _draw(params, n=200, seed=1234) == _draw(params, n=200, seed=1234)
    assert _draw(params, n=200, seed=1234) != _draw(params, n=200, seed=1235)


def test_make_generator_seeds() -> None:
    assert make_generator(5).initial_seed() == 5
    assert make_generator(-1).initial_seed() == torch.Generator().manual_seed(-1).initial_seed()
    assert make_generator(2**70 + 3).initial_seed() == 3  # larger than torch's uint64 range
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()


# --- penalties ----------------------------------------------------------------------------------


BASE = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0])  # [5]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(BASE, params, prompt_tokens=[0, 1, 0, 4], output_tokens=[2, 2])
    assert out.tolist() == [1.0, -2.0, 0.25, -3.0, 0.0]  # each seen token penalised once


def test_presence_and_frequency_count_output_only() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(BASE, params, prompt_tokens=[0, 3], output_tokens=[1, 2, 2])
    assert out.tolist() == [2.0, -1.75, -0.5, -3.0, 0.0]


def test_all_penalties_together() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(BASE, params, prompt_tokens=[0], output_tokens=[1, 2, 2])
    assert out.tolist() == [1.0, -2.75, -0.75, -3.0, 0.0]


def test_penalties_do_not_modify_input() -> None:
    logits = BASE.clone()  # [5]
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)
    apply_penalties(logits, params, prompt_tokens=[0, 1], output_tokens=[2])
    assert torch.equal(logits, BASE)


def test_neutral_penalties_leave_logits_unchanged() -> None:
    out = apply_penalties(BASE, SamplingParams(), prompt_tokens=[0, 1], output_tokens=[2])
    assert torch.equal(out, BASE)


def test_negative_presence_penalty_encourages() -> None:
    out = apply_penalties(BASE, SamplingParams(presence_penalty=-1.0), prompt_tokens=[],
                          output_tokens=[3])
    assert out.tolist() == [2.0, -1.0, 0.5, -2.0, 0.0]


# --- logprobs -----------------------------------------------------------------------------------


def test_no_logprob_unless_asked() -> None:
    result = sample_token(LOGITS, SamplingParams(), make_generator(0), prompt_tokens=(),
                          output_tokens=())
    assert result.logprob is None


def test_logprob_is_raw_log_softmax_before_penalties_and_temperature() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0])  # [5]
    params = SamplingParams(temperature=0.5, repetition_penalty=1.7, top_k=2, logprobs=True,
                            top_logprobs=3)
    result = sample_token(logits, params, make_generator(3), prompt_tokens=(1,), output_tokens=(3,))
    expected = torch.log_softmax(logits, dim=-1).tolist()
    assert result.logprob is not None
    assert result.logprob.token_id == result.token_id
    assert result.logprob.logprob == expected[result.token_id]
    # Best first; the tie between ids 1 and 3 goes to the lower id.
    assert result.logprob.top == ((1, expected[1]), (3, expected[3]), (2, expected[2]))


def test_top_logprobs_alone_implies_logprob_and_caps_at_vocab() -> None:
    logits = torch.tensor([0.0, 1.0])  # [2]
    params = SamplingParams(temperature=0, top_logprobs=5)
    result = sample_token(logits, params, make_generator(0), prompt_tokens=(), output_tokens=())
    expected = torch.log_softmax(logits, dim=-1).tolist()
    assert result.logprob == TokenLogprob(1, expected[1], ((1, expected[1]), (0, expected[0])))


def test_logprobs_without_top() -> None:
    params = SamplingParams(temperature=0, logprobs=True)
    result = sample_token(LOGITS, params, make_generator(0), prompt_tokens=(), output_tokens=())
    assert result.logprob == TokenLogprob(0, torch.log_softmax(LOGITS, dim=-1)[0].item(), ())


# --- batches ------------------------------------------------------------------------------------


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_k=20, seed=1),
    SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=True),
    SamplingParams(temperature=1.1, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                   top_logprobs=2, seed=2),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=0.8, seed=3),
    SamplingParams(temperature=0),
]


def test_sample_batch_rows_equal_sample_token_alone() -> None:
    vocab, steps = 64, 12
    logits_gen = torch.Generator().manual_seed(99)
    prompts = [tuple(range(i, i + 5)) for i in range(len(MIXED))]
    batch_gens = [make_generator(10 + i) for i in range(len(MIXED))]
    alone_gens = [make_generator(10 + i) for i in range(len(MIXED))]
    batch_out: list[list[int]] = [[] for _ in MIXED]
    alone_out: list[list[int]] = [[] for _ in MIXED]
    for _ in range(steps):
        logits = torch.randn(len(MIXED), vocab, generator=logits_gen) * 3  # [B, V]
        batch = sample_batch(logits, MIXED, batch_gens, prompts, batch_out)
        alone = [sample_token(logits[i], p, alone_gens[i], prompt_tokens=prompts[i],
                              output_tokens=alone_out[i]) for i, p in enumerate(MIXED)]
        assert batch == alone
        for i, result in enumerate(batch):
            batch_out[i].append(result.token_id)
            alone_out[i].append(alone[i].token_id)
    assert len({tuple(out) for out in batch_out}) > 1  # the rows really differ


def test_a_row_draws_the_same_in_any_batch() -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))  # [B, V]
    params = [MIXED[1], MIXED[3], MIXED[0]]
    history: list[list[int]] = [[1, 2], [3], []]
    full = sample_batch(logits, params, [make_generator(5 + i) for i in range(3)], [[0]] * 3, history)
    reordered = sample_batch(logits.flip(0), params[::-1],
                             [make_generator(7), make_generator(6), make_generator(5)],
                             [[0]] * 3, history[::-1])
    assert reordered[::-1] == full


def test_sample_batch_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one params"):
        sample_batch(torch.zeros(2, 4), [SamplingParams()], [make_generator(0)], [[0]], [[]])


# --- stop strings -------------------------------------------------------------------------------


def test_no_stop_strings_pass_text_through() -> None:
    matcher = StopMatcher(())
    assert matcher.feed("hello ") == ("hello ", False)
    assert matcher.feed("world") == ("world", False)
    assert matcher.flush() == ""


def test_stop_in_the_middle_of_one_feed() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("abc END def") == ("abc ", True)
    assert matcher.stopped


def test_stop_spanning_several_feeds() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("hi <") == ("hi ", False)
    assert matcher.feed("/") == ("", False)
    assert matcher.feed("s") == ("", False)
    assert matcher.feed(">tail") == ("", True)


def test_false_start_is_released() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("a </") == ("a ", False)
    assert matcher.feed("b>") == ("</b>", False)


def test_overlapping_stops_earliest_position_wins() -> None:
    assert StopMatcher(["abc", "bcd"]).feed("xabcd") == ("x", True)
    assert StopMatcher(["bcd", "abc"]).feed("xabcd") == ("x", True)
    assert StopMatcher(["cd", "abcz"]).feed("xabcd") == ("xab", True)


def test_overlapping_stops_across_feeds() -> None:
    matcher = StopMatcher(["abc", "bcd"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("cd") == ("", True)


def test_held_text_is_only_a_possible_stop_prefix() -> None:
    matcher = StopMatcher(["abc", "bcd"])
    assert matcher.feed("zzbc") == ("zz", False)  # "bc" could become "bcd"
    assert repr(matcher) == "StopMatcher(stops=('abc', 'bcd'), held='bc', stopped=False)"


def test_flush_returns_held_text() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("the end ST") == ("the end ", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_text_before_stop_is_emitted_exactly() -> None:
    pieces = ["Hel", "lo, w", "or", "ld!\n", "\nUser", ": more"]
    matcher = StopMatcher(["\n\nUser:", "<|end|>"])
    emitted = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "Hello, world!"


def test_feed_after_stop_raises() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed("ax") == ("a", True)
    with pytest.raises(RuntimeError):
        matcher.feed("more")
    assert matcher.flush() == ""


def test_stop_must_not_be_a_bare_string() -> None:
    with pytest.raises(TypeError):
        StopMatcher("abc")


def test_include_keeps_the_stop_string_and_cuts_what_follows() -> None:
    assert StopMatcher(["END"], include=True).feed("abc END def") == ("abc END", True)
    assert StopMatcher(["abcz", "cd"], include=True).feed("xabcdy") == ("xabcd", True)
    assert StopMatcher(["abc", "ab"], include=True).feed("xabcd") == ("xab", True)  # "ab" completed first
    matcher = StopMatcher(["</s>"], include=True)
    assert matcher.feed("hi </") == ("hi ", False)
    assert matcher.feed("s>tail") == ("</s>", True)


def test_an_unarmed_feed_matches_nothing_but_still_holds_a_possible_start() -> None:
    """Before ``min_tokens``: a complete stop string is text; one that completes once armed,
    begun before, still stops (vLLM looks back over the stop string's length)."""
    matcher = StopMatcher(["END"])
    assert matcher.feed("a END b", armed=False) == ("a END b", False)
    assert matcher.feed(" E", armed=False) == (" ", False)
    assert matcher.feed("ND!") == ("", True)
    assert StopMatcher(["x"]).feed("axb", armed=False) == ("axb", False)


# --- the fast filters against a plain reference -------------------------------------------------


def _reference_support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The surviving token ids, from a full sort and the definitions, filter after filter."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)  # [V]
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    if params.top_k:
        order = order[:params.top_k]
    total = sum(float(probs[i]) for i in order)
    nucleus, mass = [], 0.0
    for i in order:
        nucleus.append(i)
        mass += float(probs[i]) / total
        if mass >= params.top_p:
            break
    best = float(probs[nucleus[0]])
    return {i for i in nucleus if float(probs[i]) >= params.min_p * best}


@pytest.mark.parametrize("params", [
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(top_k=40, top_p=0.8),
    SamplingParams(temperature=1.5, top_k=100, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=0.95, min_p=0.01),
])
def test_filters_match_reference(params: SamplingParams) -> None:
    from tinyloop.engine.sampling import _filtered_probs

    logits = torch.randn(5000, generator=torch.Generator().manual_seed(8)) * 4  # [V]
    support = set(_filtered_probs(logits, params).nonzero().squeeze(-1).tolist())
    assert support == _reference_support(logits, params)


def test_top_p_with_mass_in_a_long_tail() -> None:
    # One token holds 0.3; 70,000 tail tokens (each far below 1e-4 of it) hold the other 0.7,
    # so the nucleus cannot be found among the head alone.
    from tinyloop.engine.sampling import _filtered_probs

    tail = torch.full((70_000,), math.log(0.7 / 70_000)) + torch.linspace(0, 1e-3, 70_000)  # [V-1]
    logits = torch.cat([torch.tensor([math.log(0.3)]), tail])  # [V]
    kept = _filtered_probs(logits, SamplingParams(top_p=0.65)).nonzero().squeeze(-1)  # [S]
    # 0.3 from token 0, then the largest tail tokens (the last ids) up to 0.35 more.
    assert kept[0].item() == 0
    assert kept[1:].tolist() == list(range(70_000 - len(kept) + 2, 70_001))
    # A float32 cumsum over 35k tiny values drifts by ~1e-3 of mass, i.e. some tens of tokens.
    assert abs(len(kept) - 1 - 35_000) <= 100


def test_top_k_keeps_ties_at_the_cut() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])  # [4]
    assert set(_draw(SamplingParams(top_k=2), logits=logits)) == {0, 1, 2}
