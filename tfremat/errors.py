"""The tfremat exception hierarchy.

Every error the library raises on purpose derives from :class:`TfrematError`, so a
caller can catch them all at once, and each carries the facts a caller needs to act
(the node, the budget, the smallest budget that would work) as attributes, not only
in its message. Nothing in tfremat returns a ``feasible=False`` flag instead of raising.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

from tfremat.units import format_bytes, format_bytes_apart, format_bytes_up

__all__ = [
    "TfrematError",
    "ArgumentError",
    "GraphError",
    "ScheduleError",
    "InfeasibleBudgetError",
    "BudgetFormatError",
    "SolverError",
    "SolverTimeLimitError",
    "SolverUnavailableError",
    "SolverLicenseError",
    "ExtractionError",
    "CompileError",
    "failure_status",
    "FIXED_PARTS",
    "fixed_parts",
    "is_int",
    "is_number",
]


#: What a training step's fixed memory holds, as :class:`InfeasibleBudgetError` names it.
FIXED_PARTS = ("weights", "gradients", "optimizer state", "the batch")


def fixed_parts(optimizer) -> tuple[str, ...]:
    """What the fixed memory of a step training with ``optimizer`` holds, as a refused budget
    names it: :data:`FIXED_PARTS`, less "optimizer state" where the optimizer keeps none per
    weight (plain SGD's variables are its step count and learning rate, scalars the
    extraction does not count), or ``optimizer`` is None."""
    variables = [] if optimizer is None else getattr(optimizer, "variables", [])
    if any(len(variable.shape) > 0 for variable in variables):
        return FIXED_PARTS
    return tuple(part for part in FIXED_PARTS if part != "optimizer state")


def is_int(value) -> bool:
    """An integer (numpy's included), and not a bool: what an int argument accepts."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number (numpy's included), and not a bool or a numeric string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class TfrematError(Exception):
    """Base class of every error tfremat raises deliberately."""


class ArgumentError(TfrematError, ValueError):
    """An argument of the wrong type, out of range, or not taken by the function it was
    passed to; the message names the argument and what it accepts. A ``ValueError`` too,
    as Python's own argument errors are."""


class GraphError(TfrematError, ValueError):
    """A data-flow graph is malformed (cycle, bad order, bad cost, dangling edge).

    Attributes:
        node: the node id the problem was found at, or None when it concerns the graph.
    """

    def __init__(self, message: str, node: int | None = None):
        super().__init__(message)
        self.node = node


class ScheduleError(TfrematError, ValueError):
    """A schedule breaks one of the rules of the frontier-advancing stage model.

    Attributes:
        rule: short name of the first violated rule (for example ``"input-resident"``).
        stage: the stage t where it was found, or None.
        node: the node i it concerns, or None.
    """

    def __init__(self, message: str, rule: str, stage: int | None = None, node: int | None = None):
        super().__init__(message)
        self.rule = rule
        self.stage = stage
        self.node = node


class InfeasibleBudgetError(TfrematError):
    """No schedule the strategy can produce fits in the memory budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_feasible_bytes: the smallest peak the strategy reached (None if none ran).
        lower_bound_bytes: a proven lower bound on any schedule's peak, when known.
        strategy: the strategy name.
        proven: no schedule at all fits (a lower bound or a solver proved it), as
            opposed to this strategy not finding one; the advice differs.
        detail: what the strategy said about why.
        fixed_bytes: the memory no schedule moves (weights, gradients, optimizer state, the
            batch), when the graph is known; the message then splits the smallest feasible
            budget into it and the activations planning moves, and says when fixed memory
            alone is over the budget.
        fixed_parts: what the fixed memory holds, as the message names it (default
            :data:`FIXED_PARTS`; :func:`tfremat.value_and_grad` plans no optimizer state).
        shown: how a byte count is written in the message: in the form the user gave the
            budget ("93% (22.80 MiB)" for a share), bytes otherwise; the smallest feasible
            budget in bytes is rounded up at the precision shown, so that copied back as the
            budget it is accepted (:func:`format_bytes_up`).
        budget_text: the budget as the user wrote it ("'70% of activations'"), when the
            message should say it rather than bytes.
        batch: the batch the budget was refused for, as the message opens with it
            ("batch (8, 64, 64, 3), the last batch: 8 samples of 32"), or None.
        advice: what else avoids the refusal, added to the message's advice, or None.
        smallest_as_amount: the smallest feasible budget is named in bytes, as an amount to
            pass as the budget, whatever form the budget was given in: an allocator check
            holds a share below 99% only, and an amount at every size, so a plan that
            recomputes and is held above 99% can only be asked for in bytes
            (:func:`tfremat.allocator_check.planner_refusal_read`).
    """

    def __init__(
        self,
        budget_bytes: float,
        min_feasible_bytes: float | None = None,
        lower_bound_bytes: float | None = None,
        strategy: str | None = None,
        detail: str = "",
        proven: bool = False,
        *,
        fixed_bytes: int | None = None,
        shown: Callable[[float], str] | None = None,
        budget_text: str | None = None,
        fixed_parts: Sequence[str] = FIXED_PARTS,
        batch: str | None = None,
        advice: str | None = None,
        smallest_as_amount: bool = False,
    ):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.strategy = strategy
        self.proven = proven
        self.detail = detail
        self.fixed_bytes = fixed_bytes
        self.shown = shown
        self.budget_text = budget_text
        self.fixed_parts = tuple(fixed_parts)
        self.batch = batch
        self.advice = advice
        self.smallest_as_amount = smallest_as_amount
        super().__init__(self._message())

    def with_changes(self, **changes) -> "InfeasibleBudgetError":
        """The same error with the attributes in ``changes`` (any of ``__init__``'s) replaced."""
        fields = {name: getattr(self, name) for name in (
            "budget_bytes", "min_feasible_bytes", "lower_bound_bytes", "strategy", "detail", "proven", "fixed_bytes",
            "shown", "budget_text", "fixed_parts", "batch", "advice", "smallest_as_amount")}
        return InfeasibleBudgetError(**{**fields, **changes})

    def in_terms(self, *, fixed_bytes: int, shown: Callable[[float], str] | None,
                 budget_text: str | None = None) -> "InfeasibleBudgetError":
        """The same error told in the user's terms (see the attributes); ``budget_text`` is
        the budget as the user wrote it."""
        return self.with_changes(fixed_bytes=fixed_bytes, shown=shown, budget_text=budget_text)

    def with_fixed_parts(self, fixed_parts: Sequence[str]) -> "InfeasibleBudgetError":
        """The same error naming ``fixed_parts`` as what the fixed memory holds."""
        return self.with_changes(fixed_parts=tuple(fixed_parts))

    def for_batch(self, batch: str, advice: str | None = None) -> "InfeasibleBudgetError":
        """The same error naming the batch it was refused for and, in ``advice``, what else
        avoids it (a smaller last batch: ``drop_remainder=True``)."""
        return self.with_changes(batch=batch, advice=advice)

    def _message(self) -> str:
        if self.shown is None:
            budget_text, smallest_text, bound_text = format_bytes_apart(
                self.budget_bytes, self.min_feasible_bytes, self.lower_bound_bytes)
            if self.min_feasible_bytes is not None:
                # Rounded up, so that the figure copied back as the budget is accepted.
                smallest_text = smallest_text.replace(format_bytes(self.min_feasible_bytes),
                                                      format_bytes_up(self.min_feasible_bytes), 1)
        else:
            budget_text, smallest_text, bound_text = (
                None if n is None else self.shown(n)
                for n in (self.budget_bytes, self.min_feasible_bytes, self.lower_bound_bytes))
        if self.budget_text is not None:
            budget_text = f"{self.budget_text} ({format_bytes(self.budget_bytes)})"
        if self.smallest_as_amount and self.min_feasible_bytes is not None:
            smallest_text = f'"{format_bytes_up(self.min_feasible_bytes)}", an amount in bytes'
        fixed_over = self.fixed_bytes is not None and self.fixed_bytes >= self.budget_bytes
        held = ", ".join(self.fixed_parts)
        parts = [f"budget of {budget_text} is infeasible"]
        if self.strategy:
            parts[0] = f"strategy {self.strategy!r}: " + parts[0]
        if self.batch:
            parts[0] = f"{self.batch}: " + parts[0]
        if fixed_over:
            parts.append(f"the fixed memory alone ({held}) is "
                         f"{format_bytes(self.fixed_bytes)}, which no schedule moves")
        if self.min_feasible_bytes is not None:
            text = f"the smallest feasible budget found is {smallest_text}"
            if self.fixed_bytes is not None:
                moving = max(self.min_feasible_bytes - self.fixed_bytes, 0)
                what = "" if fixed_over else f" ({held})"
                text += f": {format_bytes(self.fixed_bytes)} fixed{what} and {format_bytes(moving)} of activations"
            parts.append(text)
        if self.lower_bound_bytes is not None:
            parts.append(f"no schedule can use less than {bound_text}")
        message = "; ".join(parts)
        if self.detail:
            message += f" ({self.detail})"
        if fixed_over:
            smaller = "batch, model or optimizer state" if "optimizer state" in self.fixed_parts else "batch or model"
            advice = f"Raise the budget above the fixed memory, or shrink it: a smaller {smaller}."
        elif self.proven:
            advice = "Raise the budget."
        elif self.strategy == "optimal":
            advice = "Raise the budget or the time limit."
        else:
            advice = "Raise the budget or try strategy='optimal'."
        if self.advice:
            advice += f" {self.advice}"
        return f"{message}. {advice}"


class BudgetFormatError(TfrematError, ValueError):
    """A memory budget could not be parsed."""


class SolverError(TfrematError):
    """A MILP/LP solver failed or returned no usable result."""


class SolverTimeLimitError(SolverError):
    """A time-limited MILP/LP strategy stopped without a schedule, and no heuristic fits.

    Nothing is proven about the budget: a larger time limit or budget may find one. The
    one SolverError that is an outcome of the strategy at this budget rather than a fault
    (compare :func:`failure_status`).

    Attributes:
        budget_bytes: the budget asked for.
        min_feasible_bytes: the smallest peak any heuristic reached, or None.
        time_limit: the time limit in seconds that ran out.
    """

    def __init__(self, message: str, budget_bytes: int, min_feasible_bytes: int | None, time_limit: float | None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.time_limit = time_limit


class SolverUnavailableError(SolverError, ImportError):
    """The requested solver backend is not installed."""


class SolverLicenseError(SolverError):
    """The solver's license does not allow a model of this size."""


class ExtractionError(TfrematError, ValueError):
    """A Keras model cannot be turned into a data-flow graph.

    Attributes:
        layer: the name of the offending layer, or None.
    """

    def __init__(self, message: str, layer: str | None = None):
        super().__init__(message)
        self.layer = layer


class CompileError(TfrematError, ValueError):
    """A schedule cannot be compiled into a training step."""


def failure_status(error: BaseException) -> str | None:
    """The status a comparison's row gives a strategy that stopped with ``error``:
    "infeasible" (no schedule it can produce fits the budget) or "no schedule" (a
    time-limited MILP strategy stopped without one; nothing is proven). None for every
    other error, which callers raise: argument errors, an unavailable or unlicensed
    solver, a failing solver and internal errors are faults, not outcomes at a budget.
    """
    if isinstance(error, InfeasibleBudgetError):
        return "infeasible"
    if isinstance(error, SolverTimeLimitError):
        return "no schedule"
    return None
