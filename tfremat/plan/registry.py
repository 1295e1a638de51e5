"""The strategy registry: user-facing names mapped to ``(graph, budget=None, **options) -> Schedule``.

Strategies register themselves with :func:`register` when their module is imported;
the modules listed in ``_STRATEGY_MODULES`` are imported on first lookup, so the planning
core never imports a solver backend it does not use.

Every registered strategy takes the same budgets with the same meaning: bytes, a size
with a unit ("3.5GiB"), a share of the graph's checkpoint-all peak ("80%" or 0.8), or
None for no budget. :func:`register` parses them, once, for all of them
(:func:`tfremat.budget.parse_graph_budget`); the body of a strategy sees whole bytes or None.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping

from tfremat.budget import parse_graph_budget
from tfremat.errors import ArgumentError, TfrematError

__all__ = ["register", "get_strategy", "strategy_names", "option_names", "check_options", "StrategyFn"]

StrategyFn = Callable[..., "object"]

_STRATEGY_MODULES = (
    "tfremat.plan.baselines",
    "tfremat.plan.eviction",
    "tfremat.plan.repair",
    "tfremat.ilp.intervals",
    "tfremat.ilp.strategies",
)
_REGISTRY: dict[str, StrategyFn] = {}
_loaded = False


def register(name: str) -> Callable[[StrategyFn], StrategyFn]:
    """Decorator registering a strategy under ``name``.

    ``fn(graph, budget, *options)`` gets its budget in whole bytes (or None); what is
    registered, and returned in its place so that a direct call means the same, is
    ``fn`` behind :func:`~tfremat.budget.parse_graph_budget`. Parsing here rather than in
    each strategy is what keeps "80%", 0.8 and a byte count meaning the same to all of
    them (they once disagreed: 0.8 was 80% to ``optimal`` and 0.8 bytes to the
    heuristics, which refused "80%"). The wrapper keeps ``fn``'s signature
    (``inspect.signature`` follows ``__wrapped__``), which :func:`option_names` reads.

    The registered strategy raises :class:`~tfremat.errors.BudgetFormatError` for a
    budget :func:`~tfremat.budget.parse_budget` refuses (zero or negative bytes among
    them) before any work.
    """

    def decorate(fn: StrategyFn) -> StrategyFn:
        if name in _REGISTRY and _REGISTRY[name].__wrapped__ is not fn:
            raise TfrematError(f"strategy {name!r} is registered twice")

        @functools.wraps(fn)
        def strategy(graph, budget=None, *options, **keyword_options):
            return fn(graph, parse_graph_budget(graph, budget), *options, **keyword_options)

        _REGISTRY[name] = strategy
        return strategy

    return decorate


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in _STRATEGY_MODULES:
            importlib.import_module(module)
        _loaded = True


def strategy_names() -> list[str]:
    """Every registered strategy name, in registration order."""
    _load()
    return list(_REGISTRY)


def get_strategy(name: str) -> StrategyFn:
    """The strategy function registered as ``name``.

    Callers pass it the user's ``strategy`` argument unchecked, so its errors name that
    argument (a list given for one name was a bare "unhashable type" ``TypeError``).

    Raises:
        ArgumentError: ``name`` is not a string, or no strategy has that name; the
            message lists the known ones.
    """
    _load()
    if not isinstance(name, str):
        raise ArgumentError(f"strategy must be one strategy name (a str), got {name!r}; "
                            f"choose one of: {', '.join(_REGISTRY)}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ArgumentError(f"unknown strategy {name!r}; choose one of: {', '.join(_REGISTRY)}") from None


def option_names(function: Callable) -> list[str] | None:
    """The options ``function`` takes: a strategy (or another solver function) whose first
    two parameters are the graph and the budget (or a cost cap), its options the keyword
    parameters after them. None when it takes any keyword (``**options``)."""
    parameters = list(inspect.signature(function).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters[2:] if p.kind in keyword]


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
