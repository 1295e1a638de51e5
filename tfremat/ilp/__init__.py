"""Optimal and LP-approximate rematerialization: Checkmate's MILP (Jain et al., MLSys 2020).

* :func:`solve_optimal` (strategy ``"optimal"``): the MILP, warm-started from the best
  heuristic (:func:`best_baseline`), on HiGHS by default or Gurobi when asked.
* :func:`solve_monet` (strategy ``"monet"``): the same MILP choosing every node's operator
  implementation too (MONeT, Shah et al., ICLR 2021).
* :func:`solve_approx_lp` (strategy ``"approx_lp"``): the LP relaxation with two-phase
  rounding, a feasible schedule plus a lower bound.

Batch-size maximization over these is :func:`tfremat.maxbatch.max_batch_size`. Nothing
here imports TensorFlow.
"""

from tfremat.ilp.approx_lp import solve_approx_lp
from tfremat.ilp.formulation import CheckmateModel, build_milp, memory_lower_bound
from tfremat.ilp.milp import solve_optimal
from tfremat.ilp.monet import solve_monet
from tfremat.ilp.portfolio import best_baseline
from tfremat.ilp.solvers import (
    DEFAULT_SOLVER,
    SOLVERS,
    Progress,
    SolveResult,
    solve_model,
)

__all__ = [
    "CheckmateModel",
    "build_milp",
    "memory_lower_bound",
    "DEFAULT_SOLVER",
    "SOLVERS",
    "Progress",
    "SolveResult",
    "solve_model",
    "best_baseline",
    "solve_approx_lp",
    "solve_optimal",
    "solve_monet",
]
