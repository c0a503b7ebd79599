"""Mixture schedules: interpolation, validation, and the low-discrepancy draws."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit.planning.schedule import GOLDEN_STEP, Schedule, ScheduleError, global_position, weyl_uniforms


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
