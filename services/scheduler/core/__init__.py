"""The scheduler's pure core: request bookkeeping, the cluster view, the policies, and every step
decision (``StepScheduler``).

No I/O here: no NATS, Redis, asyncio or wall clock. The service adapter and the simulator drive
the same objects through ``StepScheduler``.
"""

from services.scheduler.core.base import Policy
from services.scheduler.core.decisions import (
    BatchOutcome,
    Decisions,
    Preemption,
    Rejection,
    RejectReason,
    StepAssignment,
    StepOutcome,
)
from services.scheduler.core.events import EventKind, EventQueue
from services.scheduler.core.loop import SchedulingLoop
from services.scheduler.core.memory import PreemptionConfig, Preemptor
from services.scheduler.core.policies import POLICIES, make_config, make_policy, policy_names
from services.scheduler.core.request import CacheMode, Prediction, Request, RequestStatus
from services.scheduler.core.steps import (
    PendingResults,
    ResultsPass,
    StepConfig,
    StepDecisions,
    StepScheduler,
    StoredProgress,
)
from services.scheduler.core.view import ClusterView, InstanceView, serves

__all__ = [
    "POLICIES",
    "CacheMode",
    "ClusterView",
    "Decisions",
    "EventKind",
    "EventQueue",
    "InstanceView",
    "Policy",
    "PendingResults",
    "Prediction",
    "Preemption",
    "PreemptionConfig",
    "Preemptor",
    "RejectReason",
    "Rejection",
    "Request",
    "ResultsPass",
    "RequestStatus",
    "SchedulingLoop",
    "StepAssignment",
    "StepConfig",
    "StepDecisions",
    "StepOutcome",
    "StepScheduler",
    "StoredProgress",
    "BatchOutcome",
    "make_config",
    "make_policy",
    "policy_names",
    "serves",
]
