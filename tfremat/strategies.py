"""The catalogue of strategies: every :class:`~tfremat.plan.registry.Strategy` users can name.

Each strategy module is imported here explicitly; the heuristics come from the portfolio
that warm-starts the MILP (:data:`tfremat.ilp.portfolio.HEURISTICS`), the solver-based
strategies after them. Nothing here imports TensorFlow.
"""

from __future__ import annotations

from tfremat.errors import ArgumentError
from tfremat.ilp.portfolio import HEURISTICS
from tfremat.ilp.strategies import solve_approx_lp, solve_optimal
from tfremat.plan.registry import Strategy

__all__ = ["STRATEGIES", "get_strategy", "strategy_names", "solver_strategy_names"]

STRATEGIES: tuple[Strategy, ...] = (*HEURISTICS, solve_optimal, solve_approx_lp)
_BY_NAME = {s.name: s for s in STRATEGIES}


def strategy_names() -> list[str]:
    """Every strategy name, in the catalogue's order."""
    return list(_BY_NAME)


def get_strategy(name: str) -> Strategy:
    """The strategy named ``name``.

    Callers pass it the user's ``strategy`` argument unchecked, so its errors name that
    argument (a list given for one name was a bare "unhashable type" ``TypeError``).

    Raises:
        ArgumentError: ``name`` is not a string, or no strategy has that name; the
            message lists the known ones.
    """
    if not isinstance(name, str):
        raise ArgumentError(f"strategy must be one strategy name (a str), got {name!r}; "
                            f"choose one of: {', '.join(_BY_NAME)}")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ArgumentError(f"unknown strategy {name!r}; choose one of: {', '.join(_BY_NAME)}") from None


def solver_strategy_names() -> list[str]:
    """The strategies that take solver options (``solver``, ``time_limit``, ...)."""
    return [s.name for s in STRATEGIES if s.takes_solver_options]
