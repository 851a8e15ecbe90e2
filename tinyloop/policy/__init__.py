"""Scheduling policy without I/O: plain, deterministic classes that the actors drive.

Nothing here imports trio or reads a clock; callers pass the time in.
"""

from __future__ import annotations

from tinyloop.policy.admission import (
    Admission as Admission,
    AdmissionPredictor as AdmissionPredictor,
    AdmissionStatistics as AdmissionStatistics,
    Decision as Decision,
    PredictorStatistics as PredictorStatistics,
    least_loops as least_loops,
)
from tinyloop.policy.queue import PriorityQueue as PriorityQueue, QueueStatistics as QueueStatistics
