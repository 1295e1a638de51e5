"""The layout copies XLA makes of a layer call's inputs for its gradient.

XLA's CPU backend computes a convolution's filter gradient as a convolution whose operands
swap their batch and feature dimensions, and its layout assignment gives that convolution
a transposed copy of the call's input (``transpose_copy_fusion``, the input's size). Its
scheduler computes the copy as soon as the input exists, so in a compiled step the copy
lives from the forward pass to the backward pass, next to the input when something else
still reads the input (a residual add, a recomputation) and in its place otherwise.
TensorFlow's kernels read the input itself. At 50% of the residual chain's activations in
``benchmarks/xla.py``, five such copies (2.25 MiB each) were live at the step's peak,
which requested 1.17x the prediction of a graph measured on TensorFlow's kernels.

So for a step compiled with XLA (``extract(..., xla=...)``) the gradient of such a call
reads a residual of the copy's size instead of the input: the call's input is read by the
backward only through the copy. Which inputs XLA copies is read from the optimized HLO
of the call and its gradient compiled by XLA, against that of the forward alone (a copy
the forward makes too is the forward's). Only copies of a whole input count: the
upstream gradient's copies live during the backward node only, as its workspace does.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["backward_layout_copies", "parse_hlo"]

# Operations that only move elements: a fusion of these (and parameters) is a layout copy.
_MOVING_OPCODES = frozenset({"copy", "transpose", "bitcast", "reshape"})
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")
_ARRAY_SHAPE = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    opcode: str
    elements: int | None  # None for a tuple
    operands: tuple[str, ...]
    parameter: int | None
    calls: str | None


def _matching_paren(text: str, start: int) -> int:
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "(":
            depth += 1
        elif text[position] == ")":
            depth -= 1
            if depth == 0:
                return position
    return len(text)


def _instruction(line: str) -> _Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    opcode = _OPCODE.search(rest)
    if opcode is None:
        return None
    open_paren = opcode.end() - 1
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[open_paren:_matching_paren(rest, open_paren)]))
    shape = _ARRAY_SHAPE.match(rest)
    elements = None
    if shape is not None:
        elements = 1
        for dim in filter(None, shape.group(1).split(",")):
            elements *= int(dim)
    parameter = _PARAMETER.search(rest) if opcode.group(1) == "parameter" else None
    calls = _CALLS.search(rest)
    return _Instruction(name, opcode.group(1), elements, operands, int(parameter.group(1)) if parameter else None,
                        calls.group(1) if calls else None)


def parse_hlo(text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """``(instructions by computation name, the entry computation's name)`` of an HLO
    module's text (``experimental_get_compiler_ir(...)(stage="optimized_hlo")``)."""
    computations: dict[str, list[_Instruction]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if header is not None and "=" not in line.split("{")[0]:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = _instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    return computations, entry


def _copied_parameters(text: str) -> dict[int, list[int]]:
    """Per entry parameter, the element counts of the layout copies made of all of it: a
    ``copy`` or ``transpose`` of the parameter, or a fusion of element moves only."""
    computations, entry = parse_hlo(text)
    if entry is None:
        return {}
    instructions = computations[entry]
    parameters = {i.name: i for i in instructions if i.parameter is not None}
    copies: dict[int, list[int]] = {}
    for instruction in instructions:
        if len(instruction.operands) != 1 or instruction.operands[0] not in parameters:
            continue
        source = parameters[instruction.operands[0]]
        if instruction.opcode == "fusion":
            body = computations.get(instruction.calls, [])
            moves = body and all(i.opcode in _MOVING_OPCODES or i.opcode == "parameter" for i in body) \
                and any(i.opcode in ("copy", "transpose") for i in body)
        else:
            moves = instruction.opcode in ("copy", "transpose")
        if moves and instruction.elements is not None and instruction.elements == source.elements:
            copies.setdefault(source.parameter, []).append(instruction.elements)
    return copies


def backward_layout_copies(step_hlo: str, forward_hlo: str, num_inputs: int) -> dict[int, int]:
    """Input position -> elements of the layout copies that XLA makes of that whole input
    for the gradient: those in ``step_hlo`` (the call and its gradient, whose first
    ``num_inputs`` parameters are the call's inputs) beyond those in ``forward_hlo`` (the
    call alone, same first parameters)."""
    in_step, in_forward = _copied_parameters(step_hlo), _copied_parameters(forward_hlo)
    copied = {}
    for position in range(num_inputs):
        extra = sorted(in_step.get(position, []))
        for elements in in_forward.get(position, []):
            if elements in extra:
                extra.remove(elements)
        if extra:
            copied[position] = sum(extra)
    return copied
