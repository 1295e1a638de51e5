"""The MILP's memory against the simulator's, statement by statement: the check every MILP
test makes on the schedules it decodes or encodes (the simulator is the one memory model;
the formulation must count as it does)."""

from __future__ import annotations

import pytest

from tfremat.plan.execution import Op


def assert_milp_memory_is_simulated(model, x, simulation, label=None) -> dict:
    """``model.memory_while_running(x)`` equals ``simulation``'s memory at every compute
    statement, keyed by (stage, node); ``label`` names the case in a failure. Returns the MILP's
    memory by (stage, node)."""
    simulated = {(s.stage, s.node): int(simulation.trace_bytes[j])
                 for j, s in enumerate(simulation.plan.statements) if s.op is Op.COMPUTE}
    modelled = model.memory_while_running(x)
    assert modelled.keys() == simulated.keys(), label
    for key, value in simulated.items():
        assert modelled[key] == pytest.approx(value), (label, key)
    return modelled
