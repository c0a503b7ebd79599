"""Mixture schedules: interpolation, validation, and the low-discrepancy draws."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.planning.schedule import (
    GOLDEN_STEP,
    Schedule,
    ScheduleError,
    global_position,
    normalised,
    scaled,
    weyl_uniforms,
)
from tests.helpers.examples import examples

#: Every finite weight a schedule accepts but 0: subnormals (5e-324) up to the largest float (1.8e308).
POSITIVE = st.floats(min_value=5e-324, max_value=1.7976931348623157e308, allow_nan=False, allow_infinity=False)


def test_weights_are_interpolated_linearly_between_points_and_constant_outside():
    s = Schedule([(100, [0.9, 0.1]), (300, [0.5, 0.5]), (400, [1, 3])])
    assert s.weights_at(0).tolist() == pytest.approx([0.9, 0.1])
    assert s.weights_at(200).tolist() == pytest.approx([0.7, 0.3])
    assert s.weights_at(350).tolist() == pytest.approx([0.3, 0.7])  # [0.75, 1.75] normalised
    assert s.weights_at(10**12).tolist() == pytest.approx([0.25, 0.75])
    assert s.shares(np.array([0, 200, 10**12])) == pytest.approx(np.array([[0.9, 0.1], [0.7, 0.3], [0.25, 0.75]]))


@given(
    st.lists(st.integers(0, 10**9), min_size=1, max_size=6, unique=True).map(sorted),
    st.integers(1, 4),
    st.data(),
)
def test_shares_sum_to_one_and_match_weights_at_everywhere(positions, sources, data):
    rows = [data.draw(st.lists(st.floats(0.01, 100), min_size=sources, max_size=sources)) for _ in positions]
    schedule = Schedule(list(zip(positions, rows)))
    probes = np.array(data.draw(st.lists(st.integers(0, 2 * 10**9), min_size=1, max_size=20)))
    shares = schedule.shares(probes)
    assert np.allclose(shares.sum(axis=1), 1.0)
    for probe, row in zip(probes, shares):
        assert np.allclose(schedule.weights_at(int(probe)), row)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.lists(POSITIVE, min_size=1, max_size=5), min_size=1, max_size=3), st.data())
def test_any_positive_finite_weights_normalise_to_a_finite_distribution_summing_to_one(rows, data):
    sources = len(rows[0])
    rows = [(row * sources)[:sources] for row in rows]
    schedule = Schedule([(10 * i, row) for i, row in enumerate(rows)])
    probes = np.array(data.draw(st.lists(st.integers(0, 10 * len(rows)), min_size=1, max_size=10)))
    for shares in [*schedule.shares(probes), *(schedule.weights_at(int(p)) for p in probes)]:
        assert np.isfinite(shares).all() and (shares >= 0).all()
        assert shares.sum() == pytest.approx(1.0)
    for row in rows:  # at a point, the shares are the weights' ratios
        shares = normalised(np.array(row))
        largest = int(np.argmax(row))
        for weight, share in zip(row, shares):
            if weight / row[largest] > 1e-300:  # far above the underflow a ratio may round to
                assert share / shares[largest] == pytest.approx(weight / row[largest], rel=1e-12)


@pytest.mark.parametrize(
    "row, shares",
    [
        ([1e308, 1e308], [0.5, 0.5]),  # the sum overflowed to inf: shares [0, 0]
        ([1.7976931348623157e308, 1.7976931348623157e308, 1.7976931348623157e308], [1 / 3] * 3),
        ([5e-324, 5e-324], [0.5, 0.5]),  # subnormal: exact, not rounded to a few values
        ([1e308, 5e-324], [1.0, 0.0]),  # a share below 1e-600 is 0
        ([3.0, 1.0], [0.75, 0.25]),
    ],
)
def test_huge_and_subnormal_weights_give_the_shares_of_their_ratios(row, shares):
    schedule = Schedule([(0, row)])
    assert schedule.weights_at(0).tolist() == pytest.approx(shares)
    assert schedule.shares(np.array([0, 7])) == pytest.approx(np.array([shares, shares]))


def test_scaling_weights_by_a_power_of_two_leaves_ordinary_weights_bit_for_bit_in_ratio():
    row = np.array([0.9, 0.1, 3.0])
    assert (scaled(row) * 4 == row).all()  # largest 3.0 -> 0.75: scaled by exactly 2**-2
    assert scaled(np.zeros(2)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "points, kwargs, message",
    [
        ([], {}, "non-empty list"),
        ([(0, [1, 1]), (0, [1, 2])], {}, "positions must increase, got 0 after 0"),
        ([(-1, [1])], {}, "whole number >= 0, got -1"),
        ([(0.5, [1])], {}, "whole number >= 0, got 0.5"),
        ([(0, [1, 1]), (5, [1])], {}, "point 1 has 1 weights, point 0 has 2"),
        ([(0, [0, 0])], {}, "not all 0"),
        ([(0, [1, float("nan")])], {}, "finite"),
        ([(0, [1, float("inf")])], {}, "finite"),
        ([(0, [float("inf"), float("inf")])], {}, "finite"),
        ([(0, [1, -1])], {}, ">= 0"),
        ([(0, "ab")], {}, "weights must be a list of numbers"),
        ([(0, [1])], {"unit": "steps"}, "unit) must be one of ('samples', 'tokens'), got 'steps'"),
        ([(0, [1])], {"key": ""}, "Schedule(key) must be a non-empty str"),
    ],
)
def test_a_schedule_that_cannot_be_followed_is_refused_naming_the_point(points, kwargs, message):
    with pytest.raises(ScheduleError) as raised:
        Schedule(points, **kwargs)
    assert message in str(raised.value)


def test_a_schedule_is_plain_data_and_equal_to_its_copy():
    s = Schedule([(0, [0.9, 0.1]), (50, [1, 1])], unit="tokens", key="ids")
    assert s.to_plain() == {"unit": "tokens", "key": "ids", "points": [[0, [0.9, 0.1]], [50, [1.0, 1.0]]]}
    assert s == Schedule([(0, [0.9, 0.1]), (50, [1.0, 1.0])], unit="tokens", key="ids")
    assert s != Schedule([(0, [0.9, 0.1]), (50, [1.0, 1.0])], unit="samples", key="ids")


def test_weyl_draws_continue_where_a_position_left_off_and_stay_in_the_unit_interval():
    whole = weyl_uniforms(0.3, 0, 1000)
    assert np.array_equal(np.concatenate([weyl_uniforms(0.3, 0, 400), weyl_uniforms(0.3, 400, 600)]), whole)
    assert whole.min() >= 0 and whole.max() < 1
    assert whole[1] == pytest.approx((0.3 + GOLDEN_STEP) % 1)


@pytest.mark.parametrize("share", [0.1, 0.5, 0.73])
def test_weyl_draws_give_every_window_its_share_far_closer_than_random_draws(share):
    draws = weyl_uniforms(0.123, 0, 100_000) < share
    windows = draws.reshape(-1, 500).mean(axis=1)
    assert np.abs(windows - share).max() < 0.01  # independent uniforms: ~0.07 over 200 windows of 500


def test_the_global_position_counts_every_reader_in_step_from_the_base():
    assert global_position(0, 10, 4) == 40
    assert global_position(1000, 10, 3) == 1030
