"""Strategies as values: a name, the function ``(graph, budget=None, **options) -> Schedule``
and the traits callers ask about.

A strategy module marks each strategy with :func:`as_strategy`; :mod:`tfremat.strategies`
lists every one of them by import, so nothing is found by a name string and importing a
module has no registration side effect.

Every strategy takes the same budgets with the same meaning: bytes, a size with a unit
("3.5GiB"), a share of the graph's checkpoint-all peak ("80%" or 0.8), or None for no
budget. :class:`Strategy` parses them, once, for all of them (:func:`parse_graph_budget`);
the body of a strategy sees whole bytes or None.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping

from tfremat.budget import budget_kind, is_share, parse_budget
from tfremat.errors import ArgumentError, GraphError, InfeasibleBudgetError
from tfremat.units import format_bytes_up
from tfremat.graph import DFGraph
from tfremat.plan.schedule import with_fresh_gradient_reads
from tfremat.plan.simulator import checkpoint_all_peak, simulate

__all__ = ["Strategy", "as_strategy", "option_names", "check_options", "parse_graph_budget", "in_user_terms"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A planning strategy: call it as ``strategy(graph, budget=None, **options)``.

    Attributes:
        name: the name users pass (``strategy="optimal"``, ``--strategy optimal``).
        function: the body, ``function(graph, budget_bytes_or_None, **options)``.
        takes_solver_options: it runs a MILP/LP solver and takes the solver options
            (``solver``, ``time_limit``, ``threads``, ...); the heuristic portfolio that
            warm-starts those solvers leaves these out.
        runs_last: a heuristic that the portfolio runs after the others, with less time
            when another already fits (it is slow and rarely the best).
        offloads: it moves activations to host memory and takes ``bandwidth`` (the host
            link); callers that run every strategy include it only with a bandwidth.
        chooses_implementations: it chooses among the graph's operator implementations
            (MONeT), so callers extract the graph with them
            (``extract(..., implementations=True)``).
        fixed_candidates: its candidate schedules do not depend on the budget, which only
            picks the cheapest that fits (the checkpointing families and ``hong``): one
            call under :func:`~tfremat.plan.baselines.recorded_candidates` tells its
            answer at every budget.
    """

    name: str
    function: Callable
    takes_solver_options: bool = False
    runs_last: bool = False
    offloads: bool = False
    chooses_implementations: bool = False
    fixed_candidates: bool = False

    def __call__(self, graph: DFGraph, budget=None, *options, **keyword_options):
        """The schedule for ``graph`` under ``budget`` (any form :func:`parse_graph_budget`
        reads). Every strategy also takes ``implementations=`` (node -> name of one of the
        graph's :class:`~tfremat.graph.Implementation` s; default: every node's own): it then
        plans the graph under that choice, and the schedule records it. A share budget stays
        a share of the graph's own checkpoint-all peak, so choices compare at equal bytes.

        The schedule returned is the one the compiled step runs: with the recomputations
        :func:`~tfremat.plan.schedule.with_fresh_gradient_reads` adds for gradients
        that read an input computed again after their forward value, and checked against
        the budget with them.

        Raises:
            BudgetFormatError: a budget :func:`~tfremat.budget.parse_budget` refuses (zero or
                negative bytes among them), before any work.
        """
        implementations = keyword_options.pop("implementations", None)
        budget_bytes = parse_graph_budget(graph, budget)
        planned = graph
        if implementations:
            # The strategy plans the graph under the choice; the schedule records it, so
            # the simulator and validation see the same graph (MONeT's implementations).
            try:
                planned = graph.with_implementations(implementations)
            except GraphError as exc:
                raise ArgumentError(f"implementations: {exc}") from None
        try:
            schedule = self.function(planned, budget_bytes, *options, **keyword_options)
        except InfeasibleBudgetError as error:
            raise in_user_terms(error, graph, budget) from None
        schedule = schedule.with_implementations(implementations) if implementations else schedule
        # The schedule the step runs: a gradient rebuilt on a recomputed input made an
        # explicit recomputation (build_plan does the same, so a strategy that simulates
        # its candidates has counted it already; one that models memory itself has not).
        fresh = with_fresh_gradient_reads(graph, schedule)
        if fresh is not schedule and budget_bytes is not None:
            peak = simulate(graph, fresh).peak_bytes
            if peak > budget_bytes:
                raise in_user_terms(InfeasibleBudgetError(
                    budget_bytes, min_feasible_bytes=peak, strategy=self.name,
                    detail="its schedule fits only without the forward nodes it must recompute for gradients that "
                           "read an input recomputed after their forward value "
                           "(tfremat.plan.schedule.with_fresh_gradient_reads)",
                ), graph, budget) from None
        return fresh

    @property
    def options(self) -> list[str] | None:
        """The options it takes (:func:`option_names`)."""
        return option_names(self.function)


def as_strategy(name: str, *, takes_solver_options: bool = False, runs_last: bool = False,
                offloads: bool = False, chooses_implementations: bool = False,
                fixed_candidates: bool = False) -> Callable[[Callable], Strategy]:
    """Decorator making ``fn(graph, budget_bytes_or_None, **options)`` the :class:`Strategy`
    ``name``; the module-level name then refers to the strategy, so a direct call parses its
    budget as every caller's does (0.8 was once 80% to ``optimal`` and 0.8 bytes to the
    heuristics)."""

    def decorate(fn: Callable) -> Strategy:
        return Strategy(name, fn, takes_solver_options=takes_solver_options, runs_last=runs_last, offloads=offloads,
                        chooses_implementations=chooses_implementations, fixed_candidates=fixed_candidates)

    return decorate


def option_names(function: Callable) -> list[str] | None:
    """The options ``function`` takes: a strategy (or another solver function) whose first
    two parameters are the graph and the budget (or a cost cap), its options the keyword
    parameters after them. None when it takes any keyword (``**options``)."""
    generic = ["implementations"] if isinstance(function, Strategy) else []  # Strategy.__call__ takes it
    if isinstance(function, Strategy):
        function = function.function
    parameters = list(inspect.signature(function).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters[2:] if p.kind in keyword] + generic


def check_options(function: Callable, options: Mapping[str, object], what: str) -> None:
    """Raises ArgumentError naming every key of ``options`` that ``function`` (described by
    ``what``) takes no option for (see :func:`option_names`).

    Callers that pass user options on check them first, so a misspelt or misplaced option
    is reported at once, by name, rather than as a bare ``TypeError`` after minutes of work.
    """
    accepted = option_names(function)
    if accepted is None:
        return
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ArgumentError(
            f"{what} takes no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(accepted) if accepted else 'none'}"
        )


def parse_graph_budget(graph: DFGraph, budget, reference: int | None = None) -> int | None:
    """``budget`` in bytes for ``graph`` (None stays None: no budget), relative budgets
    being shares of its :func:`checkpoint_all_peak` (``reference`` when the caller has it;
    simulated only for them otherwise).

    :class:`Strategy` applies it to every strategy's budget argument, so every strategy
    takes the same forms with the same meaning.

    Raises:
        BudgetFormatError: see :func:`parse_budget`.
    """
    if budget is None:
        return None
    if not is_share(budget):
        return parse_budget(budget)
    if reference is None:
        reference = checkpoint_all_peak(graph)
    return parse_budget(budget, reference, fixed_bytes=_unmovable_bytes(graph))


def in_user_terms(error: InfeasibleBudgetError, graph: DFGraph, budget,
                  reference: int | None = None) -> InfeasibleBudgetError:
    """``error`` told in the form ``budget`` was given: a share as a share of the same peak
    (the smallest feasible one rounded up to a whole percent, so that it fits), a share of
    activations likewise, bytes as bytes; with the smallest feasible budget split into the
    graph's fixed memory and its activations. ``reference``: the checkpoint-all peak, when
    the caller has it."""
    kind = None if budget is None else budget_kind(budget)
    fixed = _unmovable_bytes(graph)
    if kind in (None, "bytes"):
        return error.in_terms(fixed_bytes=fixed, shown=None)
    if reference is None:
        reference = checkpoint_all_peak(graph)
    if kind == "activations":
        moving = max(reference - fixed, 1)

        def shown(n):
            return f"{math.ceil(100 * max(n - fixed, 0) / moving)}% of activations ({format_bytes_up(n)})"
    else:
        def shown(n):
            return f"{math.ceil(100 * n / reference)}% ({format_bytes_up(n)})"
    return error.in_terms(fixed_bytes=fixed, shown=shown, budget_text=repr(budget))


def _unmovable_bytes(graph: DFGraph) -> int:
    """What no schedule moves: the fixed bytes and the weight gradients held to the end of
    the step (``DFGraph.weight_grads_to_end``), which every step makes whatever it keeps, so
    a share "of activations" means the same with them fixed or held."""
    return graph.fixed_bytes + graph.weight_grads_to_end_bytes
