"""InfeasibleBudgetError's message: what it keeps and how it names the smallest budget
(tfremat/errors.py)."""

from tfremat.budget import parse_budget
from tfremat.errors import InfeasibleBudgetError


def _share_of(reference):
    def shown(n):
        return f"{-(-100 * n // reference)}% ({n} B)"

    return shown


def test_the_detail_is_kept_where_the_fixed_memory_alone_is_over_the_budget():
    """A refusal of "1%" under the allocator check names a figure read from the allocator; the
    message says so even where the fixed memory alone is over the budget (it dropped the detail
    there, so the figure's origin went unsaid)."""
    error = InfeasibleBudgetError(10, 400, None, "optimal", detail="the smallest budget found was read from the "
                                  "allocator", fixed_bytes=300, shown=_share_of(1000), budget_text="'1%'")
    message = str(error)
    assert "the fixed memory alone" in message and "read from the allocator" in message, message
    assert message.endswith("a smaller batch, model or optimizer state."), message


def test_a_smallest_budget_named_as_an_amount_is_bytes_whatever_the_budget_was():
    """``smallest_as_amount``: the smallest budget is written in bytes, rounded up, even where
    the budget was a share and the error is told in its terms, and it parses back to at least
    the bytes found; the attribute survives being told in other terms."""
    error = InfeasibleBudgetError(1000, 4_582_270, None, "optimal", smallest_as_amount=True)
    told = error.in_terms(fixed_bytes=100, shown=_share_of(4_400_000), budget_text="'75%'")
    message = str(told)
    assert told.smallest_as_amount and 'found is "4.37 MiB", an amount in bytes' in message, message
    assert "%" not in message.split("found is", 1)[1].split(":")[0], message
    assert parse_budget("4.37 MiB") >= error.min_feasible_bytes
    plain = str(InfeasibleBudgetError(1000, 4_582_270, None, "optimal").in_terms(
        fixed_bytes=100, shown=_share_of(4_400_000), budget_text="'75%'"))
    assert "found is 105% (" in plain, plain
