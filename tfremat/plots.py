"""Figures for comparing rematerialization strategies on one graph.

Two views answer the two questions a user has when choosing a strategy:

* :func:`plot_memory_traces`: *where* in the training step the memory goes under each
  plan (the peak, and how much of it the backward pass's recomputation trims);
* :func:`plot_overhead_vs_budget`: *what a memory saving costs*, the extra step time of
  each strategy across budgets, in the style of Checkmate's Figure 4 (Jain et al. 2020)
  and MONeT's Figure 5 (Shah et al. 2021).

Every number comes from :func:`tfremat.plan.simulator.simulate`, so the figures agree with the
planner's reports. matplotlib is an optional dependency (``pip install tfremat[plots]``):
it is imported inside the functions, so ``import tfremat`` never needs it, and figures
are drawn on the Agg canvas directly, without pyplot, so no global backend is switched
and no window is opened.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tfremat.budget import format_bytes
from tfremat.errors import ArgumentError, InfeasibleBudgetError, SolverTimeLimitError
from tfremat.graph import DFGraph
from tfremat.plan.execution import Op
from tfremat.plan.registry import check_options
from tfremat.plan.schedule import Schedule
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import get_strategy

__all__ = ["plot_memory_traces", "plot_overhead_vs_budget"]

logger = logging.getLogger(__name__)

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def _new_figure(width: float, height: float):
    """A figure on an Agg canvas, without pyplot's global state."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("tfremat.plots needs matplotlib; install it with `pip install tfremat[plots]`") from exc
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _byte_unit(largest: float) -> tuple[str, int]:
    """The largest binary unit that ``largest`` bytes reach, so axis numbers stay readable."""
    for label, scale in _UNITS:
        if largest >= scale:
            return label, scale
    return "B", 1


def _styles(names: Sequence[str]) -> dict[str, dict]:
    """Line styles that pair a heuristic with its ``_ap`` variant.

    A variant shares its family's color and marker and is drawn dash-dotted with hollow
    markers, so the effect of articulation-point candidates reads at a glance.
    """
    families: list[str] = []
    for name in names:
        family = name.removesuffix("_ap")
        if family not in families:
            families.append(family)
    styles = {}
    for name in names:
        index = families.index(name.removesuffix("_ap"))
        variant = name.endswith("_ap")
        styles[name] = {
            "color": f"C{index % 10}",
            "marker": _MARKERS[index % len(_MARKERS)],
            "linestyle": "-." if variant else "-",
            "markerfacecolor": "white" if variant else f"C{index % 10}",
        }
    return styles


def _check_budget(value, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ArgumentError(f"{argument}={value!r} must be a positive int number of bytes (see tfremat.budget.parse_budget)")
    return int(value)


def _forward_end(result, loss_node: int) -> int | None:
    """Index of the statement that first computes the loss node, where the forward pass ends."""
    for index, statement in enumerate(result.plan.statements):
        if statement.op is Op.COMPUTE and statement.node == loss_node:
            return index
    return None


def plot_memory_traces(
    graph: DFGraph,
    schedules: Mapping[str, Schedule],
    path: str | os.PathLike,
    budget_bytes: int | None = None,
    title: str | None = None,
) -> str | os.PathLike:
    """Draws memory over one training step, one trace per schedule, and saves it as an image.

    The x axis is the position in each plan as a fraction of its statements, so plans of
    different lengths (more recomputation, more statements) span the same width; the
    y axis is resident memory (fixed bytes included) in a unit chosen from the largest
    value. The legend gives each plan's simulated peak and compute overhead over running
    every node once; a triangle marks where each plan computes the loss, i.e. where the
    forward pass ends and recomputation can begin.

    Args:
        graph: the graph every schedule was made for.
        schedules: label (usually the strategy name) -> schedule, drawn in this order.
        path: where to save the figure; the format follows the suffix (``.png``, ``.pdf``).
        budget_bytes: when given, drawn as a dashed horizontal line.
        title: the figure title (default: names the graph).

    Returns:
        ``path``.

    Raises:
        ValueError: ``schedules`` is empty or ``budget_bytes`` is not a positive int.
        ImportError: matplotlib is not installed.

    Example:
        >>> schedules = {name: get_strategy(name)(graph) for name in ("checkpoint_all", "chen_sqrtn")}
        >>> plot_memory_traces(graph, schedules, "memory.png", budget_bytes=8 * 2**30)
    """
    if not schedules:
        raise ArgumentError("schedules is empty; pass a mapping of label -> Schedule, e.g. {'chen_sqrtn': schedule}")
    if budget_bytes is not None:
        budget_bytes = _check_budget(budget_bytes, "budget_bytes")
    results = {label: simulate(graph, schedule) for label, schedule in schedules.items()}
    largest = max([int(r.trace_bytes.max(initial=0)) for r in results.values()] + [budget_bytes or 0])
    unit, scale = _byte_unit(largest)
    styles = _styles(list(results))

    # Strategies often return the very same plan (e.g. the AP variants on a graph with
    # few articulation points); drawn separately, the later trace would hide the earlier.
    groups: dict[tuple, list[str]] = {}
    for label, result in results.items():
        groups.setdefault((result.trace_bytes.tobytes(), result.cost), []).append(label)

    figure = _new_figure(11, 7)
    axes = figure.add_subplot()
    for labels in groups.values():
        result = results[labels[0]]
        trace = result.trace_bytes / scale
        x = np.linspace(0.0, 1.0, num=len(trace))
        overhead = 100.0 * (result.cost / graph.total_cost - 1.0) if graph.total_cost > 0 else 0.0
        style = styles[labels[0]]
        axes.plot(
            x, trace, drawstyle="steps-post", linewidth=1.2, color=style["color"], linestyle=style["linestyle"],
            label=f"{' = '.join(labels)}: peak {format_bytes(result.peak_bytes)}, {overhead:+.1f}% compute",
        )
        if graph.loss_node is not None:
            end = _forward_end(result, graph.loss_node)
            if end is not None:
                axes.plot(x[end], trace[end], marker="v", markersize=9, color=style["color"], markeredgecolor="black", linestyle="none")
    if graph.loss_node is not None:
        axes.plot([], [], marker="v", markersize=9, color="white", markeredgecolor="black", linestyle="none", label="end of forward pass (loss)")
    if budget_bytes is not None:
        axes.axhline(budget_bytes / scale, color="black", linestyle="--", linewidth=1.2, label=f"budget {format_bytes(budget_bytes)}")
    axes.set_xlim(0.0, 1.0)
    axes.set_ylim(bottom=0.0, top=1.05 * largest / scale)
    axes.set_xlabel("progress through the training step (fraction of plan statements)")
    axes.set_ylabel(f"memory ({unit})")
    axes.set_title(title if title is not None else f"Memory during one training step: {graph.name}")
    axes.grid(True, alpha=0.3)
    # Below the axes: the labels carry numbers and can be long, and the traces need the width.
    figure.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
    figure.savefig(path, dpi=150)
    return path


def plot_overhead_vs_budget(
    graph: DFGraph,
    strategies: Sequence[str],
    budgets_bytes: Sequence[int],
    path: str | os.PathLike,
    strategy_options: Mapping[str, object] | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> tuple[str | os.PathLike, list[dict]]:
    """Solves every strategy at every budget and plots the step's time against the budget.

    The comparison of Checkmate's Figure 4 and MONeT's Figure 5: the x axis is the budget
    as a fraction of the checkpoint-all peak (what the framework uses without
    rematerialization; bytes on the top axis), the y axis the plan's simulated step time
    (its compute cost, plus waits for host copies when it offloads) over the cost of running
    every node once, so 1.0 means no recomputation and no wait. A strategy that
    raises :class:`InfeasibleBudgetError` at a budget has no point there; its line starts
    at the smallest budget it can meet.

    Args:
        graph: the graph to plan.
        strategies: registered strategy names (see ``tfremat.strategies.strategy_names``).
        budgets_bytes: memory budgets in bytes.
        path: where to save the figure; the format follows the suffix.
        strategy_options: per strategy name, its keyword options, e.g.
            ``{"optimal": {"time_limit": 60}, "pofo": {"bandwidth": 12e9}}``; a strategy not
            listed takes none (an offloading strategy needs its ``bandwidth``).
        progress: called as ``progress(done, total)`` after each solve, e.g. to advance a
            progress bar; None for none.

    Returns:
        ``(path, rows)``: one row per strategy and budget, in solve order, each a dict with
        ``strategy``, ``budget_bytes``, ``peak_bytes`` and ``time_ratio`` (simulated makespan
        over the no-remat cost; both None when infeasible) and ``seconds`` (wall time of the
        solve), ready for a table.

    Raises:
        ValueError: no strategies or budgets, a repeated strategy, or a budget that is not
            a positive int.
        TfrematError: an unknown strategy name (before anything is solved).
        ImportError: matplotlib is not installed.

    Example:
        >>> from tfremat.budget import parse_budget
        >>> from tfremat.plan.simulator import checkpoint_all_peak
        >>> peak = checkpoint_all_peak(graph)
        >>> budgets = [parse_budget(share, peak) for share in ("30%", "50%", "70%", "100%")]
        >>> path, rows = plot_overhead_vs_budget(graph, ["chen_sqrtn", "hong"], budgets, "overhead.png")
    """
    strategies = list(strategies)
    if not strategies:
        raise ArgumentError("strategies is empty; pass registered names such as ['checkpoint_all', 'chen_sqrtn']")
    if len(set(strategies)) != len(strategies):
        raise ArgumentError(f"strategies={strategies!r} repeats a name; give each strategy once")
    budgets = [_check_budget(b, "budgets_bytes entry") for b in budgets_bytes]
    if not budgets:
        raise ArgumentError("budgets_bytes is empty; pass at least one budget in bytes")
    solvers = {name: get_strategy(name) for name in strategies}
    options = {name: dict(given) for name, given in (strategy_options or {}).items()}
    unknown = sorted(set(options) - set(strategies))
    if unknown:
        raise ArgumentError(f"strategy_options names {unknown}, which are not among strategies={strategies!r}")
    for name, given in options.items():
        check_options(solvers[name], given, f"strategy {name!r}")
    reference = checkpoint_all_peak(graph)

    rows: list[dict] = []
    total = len(strategies) * len(budgets)
    for name, solve in solvers.items():
        kwargs = options.get(name, {})
        for budget in budgets:
            began = time.perf_counter()
            try:
                result = simulate(graph, solve(graph, budget, **kwargs))
            except (InfeasibleBudgetError, SolverTimeLimitError) as exc:
                # A MILP stopped without a schedule at one budget leaves a gap in its line,
                # like an infeasible budget; a missing or unlicensed solver is raised.
                peak, ratio = None, None
                logger.debug("%s has no schedule at %s: %s", name, format_bytes(budget), exc)
            else:
                peak = result.peak_bytes
                ratio = result.makespan / graph.total_cost if graph.total_cost > 0 else 1.0
                if peak > budget:
                    logger.warning("%s returned a plan with peak %s over the budget %s", name, format_bytes(peak), format_bytes(budget))
            rows.append({
                "strategy": name,
                "budget_bytes": budget,
                "peak_bytes": peak,
                "time_ratio": ratio,
                "seconds": time.perf_counter() - began,
            })
            if progress is not None:
                progress(len(rows), total)

    _draw_overhead(graph, strategies, rows, reference, path)
    return path, rows


def _draw_overhead(graph: DFGraph, strategies: Sequence[str], rows: Sequence[dict], reference: int, path) -> None:
    unit, scale = _byte_unit(max(reference, max(row["budget_bytes"] for row in rows)))
    styles = _styles(strategies)
    figure = _new_figure(10, 5.5)
    axes = figure.add_subplot()
    fraction = {row["budget_bytes"]: row["budget_bytes"] / reference for row in rows}
    for order, name in enumerate(strategies):
        points = sorted((fraction[row["budget_bytes"]], row["time_ratio"]) for row in rows if row["strategy"] == name and row["time_ratio"] is not None)
        label = name if points else f"{name} (fits no budget)"
        x, y = zip(*points) if points else ((), ())
        # Strategies often coincide (same plan, or the same cost at a budget); markers that
        # shrink in drawing order keep every coinciding point visible as nested shapes.
        size = 5.0 + 1.0 * (len(strategies) - 1 - order)
        axes.plot(x, y, label=label, linewidth=1.5, markersize=size, alpha=0.9, **styles[name])
    low, high = min(fraction.values()), max(fraction.values())
    pad = 0.03 * max(high - low, 0.1)
    axes.set_xlim(low - pad, high + pad)
    # Shade the budgets below the smallest one any strategy met, so an empty left part of
    # the plot reads as "infeasible", not as "not tried".
    fitting = [fraction[row["budget_bytes"]] for row in rows if row["time_ratio"] is not None]
    smallest_fit = min(fitting, default=high + pad)
    hopeless = [f for f in fraction.values() if f < smallest_fit]
    if hopeless:
        right = high + pad if not fitting else max(hopeless)
        axes.axvspan(low - pad, right, color="grey", alpha=0.15, linewidth=0, label="no strategy fits")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.set_xlabel("memory budget / checkpoint-all peak")
    axes.set_ylabel("step time / no-remat cost")
    axes.set_title(f"Step time vs. memory budget: {graph.name}\ncheckpoint-all peak {format_bytes(reference)}", fontsize="medium")
    axes.grid(True, alpha=0.3)
    top = axes.secondary_xaxis("top", functions=(lambda f: f * reference / scale, lambda b: b * scale / reference))
    top.set_xlabel(f"memory budget ({unit})")
    legend = axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    for handle in legend.legend_handles:
        if hasattr(handle, "set_markersize"):
            handle.set_markersize(7)
    figure.savefig(path, dpi=150)
