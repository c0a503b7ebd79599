"""How many examples a property test draws: every one in the full suite, a third in the inner loop.

The full suite (``bash scripts/test.sh``, what CI runs) draws the count each
test names. The inner loop (``-m "not slow"``: the slow tests left out) draws
a third of it, at least 20: the same properties over fewer examples, so that
the loop stays quick; a test that names no count draws a third of
Hypothesis's 100. ``tests/conftest.py`` sets :data:`FULL` from the run's mark
expression before any test module is imported; ``CI`` set in the environment
draws every example whatever the marks.
"""

from __future__ import annotations

FULL = True
"""Whether this run draws every example (set once, by ``pytest_configure``)."""

INNER_LOOP_SHARE = 3  # the inner loop draws 1/3 of each count


def examples(count: int) -> int:
    """``count`` in the full suite; a third of it (at least 20) in the inner loop."""
    return count if FULL else max(20, count // INNER_LOOP_SHARE)


def full_run(mark_expression: str, environment_ci: str | None) -> bool:
    """Whether a run with these marks draws every example: unless the slow tests are left out, or in CI."""
    return bool(environment_ci) or "not slow" not in mark_expression
