"""One place that makes and runs the HiGHS solver through Pyomo's ``pyomo.contrib.solver`` interface
(``SolverFactory('highs')`` there: persistent, so a re-solve after adding a constraint or changing the
objective only sends the changes to HiGHS)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.solver.common.factory import SolverFactory
from pyomo.contrib.solver.common.results import SolutionStatus, TerminationCondition


class SolverUnavailable(RuntimeError):
    """highspy is not installed or HiGHS cannot start."""


class SolveStatus(enum.IntEnum):
    OPTIMAL = 0  # proven optimal within the MIP gap
    FEASIBLE = 1  # a solution, but a limit stopped the proof (time limit)
    INFEASIBLE = 2
    FAILED = 3  # no solution for another reason (error, time limit before any solution)


@dataclass(frozen=True)
class SolverOptions:
    """Limits passed to HiGHS on every solve."""

    time_limit_s: float = 20.0
    mip_rel_gap: float = 1e-6  # Stage 1 chains solves (lexicographic), so the first must be tight
    threads: int = 1  # deterministic, and the host CPU is shared


def make_highs(options: SolverOptions):
    solver = SolverFactory("highs")
    if not solver.available():
        raise SolverUnavailable("HiGHS is not available: install highspy")
    config = solver.config
    config.time_limit = options.time_limit_s
    config.rel_gap = options.mip_rel_gap
    config.threads = options.threads
    config.load_solutions = False
    config.raise_exception_on_nonoptimal_result = False
    return solver


def run(solver, model: pyo.ConcreteModel) -> SolveStatus:
    """Solve ``model``; load the solution into its variables when there is one."""
    results = solver.solve(model)
    condition = results.termination_condition
    if condition in (
        TerminationCondition.provenInfeasible,
        TerminationCondition.infeasibleOrUnbounded,
        TerminationCondition.locallyInfeasible,
    ):
        return SolveStatus.INFEASIBLE
    if results.solution_status in (SolutionStatus.optimal, SolutionStatus.feasible):
        results.solution_loader.load_vars()
        if condition == TerminationCondition.convergenceCriteriaSatisfied:
            return SolveStatus.OPTIMAL
        return SolveStatus.FEASIBLE
    return SolveStatus.FAILED
