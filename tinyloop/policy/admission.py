"""Admission control: refuse at once what the runtime cannot serve in time.

Two plain classes, no I/O and no clock (the caller reports service times it measured):

* :class:`AdmissionPredictor` keeps exponential moving averages (EMA) of how long a request holds
  an engine slot (ms from dispatch to its terminal state) and of that time per loop per generated
  token, and predicts the queue wait of a new request.
* :class:`Admission` turns a prediction into a :class:`Decision`, or raises the refusal.

**Wait prediction.** A new request finds ``in_flight`` requests holding slots and
``queue_depth`` queued ahead of it, all served before it. Served in waves of ``slots``, it is at
0-based position ``p = queue_depth + in_flight``, so it starts after ``floor(p / slots)`` service
times::

    predicted_wait_ms = floor((queue_depth + in_flight) / slots) * ema_service_ms

A free slot (``p < slots``) predicts 0. Running requests count as a whole service time, not the
time they have left, which errs towards refusing. Only queue wait is predicted, never the
request's own prefill and decode (seeds/scheduler.md: admission is triage, not an exact bound).
Before the first observation there is no EMA and every request admits.

**Downgrade.** Loops are the one dial that shortens a request, but they shorten only its *own*
service, not its wait. So with ``downgrade`` on and the request's ``loops`` and ``max_tokens``
known, the SLO bounds the predicted completion instead of the wait alone::

    wait + k * max_tokens * ema_ms_per_loop_token <= slo_ms

and the request runs at the largest such ``k <= loops``, never below what the request itself
needs (:func:`least_loops`: a speculative request's ``draft_loops``, its exit rule's
``min_loops``) nor below ``min_loops``. ``ema_ms_per_loop_token`` is the EMA of
``service_ms / (loops * tokens)`` over finished requests: service time taken as linear in loops
and in generated tokens (prefill folded in), ``max_tokens`` as the worst case. If no ``k >=
min_loops`` (or the request's own floor) fits, or the wait alone exceeds the SLO, the request
is rejected. Without a per-loop EMA yet, downgrade mode falls back to the plain wait-only rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from tinyloop.errors import AdmissionRejected, QueueFullError, SchedulerShutdown
from tinyloop.requests import GenerationRequest
from tinyloop.settings import Settings

__all__ = ["Admission", "AdmissionPredictor", "AdmissionStatistics", "Decision", "PredictorStatistics",
           "least_loops"]


def least_loops(req: GenerationRequest) -> int:
    """The fewest loops ``req`` stays valid at, so a downgrade goes no lower: a speculative
    request drafts at ``draft_loops <= loops``, and an adaptive exit rule never exits before its
    ``min_loops``. (A cache window only bounds loops from above: fewer loops keep a speculative
    request's ``cache_window >= loops``.)"""
    floor = 1
    if (spec := req.speculation) is not None:
        floor = max(floor, spec[0])
    if req.exit is not None and req.exit.kind != "none":
        floor = max(floor, req.exit.min_loops)
    return floor


@dataclass(frozen=True, slots=True)
class PredictorStatistics:
    """A snapshot of an :class:`AdmissionPredictor`."""

    observations: int  # service times observed
    ema_service_ms: float | None  # EMA of ms a request holds a slot; None before any observation
    loop_observations: int  # observations that carried loops and tokens
    ema_ms_per_loop_token: float | None  # EMA of service_ms / (loops * tokens)
    alpha: float  # weight of the newest observation


class AdmissionPredictor:
    """EMAs of per-request service time, and the queue-wait prediction built on them.

    ``alpha`` is the weight of each new observation: ``ema = alpha * x + (1 - alpha) * ema``; the
    first observation sets the EMA to itself.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self._alpha = alpha
        self._service: float | None = None
        self._per_loop_token: float | None = None
        self._n = 0
        self._n_loop = 0

    @property
    def ema_service_ms(self) -> float | None:
        return self._service

    @property
    def ema_ms_per_loop_token(self) -> float | None:
        return self._per_loop_token

    def observe(self, service_ms: float, *, loops: int | None = None, tokens: int | None = None) -> None:
        """Record one finished request: ``service_ms`` from dispatch to done.

        With ``loops`` and ``tokens`` (generated) both positive, also update the per-loop-token
        cost that downgrade decisions use.
        """
        if service_ms < 0 or not math.isfinite(service_ms):
            raise ValueError(f"service_ms must be finite and >= 0, got {service_ms}")
        self._service = self._ema(self._service, float(service_ms))
        self._n += 1
        if loops is not None and tokens is not None and loops > 0 and tokens > 0:
            self._per_loop_token = self._ema(self._per_loop_token, service_ms / (loops * tokens))
            self._n_loop += 1

    def predict_wait_ms(self, queue_depth: int, in_flight: int, slots: int) -> float | None:
        """``floor((queue_depth + in_flight) / slots) * ema_service_ms``; None before any data."""
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if self._service is None:
            return None
        waves = (max(0, queue_depth) + max(0, in_flight)) // slots
        return waves * self._service

    def predict_service_ms(self, loops: int, tokens: int) -> float | None:
        """``loops * tokens * ema_ms_per_loop_token``: a request's own service; None before data."""
        if self._per_loop_token is None:
            return None
        return loops * tokens * self._per_loop_token

    def statistics(self) -> PredictorStatistics:
        return PredictorStatistics(self._n, self._service, self._n_loop, self._per_loop_token, self._alpha)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<AdmissionPredictor observations={s.observations} ema_service_ms={s.ema_service_ms} "
                f"ema_ms_per_loop_token={s.ema_ms_per_loop_token} alpha={s.alpha}>")

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else self._alpha * x + (1 - self._alpha) * old


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission. Refusals are raised, never returned, so ``admit`` is always True."""

    admit: bool
    loops: int | None  # loops to run at: the requested loops, or fewer after a downgrade
    predicted_wait_ms: float | None  # predicted queue wait; None before the first observation
    predicted_service_ms: float | None = None  # own service at ``loops`` (downgrade mode only)
    downgraded: bool = False  # True when ``loops`` is below what the request asked for


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    """A snapshot of an :class:`Admission` policy."""

    admitted: int  # decisions returned (downgraded ones included)
    downgraded: int  # admitted at fewer loops than requested
    rejected_queue_full: int  # QueueFullError raised
    rejected_slo: int  # AdmissionRejected raised
    rejected_shutdown: int  # SchedulerShutdown raised
    max_queue_depth: int
    default_slo_ms: float | None
    downgrade: bool
    min_loops: int
    predictor: PredictorStatistics


class Admission:
    """The admission rule: shutdown, then queue depth, then SLO (see the module docstring)."""

    def __init__(self, *, max_queue_depth: int, default_slo_ms: float | None = None,
                 downgrade: bool = False, min_loops: int = 1,
                 predictor: AdmissionPredictor | None = None) -> None:
        if max_queue_depth < 1 or min_loops < 1:
            raise ValueError("max_queue_depth and min_loops must be >= 1")
        self.max_queue_depth = max_queue_depth
        self.default_slo_ms = default_slo_ms
        self.downgrade = downgrade
        self.min_loops = min_loops
        self.predictor = predictor if predictor is not None else AdmissionPredictor()
        self._admitted = self._downgraded = 0
        self._full = self._slo = self._shutdown = 0

    @classmethod
    def from_settings(cls, settings: Settings, predictor: AdmissionPredictor | None = None) -> Admission:
        return cls(max_queue_depth=settings.max_queue_depth, default_slo_ms=settings.default_slo_ms,
                   downgrade=settings.downgrade_on_admission, min_loops=settings.downgrade_min_loops,
                   predictor=predictor)

    def check(self, *, queue_depth: int, in_flight: int, slots: int, slo_ms: float | None,
              shutting_down: bool, loops: int | None = None, max_tokens: int | None = None,
              least_loops: int = 1) -> Decision:
        """Admit a request or raise why not.

        ``least_loops`` is the fewest loops the request itself can run at (see
        :func:`least_loops`): a downgrade picks no fewer.

        ``slo_ms`` None means the policy's ``default_slo_ms``; with neither, only shutdown and
        queue depth can refuse. Raises ``SchedulerShutdown`` when ``shutting_down``,
        ``QueueFullError`` when ``queue_depth >= max_queue_depth``, ``AdmissionRejected`` (with
        ``predicted_wait_ms``) when the SLO cannot be met.
        """
        if shutting_down:
            self._shutdown += 1
            raise SchedulerShutdown("the runtime is shutting down")
        if queue_depth >= self.max_queue_depth:
            self._full += 1
            raise QueueFullError(f"queue is full ({queue_depth}/{self.max_queue_depth} requests)")
        slo = self.default_slo_ms if slo_ms is None else slo_ms
        wait = self.predictor.predict_wait_ms(queue_depth, in_flight, slots)
        if wait is not None and slo is not None and wait > slo:
            self._reject(f"predicted queue wait {wait:.1f} ms exceeds the SLO of {slo:g} ms", wait)
        per_loop = None
        if self.downgrade and loops is not None and max_tokens is not None:
            per_loop = self.predictor.predict_service_ms(1, max_tokens)
        if per_loop is not None and wait is not None and slo is not None and loops is not None:
            return self._downgrade(wait, slo, loops, per_loop, least_loops)
        return self._admit(Decision(admit=True, loops=loops, predicted_wait_ms=wait))

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            admitted=self._admitted, downgraded=self._downgraded, rejected_queue_full=self._full,
            rejected_slo=self._slo, rejected_shutdown=self._shutdown,
            max_queue_depth=self.max_queue_depth, default_slo_ms=self.default_slo_ms,
            downgrade=self.downgrade, min_loops=self.min_loops, predictor=self.predictor.statistics(),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Admission max_queue_depth={s.max_queue_depth} default_slo_ms={s.default_slo_ms} "
                f"downgrade={s.downgrade} min_loops={s.min_loops} admitted={s.admitted} "
                f"downgraded={s.downgraded} rejected(full={s.rejected_queue_full}, "
                f"slo={s.rejected_slo}, shutdown={s.rejected_shutdown}) {self.predictor!r}>")

    def _downgrade(self, wait: float, slo: float, loops: int, per_loop: float, least: int) -> Decision:
        # per_loop: predicted own service per loop at this request's max_tokens.
        floor = min(max(self.min_loops, least), loops)  # never raise a request's loops to meet the floor
        budget = slo - wait
        k = loops if per_loop == 0 else min(loops, math.floor(budget / per_loop))
        while k > floor and wait + k * per_loop > slo:  # guard against float rounding in floor()
            k -= 1
        if k < floor or wait + k * per_loop > slo:
            self._reject(f"predicted queue wait {wait:.1f} ms plus service at {floor} loops "
                         f"({floor * per_loop:.1f} ms) exceeds the SLO of {slo:g} ms", wait)
        return self._admit(Decision(admit=True, loops=k, predicted_wait_ms=wait,
                                    predicted_service_ms=k * per_loop, downgraded=k < loops))

    def _admit(self, decision: Decision) -> Decision:
        self._admitted += 1
        self._downgraded += int(decision.downgraded)
        return decision

    def _reject(self, reason: str, wait: float) -> NoReturn:
        self._slo += 1
        raise AdmissionRejected(reason, predicted_wait_ms=wait)
