"""The planning core: schedules, execution plans, the memory simulator and baseline strategies.

Nothing here imports TensorFlow.
"""

from tfremat.plan.execution import ExecutionPlan, Op, Statement, build_plan
from tfremat.plan.schedule import (
    Schedule,
    checkpoint_all_s,
    prune_s,
    schedule_from_keep_matrix,
    solve_r_given_s,
    validate_schedule,
)
from tfremat.plan.simulator import SimulationResult, simulate

__all__ = [
    "ExecutionPlan",
    "Op",
    "Statement",
    "build_plan",
    "Schedule",
    "checkpoint_all_s",
    "prune_s",
    "schedule_from_keep_matrix",
    "solve_r_given_s",
    "validate_schedule",
    "SimulationResult",
    "simulate",
]
