"""Scheduling policy without I/O: plain, deterministic classes that the actors drive.

Nothing here imports trio or reads a clock; callers pass the time in.
"""

from __future__ import annotations

from tinyloop.policy.admission import Admission as Admission
from tinyloop.policy.admission import AdmissionPredictor as AdmissionPredictor
from tinyloop.policy.admission import AdmissionStatistics as AdmissionStatistics
from tinyloop.policy.admission import Decision as Decision
from tinyloop.policy.admission import PredictorStatistics as PredictorStatistics
from tinyloop.policy.admission import least_loops as least_loops
from tinyloop.policy.queue import PriorityQueue as PriorityQueue
from tinyloop.policy.queue import QueueStatistics as QueueStatistics
