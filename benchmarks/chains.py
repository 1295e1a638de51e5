"""The chain algorithms on chain-like models: compute overhead against memory budget (issue 24).

Usage: python benchmarks/chains.py [--graphs DIR] [--time-limit S] [--quick] [--only REGEX --out FILE]

Graphs: two chain-like training graphs built here without TensorFlow (a VGG-style chain of
16 convolutions in four pooled stages, and a residual chain of 24 blocks in three stages)
and the Checkmate graphs of VGG16, VGG19, MobileNet and ResNet50 from the shared graph
folder. The chain strategies linearize each graph's forward order themselves (every forward
node a stage; the ``_ap`` variants: the blocks between forward articulation points).

At each budget (a share of the graph's checkpoint-all peak), every strategy of
:func:`recompute_columns` plans the step; the benchmark records the predicted compute overhead over
a step without recomputation (``schedule.cost(graph) / graph.total_cost - 1``), the
simulated peak, the planning seconds and, for ``optimal``, its solver status and gap, or
that the strategy has no schedule at that budget. It writes a table per graph, a summary of
where ``hong`` and ``rotor`` differ from each other and from ``optimal``, the smallest budget
at which ``rotor`` stays under 20% overhead (Beaumont et al. 2021 compare their offloading
against it there), a JSON of every case and one figure with a subplot per graph (default
``benchmarks/results/chains.md``, ``.json`` and ``.png``).

The offloading strategies (:data:`OFFLOADING`) run over two simulated host links given
relative to each graph (:data:`LINKS`); their overhead is the simulated makespan's (waits
for copies included). ``--quick`` runs a small subset in
well under a minute and writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfremat, not an installed one

from checkmate_graphs import DEFAULT_GRAPHS, graph_label  # noqa: E402
from provenance import command, commit, header  # noqa: E402

from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError, failure_status  # noqa: E402
from tfremat.graph import DFGraph, load_graph  # noqa: E402
from tfremat.plan.baselines import heuristic_deadline  # noqa: E402
from tfremat.plan.registry import check_options, parse_graph_budget  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak, simulate  # noqa: E402
from tfremat.strategies import get_strategy, strategy_names  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "chains.md"
CHECKMATE = ("VGG16", "VGG19", "MobileNet", "ResNet50")
BUDGETS = ("100%", "95%", "90%", "80%", "70%", "60%", "50%", "40%", "30%", "20%")
QUICK_GRAPHS = ("vgg_chain", "residual_chain", "VGG16")
QUICK_BUDGETS = ("100%", "90%", "50%", "30%")
QUICK_TIME_LIMIT = 5.0
# Beaumont et al. compare offloading with rotor where the overhead stays under 20%.
OVERHEAD_MARK = 0.20
GIB = 2**30
FLOAT_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Column:
    """One strategy as the tables show it: a label, the registry name, its options."""

    label: str
    strategy: str
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)


def recompute_columns(time_limit: float) -> list[Column]:
    """The recompute-only strategies compared, cheapest to plan first; ``optimal`` gets
    ``time_limit`` seconds on one thread, so its time does not depend on the machine's cores."""
    return [
        Column("checkpoint_all", "checkpoint_all"),
        Column("chen_sqrtn", "chen_sqrtn"),
        Column("griewank_logn", "griewank_logn"),
        Column("hong", "hong"),
        Column("hong classic", "hong", {"memory_model": "classic"}),
        Column("hong_ap", "hong_ap"),
        Column("rotor", "rotor"),
        Column("rotor_ap", "rotor_ap"),
        Column("eviction", "eviction"),
        Column("optimal", "optimal", {"time_limit": time_limit, "threads": 1}),
    ]


# Beaumont et al.'s offloading strategies, each over two simulated host links. The graphs'
# costs are in different units (GFLOP here, an arbitrary V100 time unit in the Checkmate
# graphs), so a link is given relative to the graph: ``link`` is the time it takes to move
# every forward value once, as a multiple of the forward pass's compute (LINKS); solve_case
# turns it into the strategy's ``bandwidth`` in bytes per unit of the graph's cost. For
# scale: ResNet50's graph holds 37.9 GB of forward values at batch 256, which the paper's
# measured 12 GB/s link moves in 3.2 s, several times a V100's forward pass.
LINKS = {"slow link": 10.0, "fast link": 2.0}
# pofo_ap rather than pofo: on a chain its stages are pofo's, and on ResNet50 they are 17
# blocks instead of 177 nodes (pofo's DP is O(N^3) in the stages). autocapper tries the
# paper's 40 limits (its default), read from one rotor table (benchmarks/offload_speed.py:
# 77.5 CPU s over ResNet50's ten budgets). Each
# offloading case stops at OFFLOADING_SECONDS (heuristic_deadline) with its best so far.
OFFLOADING = [
    Column(f"{name} {link}", name, {"link": ratio})
    for name in ("pofo_ap", "autocapper", "opportunist") for link, ratio in LINKS.items()
]
OFFLOADING_SECONDS = 60.0

# The chain dynamic programs the summary compares with each other and with optimal.
CHAIN_DPS = ("hong", "hong classic", "hong_ap", "rotor", "rotor_ap")


# ----- chain-like training graphs without TensorFlow -----


@dataclasses.dataclass(frozen=True)
class Layer:
    """One forward node of a synthetic model.

    Attributes:
        name: the node's name.
        inputs: the forward nodes it reads, by index (empty: it reads the batch, which is
            fixed memory).
        output_bytes: the bytes of its output.
        cost: its forward cost (GFLOP).
        backward_factor: its backward cost over its forward cost: 2 for a convolution or a
            dense layer (input and weight gradients), 1 for an elementwise or pooling node.
        reads_output: its gradient reads its output (a fused ReLU's mask, max pooling).
        reads_inputs: its gradient reads its inputs (a weight gradient, max pooling); an
            add or an average pooling passes its gradient on without them.
    """

    name: str
    inputs: tuple[int, ...]
    output_bytes: int
    cost: float
    backward_factor: float = 2.0
    reads_output: bool = True
    reads_inputs: bool = True


def training_graph_of(layers: Sequence[Layer], fixed_bytes: int, name: str) -> DFGraph:
    """The training graph of ``layers`` in Checkmate's layout: the forward nodes in order,
    the loss reading the forward sinks, then one gradient node per layer in reverse order.

    The gradient of layer j reads the gradients of j's consumers (the loss's output for a
    sink) and, as the layer says, j's inputs and j's output; it makes the gradient of j's
    inputs (nothing for the first layer: weight gradients are fixed memory).
    """
    m = len(layers)
    loss = m
    consumers: list[list[int]] = [[] for _ in range(m)]
    for j, layer in enumerate(layers):
        for i in layer.inputs:
            if not 0 <= i < j:
                raise ValueError(f"layer {layer.name!r} reads {i}, which is not an earlier layer")
            consumers[i].append(j)

    def gradient(j: int) -> int:
        return 2 * m - j

    edges = [(i, j) for j, layer in enumerate(layers) for i in layer.inputs]
    edges += [(j, loss) for j in range(m) if not consumers[j]]
    for j, layer in enumerate(layers):
        edges += [(upstream, gradient(j)) for upstream in ([gradient(c) for c in consumers[j]] or [loss])]
        if layer.reads_inputs:
            edges += [(i, gradient(j)) for i in layer.inputs]
        if layer.reads_output:
            edges.append((j, gradient(j)))
    backward = [layers[2 * m - k] for k in range(m + 1, 2 * m + 1)]
    return DFGraph(
        names=[layer.name for layer in layers] + ["loss"] + [f"{layer.name}_backward" for layer in backward],
        edges=edges,
        # The loss over a batch of logits costs next to nothing against a convolution.
        cost=[layer.cost for layer in layers] + [1e-4] + [layer.backward_factor * layer.cost for layer in backward],
        output_bytes=([layer.output_bytes for layer in layers] + [FLOAT_BYTES]
                      + [sum(layers[i].output_bytes for i in layer.inputs) for layer in backward]),
        is_backward=[False] * m + [True] * (m + 1),
        loss_node=loss,
        forward_of={gradient(j): j for j in range(m)},
        fixed_bytes=fixed_bytes,
        name=name,
    )


def _tensor(batch: int, size: int, channels: int) -> int:
    return batch * size * size * channels * FLOAT_BYTES


def _conv_gflop(batch: int, size: int, c_in: int, c_out: int, kernel: int) -> float:
    return 2.0 * batch * size * size * c_in * c_out * kernel * kernel / 1e9


def _elementwise_gflop(batch: int, size: int, channels: int) -> float:
    return batch * size * size * channels / 1e9


def _fixed_bytes(batch: int, resolution: int, parameters: int) -> int:
    """The batch, plus every parameter three times: weights, gradients, one momentum slot."""
    return _tensor(batch, resolution, 3) + 3 * FLOAT_BYTES * parameters


def vgg_chain(batch: int = 32, resolution: int = 128) -> DFGraph:
    """A VGG-style chain: four stages of four 3x3 convolutions (ReLU fused; 64 to 512
    channels), each followed by 2x2 max pooling, then global average pooling and a dense
    layer of 1000 classes; every activation half the size of the stage before."""
    layers: list[Layer] = []
    parameters, channels, size = 0, 3, resolution

    def add(layer: Layer) -> tuple[int]:
        layers.append(layer)
        return (len(layers) - 1,)

    previous: tuple[int, ...] = ()
    for stage, width in enumerate((64, 128, 256, 512), start=1):
        for k in range(1, 5):
            previous = add(Layer(f"conv{stage}_{k}", previous, _tensor(batch, size, width),
                                 _conv_gflop(batch, size, channels, width, 3)))
            parameters += 9 * channels * width + width
            channels = width
        size //= 2
        previous = add(Layer(f"pool{stage}", previous, _tensor(batch, size, width),
                             _elementwise_gflop(batch, 2 * size, width), backward_factor=1.0))
    previous = add(Layer("global_pool", previous, batch * channels * FLOAT_BYTES,
                         _elementwise_gflop(batch, size, channels), backward_factor=1.0, reads_output=False,
                         reads_inputs=False))
    add(Layer("dense", previous, batch * 1000 * FLOAT_BYTES, 2.0 * batch * channels * 1000 / 1e9, reads_output=False))
    parameters += channels * 1000 + 1000
    return training_graph_of(layers, _fixed_bytes(batch, resolution, parameters),
                             f"VGG-style chain (16 conv, {resolution}x{resolution}, batch {batch})")


def residual_chain(blocks_per_stage: int = 8, batch: int = 32, resolution: int = 56) -> DFGraph:
    """A deep residual chain: a stem convolution, then three stages of ``blocks_per_stage``
    basic blocks (64, 128, 256 channels; each stage after the first halves the resolution,
    its first block with a 1x1 projection on the skip), then global pooling and a dense layer.
    A block is conv-BN-ReLU, conv-BN, and the add with the skip followed by a ReLU."""
    layers: list[Layer] = []

    def add(layer: Layer) -> int:
        layers.append(layer)
        return len(layers) - 1

    size, channels = resolution, 64
    x = add(Layer("stem", (), _tensor(batch, size, channels), _conv_gflop(batch, size, 3, channels, 3)))
    parameters = 27 * channels
    for stage, width in enumerate((64, 128, 256), start=1):
        for block in range(1, blocks_per_stage + 1):
            downsample = width != channels
            if downsample:
                size //= 2
            tag = f"s{stage}b{block}"
            a = add(Layer(f"{tag}_conv1", (x,), _tensor(batch, size, width), _conv_gflop(batch, size, channels, width, 3)))
            b = add(Layer(f"{tag}_conv2", (a,), _tensor(batch, size, width), _conv_gflop(batch, size, width, width, 3),
                          reads_output=False))
            parameters += 9 * channels * width + 9 * width * width + 4 * width
            skip = x
            if downsample:
                skip = add(Layer(f"{tag}_project", (x,), _tensor(batch, size, width),
                                 _conv_gflop(batch, size, channels, width, 1), reads_output=False))
                parameters += channels * width + 2 * width
            # The add's ReLU: its gradient reads the output's mask, not the summands.
            x = add(Layer(f"{tag}_add", (skip, b), _tensor(batch, size, width), _elementwise_gflop(batch, size, width),
                          backward_factor=1.0, reads_inputs=False))
            channels = width
    pooled = add(Layer("global_pool", (x,), batch * channels * FLOAT_BYTES, _elementwise_gflop(batch, size, channels),
                       backward_factor=1.0, reads_output=False, reads_inputs=False))
    add(Layer("dense", (pooled,), batch * 1000 * FLOAT_BYTES, 2.0 * batch * channels * 1000 / 1e9, reads_output=False))
    parameters += channels * 1000 + 1000
    return training_graph_of(layers, _fixed_bytes(batch, resolution, parameters),
                             f"residual chain ({3 * blocks_per_stage} blocks, {resolution}x{resolution}, batch {batch})")


SYNTHETIC = {"vgg_chain": vgg_chain, "residual_chain": residual_chain}


# ----- the sweep -----


def load_graphs(graphs_dir: Path, labels: Sequence[str]) -> list[tuple[str, DFGraph]]:
    """``(label, graph)`` for each label, built (:data:`SYNTHETIC`) or loaded from ``graphs_dir``.

    Raises:
        SystemExit: a Checkmate graph's file is missing.
    """
    files = {graph_label(p): p for p in graphs_dir.glob("*_train.json")}
    loaded = []
    for label in labels:
        if label in SYNTHETIC:
            loaded.append((label, SYNTHETIC[label]()))
        elif label in files:
            loaded.append((label, load_graph(files[label])))
        else:
            raise SystemExit(f"no {label}_*_train.json in {graphs_dir}; pass --graphs DIR")
    return loaded


def solve_case(graph: DFGraph, column: Column, budget_bytes: int) -> dict:
    """One strategy at one budget: its overhead, simulated peak and planning seconds, or
    the status of having no schedule ("infeasible", "no schedule") and the smallest peak it
    reached."""
    strategy = get_strategy(column.strategy)
    options = dict(column.options)
    deadline = None
    if "link" in options:
        options["bandwidth"] = link_bandwidth(graph, options.pop("link"))
        deadline = time.perf_counter() + OFFLOADING_SECONDS
    began = time.perf_counter()
    try:
        with heuristic_deadline(deadline):
            schedule = strategy(graph, budget_bytes, **options)
    except (InfeasibleBudgetError, SolverTimeLimitError) as error:
        return {"status": failure_status(error), "seconds": time.perf_counter() - began,
                "min_feasible_bytes": error.min_feasible_bytes}
    seconds = time.perf_counter() - began
    result = simulate(graph, schedule)
    row = {
        "status": "ok",
        "seconds": seconds,
        # The step's time over a plain step's: recomputation and waits for host copies.
        "overhead": result.makespan / graph.total_cost - 1,
        "idle": result.idle / graph.total_cost,
        "transfer_bytes": result.transfer_bytes,
        "peak_bytes": result.peak_bytes,
        "recomputations": schedule.recompute_count,
        "over_budget": result.peak_bytes > budget_bytes,
    }
    if schedule.facts is not None:
        row["solver_status"] = schedule.facts.status.value
        row["gap"] = schedule.facts.gap
        row["solver_call_seconds"] = schedule.facts.seconds
    return row


def link_bandwidth(graph: DFGraph, ratio: float) -> float:
    """Bytes per unit of ``graph``'s cost of a link that moves every forward value once in
    ``ratio`` times the forward pass's compute (see :data:`LINKS`)."""
    forward = list(graph.forward_nodes)
    return sum(graph.output_bytes[v] for v in forward) / (ratio * sum(graph.cost[v] for v in forward))


def sweep(label: str, graph: DFGraph, columns: Sequence[Column], budgets: Sequence[str]) -> dict:
    """Every column at every budget share of ``graph``'s checkpoint-all peak."""
    reference = checkpoint_all_peak(graph)
    cases = []
    for share in budgets:
        budget_bytes = parse_graph_budget(graph, share, reference)
        for column in columns:
            case = {"budget": share, "budget_bytes": budget_bytes, "strategy": column.label,
                    **solve_case(graph, column, budget_bytes)}
            cases.append(case)
    return {
        "label": label,
        "name": graph.name,
        "nodes": graph.size,
        "forward_nodes": len(graph.forward_nodes),
        "checkpoint_all_peak_bytes": reference,
        "fixed_bytes": graph.fixed_bytes,
        "total_cost": graph.total_cost,
        "cases": cases,
    }


# ----- reporting -----


def _cell(case: dict | None) -> str:
    if case is None:
        return ""
    if case["status"] == "infeasible":
        return "-"
    if case["status"] == "no schedule":
        return "?"
    # Rounding makes no-recomputation costs come out as -1e-16: shown as +0.0%, not -0.0%.
    text = f"{round(100 * case['overhead'], 6) + 0.0:+.1f}%"
    if case.get("solver_status") not in (None, "optimal"):
        text += "*"
    return text + (" (over!)" if case["over_budget"] else "")


def _by_budget(result: dict) -> dict[str, dict[str, dict]]:
    table: dict[str, dict[str, dict]] = {}
    for case in result["cases"]:
        table.setdefault(case["budget"], {})[case["strategy"]] = case
    return table


def _fits(case: dict | None) -> bool:
    return case is not None and case["status"] == "ok"


def graph_table(result: dict, labels: Sequence[str]) -> str:
    """Rows: budgets; columns: strategies; then optimal's status and gap."""
    lines = ["| budget | " + " | ".join(labels) + " | optimal: status, gap |", "|" + " --- |" * (len(labels) + 2)]
    for share, row in _by_budget(result).items():
        best = row.get("optimal")
        facts = ""
        if _fits(best):
            facts = best.get("solver_status", "")
            if best.get("gap") is not None:
                facts += f", {100 * best['gap']:.2f}%"
        elif best is not None:
            facts = best["status"]
        lines.append(f"| {share} | " + " | ".join(_cell(row.get(label)) for label in labels) + f" | {facts} |")
    reference = result["checkpoint_all_peak_bytes"]
    least = [least_peak_reached(result, label) for label in labels]
    lines.append("| least peak | " + " | ".join("" if peak is None else f"{peak / reference:.2f}" for peak in least)
                 + " | |")
    return "\n".join(lines)


def least_peak_reached(result: dict, label: str) -> int | None:
    """The smallest simulated peak ``label`` reached in the sweep: its schedules' peaks and,
    where it had none, the smallest peak its error reports."""
    peaks = [case["peak_bytes"] if _fits(case) else case.get("min_feasible_bytes")
             for case in result["cases"] if case["strategy"] == label]
    peaks = [peak for peak in peaks if peak is not None]
    return min(peaks, default=None)


def seconds_table(results: Sequence[dict], labels: Sequence[str]) -> str:
    """Planning seconds per graph and strategy, summed over the budgets."""
    lines = ["| graph | " + " | ".join(labels) + " |", "|" + " --- |" * (len(labels) + 1)]
    for result in results:
        total = {label: 0.0 for label in labels}
        for case in result["cases"]:
            total[case["strategy"]] += case["seconds"]
        lines.append(f"| {result['label']} | " + " | ".join(f"{total[label]:.2f}" for label in labels) + " |")
    return "\n".join(lines)


def _points(x: float) -> str:
    return f"{100 * x:.1f}"


def chain_summary(results: Sequence[dict], labels: Sequence[str]) -> str:
    """hong against rotor where both fit, the budgets only one fits, and each chain DP's
    excess overhead over optimal (percentage points, at the budgets both fit)."""
    dps = [label for label in CHAIN_DPS if label in labels]
    head = ["| graph | rotor cheaper | hong cheaper | equal | rotor only | hong only | cheapest chain DP per budget |"]
    head += ["|" + " --- |" * 7]
    excess_lines = ["| graph | " + " | ".join(f"{dp} - optimal: median / max" for dp in dps) + " |",
                    "|" + " --- |" * (len(dps) + 1)]
    for result in results:
        counts = {"rotor": 0, "hong": 0, "equal": 0, "rotor only": 0, "hong only": 0}
        winners = []
        excess: dict[str, list[float]] = {dp: [] for dp in dps}
        for share, row in _by_budget(result).items():
            rotor, hong = row.get("rotor"), row.get("hong")
            if _fits(rotor) and _fits(hong):
                difference = rotor["overhead"] - hong["overhead"]
                counts["rotor" if difference < -1e-9 else "hong" if difference > 1e-9 else "equal"] += 1
            elif _fits(rotor):
                counts["rotor only"] += 1
            elif _fits(hong):
                counts["hong only"] += 1
            fitting = [(row[dp]["overhead"], dp) for dp in dps if _fits(row.get(dp))]
            # A budget where every chain DP fits at the same cost (no recomputation) says nothing.
            tie = len(fitting) == len(dps) and max(o for o, _ in fitting) - min(o for o, _ in fitting) <= 1e-9
            if fitting and not tie:
                least = min(overhead for overhead, _ in fitting)
                names = "/".join(dp for overhead, dp in fitting if overhead <= least + 1e-9)
                winners.append(f"{share} {names}")
            if _fits(row.get("optimal")):
                for dp in dps:
                    if _fits(row.get(dp)):
                        excess[dp].append(row[dp]["overhead"] - row["optimal"]["overhead"])
        head.append(f"| {result['label']} | {counts['rotor']} | {counts['hong']} | {counts['equal']} | "
                    f"{counts['rotor only']} | {counts['hong only']} | {'; '.join(winners)} |")
        cells = []
        for dp in dps:
            values = sorted(excess[dp])
            cells.append(f"{_points(values[len(values) // 2])} / {_points(values[-1])}" if values else "-")
        excess_lines.append(f"| {result['label']} | " + " | ".join(cells) + " |")
    return "\n".join(head) + "\n\n" + "\n".join(excess_lines)


def smallest_under_mark(result: dict, label: str) -> dict | None:
    """The case of ``label`` at the smallest budget where its overhead is under
    :data:`OVERHEAD_MARK`, or None."""
    under = [case for case in result["cases"]
             if case["strategy"] == label and _fits(case) and case["overhead"] < OVERHEAD_MARK]
    return min(under, key=lambda case: case["budget_bytes"], default=None)


def paper_table(results: Sequence[dict], labels: Sequence[str], budgets: Sequence[str]) -> str:
    """For rotor and optimal: the smallest budget of the sweep with overhead under 20%, and
    how much less activation memory (simulated peak less fixed bytes) it holds than
    checkpoint all; marked "lowest tried" when the sweep stopped there."""
    offloading = [column.label for column in OFFLOADING if column.strategy == "pofo_ap"]
    shown = [label for label in ("rotor", "optimal", *offloading) if label in labels]
    lines = ["| graph | fixed / checkpoint-all peak | " + " | ".join(
        f"{label}: smallest budget < {100 * OVERHEAD_MARK:.0f}% | overhead | activation memory reduction"
        for label in shown) + " |", "|" + " --- |" * (2 + 3 * len(shown))]
    for result in results:
        reference, fixed = result["checkpoint_all_peak_bytes"], result["fixed_bytes"]
        cells = [f"{fixed / reference:.2f}"]
        for label in shown:
            case = smallest_under_mark(result, label)
            if case is None:
                cells += ["none", "", ""]
                continue
            activations = case["peak_bytes"] - fixed
            reduction = f"{(reference - fixed) / activations:.1f}x" if activations > 0 else "all"
            lowest = " (lowest tried)" if case["budget"] == budgets[-1] else ""
            cells += [case["budget"] + lowest, f"{100 * case['overhead']:+.1f}%", reduction]
        lines.append(f"| {result['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recomputation_removed(results: Sequence[dict], labels: Sequence[str]) -> str:
    """Per offloading column: the share of rotor's overhead it removes at the same budget,
    ``1 - overhead / rotor's overhead``, median and range over the budgets where both fit
    and rotor recomputes (overhead > 0.5%)."""
    shown = [column.label for column in OFFLOADING if column.label in labels]
    lines = ["| graph | " + " | ".join(f"{label}: median (min..max), budgets" for label in shown) + " |",
             "|" + " --- |" * (1 + len(shown))]
    for result in results:
        rotor_at = {case["budget"]: case for case in result["cases"] if case["strategy"] == "rotor" and _fits(case)}
        cells = []
        for label in shown:
            shares = [1 - case["overhead"] / rotor_at[case["budget"]]["overhead"] for case in result["cases"]
                      if case["strategy"] == label and _fits(case) and case["budget"] in rotor_at
                      and rotor_at[case["budget"]]["overhead"] > 0.005]
            cells.append(f"{100 * statistics.median(shares):.0f}% ({100 * min(shares):.0f}..{100 * max(shares):.0f}), "
                         f"{len(shares)}" if shares else "none")
        lines.append(f"| {result['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(results: Sequence[dict], labels: Sequence[str], path: Path) -> None:
    """One subplot per graph: overhead (%) against the budget share, a line per strategy."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, FuncFormatter
    except ImportError as exc:
        raise SystemExit("the figure needs matplotlib: pip install -e '.[plots]'") from exc
    columns = min(3, len(results))
    rows = -(-len(results) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    markers = "osD^vP<>Xh"
    # tab20's twenty colours: no two of the sixteen strategies share one.
    from matplotlib import colormaps

    colours = colormaps["tab20"]
    for index, result in enumerate(results):
        axes = figure.add_subplot(rows, columns, index + 1)
        for order, label in enumerate(labels):
            points = sorted((case["budget_bytes"] / result["checkpoint_all_peak_bytes"], 100 * case["overhead"])
                            for case in result["cases"] if case["strategy"] == label and _fits(case))
            x, y = zip(*points) if points else ((), ())
            # Strategies often coincide: markers shrinking in drawing order keep each visible.
            axes.plot(x, y, marker=markers[order % len(markers)], markersize=3 + 0.5 * (len(labels) - order),
                      linewidth=1.2, alpha=0.85, label=label, linestyle="-" if order < 10 else "--",
                      color=colours(order % 20))
        axes.set_ylim(bottom=0)
        axes.set_title(f"{result['label']} ({result['nodes']} nodes, "
                       f"{result['checkpoint_all_peak_bytes'] / GIB:.1f} GiB)", fontsize="small")
        axes.set_xlabel("budget / checkpoint-all peak", fontsize="small")
        # Revolve's hundreds of percent would flatten everything else: linear up to 1%, then log.
        axes.set_yscale("symlog", linthresh=1.0)
        axes.yaxis.set_major_locator(FixedLocator([0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]))
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.set_ylabel("overhead (%)", fontsize="small")
        axes.tick_params(labelsize="x-small")
        axes.grid(True, alpha=0.3)
        axes.axhline(100 * OVERHEAD_MARK, color="grey", linewidth=0.8, linestyle=":")
    handles, names = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, names, loc="outside lower center", ncols=min(len(labels), 5), fontsize="small",
                  frameon=False)
    figure.savefig(path, dpi=72)


def report(results: Sequence[dict], labels: Sequence[str], budgets: Sequence[str], missing: Sequence[Column],
           time_limit: float, argv: list[str] | None, wall: float) -> str:
    """The markdown results file."""
    parts = [
        "# Chain algorithms: compute overhead against memory budget\n",
        header(argv) + "\n",
        ("Budgets are shares of each graph's checkpoint-all peak. A cell is the predicted time overhead "
         "over a step without recomputation (simulated makespan / no-remat cost - 1: recomputation, and for "
         "the offloading strategies the waits for host copies); `-`: the strategy has no "
         "schedule that fits (InfeasibleBudgetError); `?`: optimal stopped without a schedule; `*`: optimal's "
         f"schedule is not proven optimal (its gap in the last column). optimal: HiGHS, {time_limit:g} s, one "
         "thread. The chain strategies linearize the forward order (every forward node a stage; `_ap`: the "
         "blocks between forward articulation points); `hong classic` is hong with memory_model=\"classic\". "
         "Every schedule's simulated peak is within its budget unless a cell says `over!`. The last row, "
         "least peak, is the smallest simulated peak each strategy reached in the sweep (with no schedule at a "
         "budget: the smallest peak its error reports), as a share of the checkpoint-all peak. Offloading "
         "columns: the host link moves every forward value once in "
         + " / ".join(f"{ratio:g}x ({name})" for name, ratio in LINKS.items())
         + " the forward pass's compute time; the graphs' cost units differ (GFLOP for the synthetic chains, "
         "an arbitrary V100 time unit in the Checkmate graphs), so a link in GB/s has no meaning here.\n"),
    ]
    if missing:
        parts.append("**Not implemented yet:** the offloading strategies "
                     + ", ".join(f"`{column.label}`" for column in missing)
                     + " (issue 24) are not in the registry, so they have no column.\n")
    for result in results:
        parts.append(f"## {result['label']}: {result['name']}\n")
        parts.append(f"{result['nodes']} nodes ({result['forward_nodes']} forward), checkpoint-all peak "
                     f"{result['checkpoint_all_peak_bytes'] / GIB:.2f} GiB, of which fixed "
                     f"{result['fixed_bytes'] / GIB:.2f} GiB.\n")
        parts.append(graph_table(result, labels) + "\n")
    parts.append("## Which chain DP wins where\n")
    parts.append("hong against rotor at the budgets where both fit (cheaper, equal) or only one fits; the cheapest "
                 "chain DP at each budget where one fits; then each chain DP's overhead over optimal's, in "
                 "percentage points at the budgets where both fit (median / max).\n")
    parts.append(chain_summary(results, labels) + "\n")
    parts.append("## Against Beaumont et al.\n")
    parts.append(
        "Beaumont et al. (NeurIPS 2021) report that offloading removes about a third of the recomputation "
        "overhead and holds 4-6x less activation memory at under 20% overhead. First, per strategy, the "
        f"smallest budget of the sweep at which the overhead stays under {100 * OVERHEAD_MARK:.0f}%, and the "
        "activation memory (checkpoint-all peak less fixed bytes) over the schedule's simulated peak less "
        "fixed bytes:\n")
    parts.append(paper_table(results, labels, budgets) + "\n")
    parts.append("Then the share of rotor's overhead each offloading strategy removes at the same budget (median, "
                 "range and the number of budgets where both fit and rotor recomputes):\n")
    parts.append(recomputation_removed(results, labels) + "\n")
    parts.append("## Planning seconds, summed over the budgets\n")
    parts.append(seconds_table(results, labels) + "\n")
    parts.append(f"Wall time of the run: {wall:.0f} s.\n")
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=Path, default=DEFAULT_GRAPHS, help="folder with the Checkmate *_train.json graphs")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown file to write, with .json and .png beside it "
                        f"(default {DEFAULT_OUT}; required with --only; --quick writes nothing without it)")
    parser.add_argument("--only", default=None, help="regular expression a graph label must match in full: "
                        + ", ".join([*SYNTHETIC, *CHECKMATE]))
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for each optimal solve "
                        f"(default 30; {QUICK_TIME_LIMIT:g} with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {', '.join(QUICK_GRAPHS)} at "
                        f"{', '.join(QUICK_BUDGETS)} only, optimal {QUICK_TIME_LIMIT:g} s")
    args = parser.parse_args(argv)
    if args.only is not None and args.out is None:
        parser.error(f"--only benchmarks some graphs only; give --out (the default {DEFAULT_OUT} holds every graph)")
    time_limit = args.time_limit if args.time_limit is not None else QUICK_TIME_LIMIT if args.quick else 30.0
    if time_limit <= 0:
        parser.error("--time-limit must be positive")
    labels = list(QUICK_GRAPHS if args.quick else [*SYNTHETIC, *CHECKMATE])
    if args.only is not None:
        labels = [label for label in labels if re.fullmatch(args.only, label)]
        if not labels:
            parser.error(f"--only {args.only!r} matches none of the graphs")
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    out = args.out if args.out is not None or args.quick else DEFAULT_OUT

    known = set(strategy_names(offloading=True))
    columns = [column for column in [*recompute_columns(time_limit), *OFFLOADING] if column.strategy in known]
    missing = [column for column in OFFLOADING if column.strategy not in known]
    for column in columns:
        options = {("bandwidth" if key == "link" else key): value for key, value in column.options.items()}
        check_options(get_strategy(column.strategy), options, f"strategy {column.strategy!r}")
    names = [column.label for column in columns]

    began = time.perf_counter()
    results = []
    for label, graph in load_graphs(args.graphs, labels):
        sys.stderr.write(f"{label}: {graph.size} nodes ...")
        sys.stderr.flush()
        results.append(sweep(label, graph, columns, budgets))
        sys.stderr.write(f" done at {time.perf_counter() - began:.0f} s\n")
    wall = time.perf_counter() - began
    text = report(results, names, budgets, missing, time_limit, argv, wall)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        document = {
            "command": command(argv), "commit": commit(), "time_limit": time_limit, "threads": 1,
            "budgets": list(budgets), "strategies": [dataclasses.asdict(column) for column in columns],
            "not_implemented": [column.label for column in missing], "wall_seconds": wall, "graphs": results,
        }
        out.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n")
        draw(results, names, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
