from __future__ import annotations

import dataclasses

import pytest

from tests.engine.test_engine import make_engine
from tinyloop.errors import AdmissionRejected, QueueFullError, RequestError, SchedulerShutdown
from tinyloop.policy import Admission, AdmissionPredictor, Decision, least_loops
from tinyloop.requests import GenerationRequest
from tinyloop.settings import Settings
from tinyloop.vocabulary import ExitRule


def admission(**kw: object) -> Admission:
    kw.setdefault("max_queue_depth", 8)
    return Admission(**kw)  # type: ignore[arg-type]


def check(adm: Admission, **kw: object) -> Decision:
    args: dict[str, object] = dict(queue_depth=0, in_flight=0, slots=1, slo_ms=None, shutting_down=False)
    args.update(kw)
    return adm.check(**args)  # type: ignore[arg-type]


def test_first_request_always_admits() -> None:
    adm = admission()
    decision = check(adm, queue_depth=7, in_flight=5, slo_ms=0.001, loops=8)
    assert decision == Decision(admit=True, loops=8, predicted_wait_ms=None)


def test_queue_full() -> None:
    adm = admission(max_queue_depth=2)
    check(adm, queue_depth=1)
    with pytest.raises(QueueFullError):
        check(adm, queue_depth=2)


def test_shutdown_wins_over_everything() -> None:
    adm = admission(max_queue_depth=1)
    with pytest.raises(SchedulerShutdown):
        check(adm, queue_depth=5, shutting_down=True)


def test_slo_reject_carries_predicted_wait() -> None:
    adm = admission()
    adm.predictor.observe(100.0)
    with pytest.raises(AdmissionRejected) as info:
        check(adm, queue_depth=3, in_flight=1, slo_ms=300.0)
    assert info.value.predicted_wait_ms == 400.0
    assert "400.0 ms" in info.value.reason
    # Exactly at the SLO still admits.
    assert check(adm, queue_depth=3, in_flight=1, slo_ms=400.0).predicted_wait_ms == 400.0


def test_default_slo_applies_when_none_given() -> None:
    adm = admission(default_slo_ms=50.0)
    adm.predictor.observe(100.0)
    with pytest.raises(AdmissionRejected):
        check(adm, in_flight=1)
    assert check(adm, in_flight=1, slo_ms=1000.0).admit


@pytest.mark.parametrize(
    ("queue_depth", "in_flight", "slots", "waves"),
    [(0, 0, 1, 0), (0, 1, 1, 1), (2, 1, 1, 3), (0, 3, 4, 0), (1, 2, 4, 0), (0, 4, 4, 1),
     (3, 4, 4, 1), (4, 4, 4, 2), (9, 4, 4, 3)],
)
def test_wait_formula(queue_depth: int, in_flight: int, slots: int, waves: int) -> None:
    p = AdmissionPredictor()
    assert p.predict_wait_ms(queue_depth, in_flight, slots) is None
    p.observe(40.0)
    assert p.predict_wait_ms(queue_depth, in_flight, slots) == waves * 40.0


def test_ema_math_is_exact() -> None:
    p = AdmissionPredictor(alpha=0.5)
    p.observe(100.0)
    assert p.ema_service_ms == 100.0
    p.observe(200.0)
    assert p.ema_service_ms == 150.0
    p.observe(50.0)
    assert p.ema_service_ms == 100.0
    assert p.ema_ms_per_loop_token is None
    p.observe(800.0, loops=8, tokens=10)  # 10 ms per loop-token
    p.observe(400.0, loops=2, tokens=10)  # 20 ms per loop-token
    assert p.ema_ms_per_loop_token == 15.0
    assert p.predict_service_ms(4, 10) == 600.0
    stats = p.statistics()
    assert (stats.observations, stats.loop_observations, stats.ema_service_ms) == (5, 2, 425.0)


def test_default_alpha_and_bad_input() -> None:
    p = AdmissionPredictor()
    p.observe(100.0)
    p.observe(200.0)
    assert p.ema_service_ms == pytest.approx(120.0)
    with pytest.raises(ValueError):
        p.observe(-1.0)
    with pytest.raises(ValueError):
        AdmissionPredictor(alpha=0.0)


def downgrading(min_loops: int = 1) -> Admission:
    adm = admission(downgrade=True, min_loops=min_loops)
    adm.predictor.observe(800.0, loops=8, tokens=10)  # service 800 ms, 10 ms per loop-token
    return adm


def test_downgrade_picks_the_largest_loops_that_fits() -> None:
    # wait 800 (one request ahead); at 10 tokens a loop costs 100 ms; 800 + 5*100 = 1300.
    decision = check(downgrading(), in_flight=1, slo_ms=1300.0, loops=8, max_tokens=10)
    assert decision == Decision(admit=True, loops=5, predicted_wait_ms=800.0,
                                predicted_service_ms=500.0, downgraded=True)
    decision = check(downgrading(), in_flight=1, slo_ms=1399.0, loops=8, max_tokens=10)
    assert decision.loops == 5


def test_downgrade_keeps_requested_loops_when_they_fit() -> None:
    decision = check(downgrading(), in_flight=1, slo_ms=5000.0, loops=8, max_tokens=10)
    assert (decision.loops, decision.downgraded, decision.predicted_service_ms) == (8, False, 800.0)


def test_downgrade_rejects_below_the_floor() -> None:
    adm = downgrading(min_loops=6)
    with pytest.raises(AdmissionRejected) as info:
        check(adm, in_flight=1, slo_ms=1300.0, loops=8, max_tokens=10)
    assert info.value.predicted_wait_ms == 800.0
    assert check(adm, in_flight=1, slo_ms=1400.0, loops=8, max_tokens=10).loops == 6


def test_downgrade_never_goes_below_the_requests_own_floor() -> None:
    # 5 loops would fit the SLO, but the request cannot run below 6 (its draft_loops, say).
    adm = downgrading(min_loops=2)
    with pytest.raises(AdmissionRejected) as info:
        check(adm, in_flight=1, slo_ms=1300.0, loops=8, max_tokens=10, least_loops=6)
    assert "at 6 loops" in str(info.value)
    decision = check(adm, in_flight=1, slo_ms=1400.0, loops=8, max_tokens=10, least_loops=6)
    assert (decision.loops, decision.downgraded) == (6, True)
    # A floor above the requested loops never raises them (validation refuses such a request).
    assert check(adm, in_flight=1, slo_ms=5000.0, loops=4, max_tokens=10, least_loops=6).loops == 4


LOOPED = [
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8),
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, mode="speculative", draft_loops=3),
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, mode="speculative"),  # default draft
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, mode="speculative", draft_loops=5,
                      cache_window=8),
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, mode="tree", draft_loops=2),
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, exit=ExitRule("kl", 0.1, min_loops=5)),
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, exit=ExitRule("none", min_loops=5)),
    GenerationRequest(prompt_tokens=(1, 2), max_tokens=4, loops=8, cache_window=3),
]


@pytest.mark.parametrize("req", LOOPED, ids=range(len(LOOPED)))
def test_least_loops_is_the_fewest_loops_the_engine_accepts(req: GenerationRequest) -> None:
    """Every loop count a downgrade may pick (least_loops .. loops) passes the engine's checks."""
    engine = make_engine(max_seq_len=64, block_size=8)
    least = least_loops(req)
    for k in range(1, 9):
        lowered = dataclasses.replace(req, loops=k)
        if k >= least:
            engine.validate(lowered)
        else:
            with pytest.raises(RequestError):
                engine.validate(lowered)


def test_downgrade_cannot_beat_a_wait_longer_than_the_slo() -> None:
    with pytest.raises(AdmissionRejected) as info:
        check(downgrading(), in_flight=1, slo_ms=799.0, loops=8, max_tokens=10)
    assert info.value.predicted_wait_ms == 800.0


def test_downgrade_off_or_without_cost_model_uses_the_wait_only_rule() -> None:
    plain = admission()
    plain.predictor.observe(800.0, loops=8, tokens=10)
    assert check(plain, in_flight=1, slo_ms=900.0, loops=8, max_tokens=10).loops == 8
    no_model = admission(downgrade=True)
    no_model.predictor.observe(800.0)
    assert check(no_model, in_flight=1, slo_ms=900.0, loops=8, max_tokens=10).loops == 8


def test_statistics_repr_and_settings() -> None:
    adm = Admission.from_settings(Settings(max_queue_depth=1, downgrade_on_admission=True,
                                           downgrade_min_loops=2, default_slo_ms=1300.0))
    adm.predictor.observe(800.0, loops=8, tokens=10)
    check(adm, in_flight=1, loops=8, max_tokens=10)
    check(adm, loops=8, max_tokens=10)
    for kw in ({"queue_depth": 1}, {"shutting_down": True}, {"in_flight": 2}):
        with pytest.raises((QueueFullError, SchedulerShutdown, AdmissionRejected)):
            check(adm, **kw)
    s = adm.statistics()
    assert (s.admitted, s.downgraded, s.rejected_queue_full, s.rejected_shutdown, s.rejected_slo) == (
        2, 1, 1, 1, 1)
    assert (s.max_queue_depth, s.default_slo_ms, s.downgrade, s.min_loops) == (1, 1300.0, True, 2)
    assert repr(adm).startswith("<Admission max_queue_depth=1 default_slo_ms=1300.0 downgrade=True "
                                "min_loops=2 admitted=2 downgraded=1 rejected(full=1, slo=1, "
                                "shutdown=1) <AdmissionPredictor observations=1")
