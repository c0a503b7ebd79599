"""Property tests draw every example in the full suite and a third in the inner loop (tests/helpers/examples.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.helpers import examples


@pytest.mark.parametrize(
    ("marks", "ci", "full"),
    [("", None, True), ("slow", None, True), ("not slow", None, False), ("not slow and not s3", None, False)]
    + [("not slow", "true", True)],
)
def test_only_a_run_that_leaves_out_the_slow_tests_outside_ci_draws_fewer_examples(marks, ci, full) -> None:
    assert examples.full_run(marks, ci) is full


def test_the_inner_loop_draws_a_third_of_each_count_and_at_least_twenty(monkeypatch) -> None:
    monkeypatch.setattr(examples, "FULL", False)
    assert [examples.examples(n) for n in (300, 150, 60, 30)] == [100, 50, 20, 20]
    monkeypatch.setattr(examples, "FULL", True)
    assert [examples.examples(n) for n in (300, 150, 60, 30)] == [300, 150, 60, 30]


def test_this_run_draws_as_its_marks_say_counts_named_or_not(request) -> None:
    full = examples.full_run(request.config.option.markexpr or "", os.environ.get("CI"))
    assert examples.FULL is full
    assert settings.default.max_examples == (100 if full else 33)
