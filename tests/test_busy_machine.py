"""A busy machine fails no test: bounds only catch hangs, property tests are bounded by examples.

On a shared 2-core machine at load 6-10 the suite failed the type check on its 120 s subprocess
bound (69 s alone), and Hypothesis's 200 ms per-example deadline can fail a correct example.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.load import MAX_STRETCH, hang_bound, load_per_cpu, stretch
from tests.helpers.processes import REPO


def test_a_bound_is_never_shortened_and_grows_with_load_up_to_a_cap() -> None:
    assert [stretch(load) for load in (0.0, 0.5, 1.0, 3.0, 8.0, 50.0)] == [1.0, 1.0, 1.0, 3.0, 8.0, MAX_STRETCH]
    assert hang_bound(120) == 120 * stretch(load_per_cpu()) >= 120


def test_property_tests_have_no_deadline_and_no_timing_health_check() -> None:
    # The profile tests/conftest.py loads for every test, whatever @settings a test adds on top.
    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check


@pytest.mark.slow  # a pytest run in a new process
def test_pytest_timeouts_are_stretched_by_the_load_when_the_test_starts(tmp_path) -> None:
    """A test sleeping past the configured per-test bound passes when the machine's load stretches it."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_timeout_set_timer  # noqa: F401\n")
    (tmp_path / "test_sleeps.py").write_text("import time\n\n\ndef test_sleeps():\n    time.sleep(1.5)\n")
    # A machine at load 4 per CPU: the 1 s bound becomes 4 s.
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.getloadavg = lambda: (4.0 * len(os.sched_getaffinity(0)),) * 3\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=1", str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_bound(120))
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 passed" in done.stdout
